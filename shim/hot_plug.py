"""The resize headroom plugged into running guests (``vmsandbox.resize``): vCPUs through libvirt's
live vCPU count (pinned as the definition pinned them), RAM as a DIMM backed like the rest of the
guest's RAM, then the guest's own report must show them online (its agent onlines hot-plugged
CPUs; the kernel onlines memory). What is plugged is read from the running domain, never from a
record, so a plug interrupted by a crash is finished by the next resize; nothing is ever
unplugged, and nothing is claimed here: the headroom's host CPUs and pages were claimed with the
rest of the VM at RunPodSandbox.
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
from vmsandbox.domain_xml import memory_dimm, read_plugged
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
        vcpus_plugged: Callable[[SandboxRecord], object] = lambda _record: None,
    ) -> None:
        self.hypervisor = hypervisor
        # libvirt puts a hot-plugged vCPU's thread in its own per-vCPU cpu and cpuacct groups: this
        # moves the pod's QEMU back into its pod's cgroup (``Boot.place``)
        self._vcpus_plugged = vcpus_plugged
        self.agents = agents
        self.timeout_s = timeout_s
        self._clock = clock

    def plugged(self, record: SandboxRecord) -> Plugged:
        """What resizes have plugged into the sandbox's running guest so far."""
        online, dimm_kib = read_plugged(self.hypervisor.live_xml(domain_name(record.id)))
        return Plugged(vcpus=max(0, online - record.sized_shape().vcpus), memory_bytes=dimm_kib * 1024)

    def grow(self, record: SandboxRecord, want: Plugged) -> Plugged:
        """Plug what ``want`` has beyond what the guest holds, and wait until the guest has it
        online; what is plugged afterwards. InfrastructureError when the guest does not show it."""
        have = self.plugged(record)
        if have.covers(want):
            return have
        shape = record.sized_shape()
        name = domain_name(record.id)
        t0 = self._clock()
        before = self._report(record.id)
        target = Plugged(vcpus=max(want.vcpus, have.vcpus), memory_bytes=max(want.memory_bytes, have.memory_bytes))
        if target.vcpus > have.vcpus:
            self.hypervisor.set_vcpus(name, shape.vcpus + target.vcpus)
            self._vcpus_plugged(record)
        faults.checkpoint("hot-plug:after-vcpus")
        added = target.memory_bytes - have.memory_bytes
        if added:
            page_kib = shape.backing_page_size // 1024 if shape.hugepage_backed else 4
            self.hypervisor.attach_device(name, memory_dimm(added // 1024, page_kib))
        faults.checkpoint("hot-plug:after-dimm")
        vcpus = shape.vcpus + target.vcpus
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
