"""Crash recovery with the real shim process: kill -9 at every step of RunPodSandbox and
RemovePodSandbox, restart, and check that the ledger and libvirt agree.

Each injection starts ``python -m shim serve`` with ``VMSANDBOX_FAULT=<point>`` (see
``shim/faults.py``), drives the RPC until the shim kills itself with SIGKILL at that point,
restarts a normal shim on the same state directory and asserts (``state_check.assert_consistent``):
every claim belongs to a READY sandbox whose guest runs, every domain of this state database has a
READY row, HugePages_Free is the baseline minus the pages of the adopted sandboxes only, no key is
held twice; and a fresh pod asking for every CPU still fits and boots. The state directory is
shared by all injections, so whatever one of them leaves behind, the next restarts find.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import libvirt
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.state_check import assert_consistent, read_domains, read_ledger, vmsandbox_free_baseline
from tests.shim_kit import LIBVIRT_URI, Shim, container, exit_code, pod, q, require_host, start_shim, stop_shim
from vmsandbox.domain_xml import read_identity

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]

RUN_POINTS = (
    "RunPodSandbox:reserve-name",
    "RunPodSandbox:claim",
    "RunPodSandbox:define",
    "RunPodSandbox:guest-start",
    "RunPodSandbox:ready",
)
REMOVE_POINTS = ("RemovePodSandbox:guest-destroy", "RemovePodSandbox:release")
REPEATS = 3  # 7 points x 3 = 21 injections
RPC_TIMEOUT = 120

# what the restarted shim must log about the sandbox the crash left behind
EXPECTED_DECISION = {
    "RunPodSandbox:reserve-name": None,
    "RunPodSandbox:claim": "which has no row: its RunPodSandbox died right after claiming",
    "RunPodSandbox:define": "row still creating, guest defined, never started",
    "RunPodSandbox:guest-start": "row still creating, guest running",
    "RunPodSandbox:ready": "reconcile: adopted sandbox",
    "RemovePodSandbox:guest-destroy": "the sandbox is READY but its guest is not running",
    "RemovePodSandbox:release": (
        "has no running guest: marked NOTREADY, 0 claims released, 1 containers marked exited"
    ),
}


# -- driving shims ------------------------------------------------------------------------------
@dataclass
class Host:
    tmp: Path
    baseline: int
    shims: int = 0
    started: list[Shim] = field(default_factory=list)  # this test's shims: none outlives it

    def start(self, fault: str | None = None) -> Shim:
        log = self.tmp / "shim.log"
        if log.exists():
            self.shims += 1
            log.rename(self.tmp / f"shim-{self.shims:03d}.log")
        shim = start_shim(self.tmp, env={"VMSANDBOX_FAULT": fault} if fault else None)
        self.started.append(shim)
        return shim

    def stop_all(self) -> None:
        """Kill every shim this test started that still runs (one whose fault point was never
        reached, when the test failed before its own clean-up)."""
        while self.started:
            stop_shim(self.started.pop(), kill=True)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    require_host()
    tmp = tmp_path_factory.mktemp("crash")
    h = Host(tmp=tmp, baseline=vmsandbox_free_baseline())
    try:
        yield h
    finally:
        _clean_up(h)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_shim_left(host: Host) -> Iterator[None]:
    yield
    host.stop_all()


def _clean_up(h: Host) -> None:
    """Whatever a failed test left: remove it through a normal shim, then make sure libvirt agrees."""
    if not (h.tmp / "state" / "state.db").exists():
        return
    shim = h.start()
    try:
        remove_everything(shim)
    finally:
        stop_shim(shim, kill=True)
    instance = read_ledger(h.tmp / "state").instance
    conn = libvirt.open(LIBVIRT_URI)
    try:
        for d in conn.listAllDomains(0):
            ident = read_identity(d.XMLDesc(0)) if d.name().startswith("vmsandbox-") else None
            if ident is not None and ident.owner == instance:  # pragma: no cover - only after a bug
                if d.isActive():
                    d.destroy()
                d.undefine()
    finally:
        conn.close()


def remove_everything(shim: Shim) -> None:
    for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=RPC_TIMEOUT)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=RPC_TIMEOUT)


def expect_killed(shim: Shim, err: pytest.ExceptionInfo[grpc.RpcError], point: str) -> str:
    """The shim died by SIGKILL at ``point`` and the RPC in flight failed UNAVAILABLE."""
    code = exit_code(shim, 60)
    text = shim.log_text()
    assert code == -signal.SIGKILL, f"shim exited {code}, not by SIGKILL:\n{text}"
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert f"fault injection: SIGKILL at {point}" in text, text
    return text


def run(shim: Shim, config: pb.PodSandboxConfig) -> str:
    return str(shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=RPC_TIMEOUT).pod_sandbox_id)


def sandbox_state(shim: Shim, sandbox_id: str) -> int:
    st = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=30)
    return int(st.status.state)


def fresh_pod_fits(shim: Shim, name: str) -> None:
    """A pod that needs every CPU the shim owns (2 on this host) fits and boots: nothing is still held."""
    sid = run(shim, pod(name, containers=[("app", q({"cpu": "2", "memory": "64Mi"}))]))
    assert sandbox_state(shim, sid) == pb.SANDBOX_READY
    shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
    shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)


# -- the injections -------------------------------------------------------------------------------
INJECTIONS = [
    pytest.param(point, rep, id=f"{point}/r{rep}") for point in (*RUN_POINTS, *REMOVE_POINTS) for rep in range(REPEATS)
]


@pytest.mark.parametrize(("point", "rep"), INJECTIONS)
def test_kill_9_at_fault_point(host: Host, point: str, rep: int) -> None:
    victim = ""
    victim_container = ""
    if point.startswith("RunPodSandbox:"):
        shim = host.start(fault=point)
        with pytest.raises(grpc.RpcError) as err:
            run(shim, pod(f"crash-{rep}"))
    else:
        normal = host.start()
        try:
            victim = run(normal, pod(f"victim-{rep}"))
            victim_container = normal.runtime.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=victim, config=container("app", q({"cpu": "1", "memory": "64Mi"}))
                ),
                timeout=30,
            ).container_id
        finally:
            stop_shim(normal)  # SIGTERM: the guest keeps running and the faulty shim adopts it
        shim = host.start(fault=point)
        with pytest.raises(grpc.RpcError) as err:
            shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=victim), timeout=RPC_TIMEOUT)
    expect_killed(shim, err, point)

    after = host.start()
    try:
        led = assert_consistent(host.tmp / "state", host.baseline)
        text = after.log_text()
        decision = EXPECTED_DECISION[point]
        if decision is not None:
            assert decision in text, text
        ready = [sid for sid, (state, _) in led.rows.items() if state == "SANDBOX_READY"]
        if point == "RunPodSandbox:ready":
            # the RPC never answered, but the guest was whole: adopted, listed and READY
            (adopted,) = ready
            assert f"reconcile: adopted sandbox {adopted[:12]}" in text
            assert sandbox_state(after, adopted) == pb.SANDBOX_READY
            assert led.rows[adopted][1]["meta"]["name"] == f"crash-{rep}"
        else:
            assert ready == [], ready
        if victim:
            # the interrupted remove left a stopped sandbox with its container exited; removing it finishes
            assert sandbox_state(after, victim) == pb.SANDBOX_NOTREADY
            assert f"{victim[:12]}" in text and f"vmsandbox-{victim[:32]}" in text
            assert led.containers[victim] == [(victim_container, "CONTAINER_EXITED")]
            after.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=victim), timeout=RPC_TIMEOUT)
        remove_everything(after)
        led = assert_consistent(host.tmp / "state", host.baseline)
        assert led.rows == {} and led.claims == {}
        assert list((host.tmp / "console").glob("*.log")) == []  # forgotten sandboxes' consoles removed
        fresh_pod_fits(after, f"fresh-{point.replace(':', '-')}-{rep}")
        assert_consistent(host.tmp / "state", host.baseline)
    finally:
        stop_shim(after, kill=True)


def test_adopted_sandbox_survives_kill_9(host: Host) -> None:
    """A plain kill -9 of the shim (no fault point): the guest keeps running, the restarted shim adopts
    it with its containers' records, answers READY for it, admits as before, and removes it cleanly."""
    first = host.start()
    try:
        sid = run(
            first,
            pod(
                "survivor",
                containers=[("app", q({"cpu": "1", "memory": "64Mi"})), ("side", q({"cpu": "500m", "memory": "32Mi"}))],
            ),
        )
        cid = first.runtime.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sid, config=container("app", q({"cpu": "1", "memory": "64Mi"}))),
            timeout=30,
        ).container_id
        before = read_ledger(host.tmp / "state")
        domain = before.rows[sid][1]["domain"]
        conn = libvirt.open(LIBVIRT_URI)
        try:
            guest_id = conn.lookupByName(domain).ID()
        finally:
            conn.close()
    finally:
        stop_shim(first, kill=True)
    assert first.process.returncode == -signal.SIGKILL

    second = host.start()
    try:
        assert f"reconcile: adopted sandbox {sid[:12]} (domain {domain})" in second.log_text()
        led = assert_consistent(host.tmp / "state", host.baseline)
        assert led.rows[sid] == before.rows[sid]
        assert led.claims.get(sid) == before.claims.get(sid)
        assert led.containers[sid] == [(cid, "CONTAINER_CREATED")]
        conn = libvirt.open(LIBVIRT_URI)
        try:
            assert conn.lookupByName(domain).ID() == guest_id  # the same QEMU process, never restarted
        finally:
            conn.close()
        assert sandbox_state(second, sid) == pb.SANDBOX_READY
        listed = second.runtime.ListContainers(pb.ListContainersRequest(), timeout=30).containers
        assert [(c.id, c.pod_sandbox_id, c.state) for c in listed] == [(cid, sid, pb.CONTAINER_CREATED)]
        # admission works from the adopted record as before
        side = second.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=sid, config=container("side", q({"cpu": "500m", "memory": "32Mi"}))
            ),
            timeout=30,
        ).container_id
        assert side
        with pytest.raises(grpc.RpcError) as err:
            second.runtime.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=sid, config=container("app", q({"cpu": "2", "memory": "64Mi"}), 1)
                ),
                timeout=30,
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        second.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
        second.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
        led = assert_consistent(host.tmp / "state", host.baseline)
        assert led.rows == {} and led.claims == {} and led.containers == {}
        assert not [d for d in read_domains() if d.owner == led.instance]
    finally:
        stop_shim(second, kill=True)


CONTAINER_POINTS = ("CreateContainer:admit", "CreateContainer:guest-create", "StartContainer:guest-start")


@pytest.mark.parametrize("point", CONTAINER_POINTS)
def test_kill_9_in_create_or_start_container_leaves_one_truth(host: Host, point: str) -> None:
    """A shim killed during CreateContainer or StartContainer: after the restart the CRI and the
    guest agree, and the kubelet's retry (a new CreateContainer, or a StartContainer) succeeds or
    fails for a real reason. A CreateContainer that never answered leaves nothing the caller
    could know of; a start the guest carried out is RUNNING."""
    shim = host.start(fault=point)
    sid = run(shim, pod(f"half-{point.replace(':', '-').lower()}"))
    config = container("app", q({"cpu": "1", "memory": "64Mi"}))
    config.command.extend(["sleep", "300"])
    cid = ""
    with pytest.raises(grpc.RpcError) as err:
        cid = shim.runtime.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sid, config=config), timeout=RPC_TIMEOUT
        ).container_id
        shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    expect_killed(shim, err, point)

    after = host.start()
    try:
        rt = after.runtime
        listed = [c.id for c in rt.ListContainers(pb.ListContainersRequest(), timeout=30).containers]
        if point.startswith("CreateContainer:"):
            assert listed == [], f"a CreateContainer that never answered left {listed}"
            cid = rt.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=sid, config=config), timeout=RPC_TIMEOUT
            ).container_id
            rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
        else:
            assert listed == [cid]
            with pytest.raises(grpc.RpcError) as again:  # it runs: a second start is refused for that reason
                rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
            assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION, again.value
        status = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
        assert status.state == pb.CONTAINER_RUNNING, status
        res = rt.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "exit 0"], timeout=30), timeout=RPC_TIMEOUT
        )
        assert res.exit_code == 0
        remove_everything(after)
        led = assert_consistent(host.tmp / "state", host.baseline)
        assert led.rows == {} and led.claims == {} and led.containers == {}
    finally:
        stop_shim(after, kill=True)
