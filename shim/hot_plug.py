"""The resize headroom brought into running guests (``vmsandbox.resize``): vCPUs through the guest
agent's ``cpus_online`` (the headroom's vCPUs are present and pinned from boot, each with its QEMU
thread, and the guest's kernel booted the pod's alone: ``maxcpus=``), RAM as a DIMM hot-plugged
through libvirt, backed like the rest of the guest's RAM; then the guest's own report must show
them online (the kernel onlines the DIMM's memory). What is plugged is read from the running
guest, never from a record: the online vCPUs from its report, the DIMMs from its live XML, so a
plug interrupted by a crash is finished by the next resize and no DIMM is plugged twice. Nothing is
ever unplugged or taken offline, and nothing is claimed here: the headroom's host CPUs and pages
were claimed with the rest of the VM at RunPodSandbox.

A guest that lies about its online vCPUs only hurts itself: the host CPUs of all its vCPUs are
reserved and pinned whatever it says; what it reports is clamped to the headroom.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shim import faults
from shim.agent_pool import AgentPool
from shim.model import SandboxRecord
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.agent_protocol import GuestReport, report_from_body
from vmsandbox.domain import domain_name
from vmsandbox.domain_xml import memory_dimm, read_dimm_kib
from vmsandbox.errors import InfrastructureError
from vmsandbox.resize import Plugged, describe

log = logging.getLogger(__name__)

#: How long a guest has to bring plugged vCPUs and memory online (TCG guests take ~1 s).
ONLINE_TIMEOUT_S = 30.0


class HotPlug:
    def __init__(
        self,
        hypervisor: Hypervisor,
        agents: AgentPool,
        *,
        timeout_s: float = ONLINE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hypervisor = hypervisor
        self.agents = agents
        self.timeout_s = timeout_s
        self._clock = clock

    def plugged(self, record: SandboxRecord) -> Plugged:
        """What resizes have brought into the sandbox's running guest so far."""
        return self._plugged(record, self._report(record.id))

    def _plugged(self, record: SandboxRecord, report: GuestReport) -> Plugged:
        shape = record.sized_shape()
        vcpus = min(shape.headroom_vcpus, max(0, report.vcpus - shape.vcpus))
        dimm_kib = read_dimm_kib(self.hypervisor.live_xml(domain_name(record.id)))
        return Plugged(vcpus=vcpus, memory_bytes=dimm_kib * 1024)

    def grow(self, record: SandboxRecord, want: Plugged) -> Plugged:
        """Bring what ``want`` has beyond what the guest holds online, and wait until the guest
        reports it; what is plugged afterwards (``want`` itself when it asks for nothing: a growth
        the VM holds as booted asks nothing of the guest). InfrastructureError when the guest does
        not show it."""
        if Plugged().covers(want):
            return want
        t0 = self._clock()
        before = self._report(record.id)
        have = self._plugged(record, before)
        shape = record.sized_shape()
        if have.covers(want):  # e.g. a resize retried after a crash that had finished the plug
            log.info(
                "sandbox %s: %s already (guest: %d vCPUs, MemTotal %d KiB)",
                record.id[:12],
                describe(shape, have),
                before.vcpus,
                before.mem_total_kib,
            )
            return have
        name = domain_name(record.id)
        target = Plugged(vcpus=max(want.vcpus, have.vcpus), memory_bytes=max(want.memory_bytes, have.memory_bytes))
        vcpus = shape.vcpus + target.vcpus
        if target.vcpus > have.vcpus:
            self.agents.client(record.id).cpus_online(vcpus)
        faults.checkpoint("hot-plug:after-vcpus")
        added = target.memory_bytes - have.memory_bytes
        if added:
            page_kib = shape.backing_page_size // 1024 if shape.hugepage_backed else 4
            self.hypervisor.attach_device(name, memory_dimm(added // 1024, page_kib))
        faults.checkpoint("hot-plug:after-dimm")
        # the guest's MemTotal grows by the DIMM (by all of it, as measured: bench/resize.py); 1/64
        # of slack for a kernel that keeps the DIMM's own page structures in it (memmap_on_memory)
        mem_kib = before.mem_total_kib + (added // 1024) * 63 // 64
        deadline = t0 + self.timeout_s
        while True:
            report = self._report(record.id)
            if report.vcpus >= vcpus and report.mem_total_kib >= mem_kib:
                break
            if self._clock() >= deadline:
                raise InfrastructureError(
                    f"the guest did not bring the resize's headroom online within {self.timeout_s:g} s: it reports "
                    f"{report.vcpus} vCPUs and MemTotal {report.mem_total_kib} KiB, expected {vcpus} and at least "
                    f"{mem_kib} KiB ({describe(shape, target)})"
                )
            time.sleep(0.1)
        log.info(
            "sandbox %s: plugged %s in %.0f ms (guest: %d vCPUs, MemTotal %d KiB)",
            record.id[:12],
            describe(shape, target),
            (self._clock() - t0) * 1000,
            report.vcpus,
            report.mem_total_kib,
        )
        return target

    def _report(self, sandbox_id: str) -> GuestReport:
        body = self.agents.client(sandbox_id).request("report", {}, timeout_s=10)
        return report_from_body(body)
