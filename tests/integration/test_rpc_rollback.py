"""The sandbox RPCs failed after each of their steps in a real shim, with real guests and a real pod
network (CNI), where the in-process tests (``tests/shim/rpc/``) fake the guest and have no pod
network: a shim started with ``VMSANDBOX_FAULT=raise:<point>`` (``shim/faults.py``) fails that RPC
right after that step, and the RPC's own rollback runs.

- RunPodSandbox, at every step: the RPC fails UNAVAILABLE naming the point, and nothing of the pod
  is left: no row, claim, libvirt domain of this shim's state, sandbox directory, pod network
  record, network namespace, macvtap, bridge port or address. The pod's name is free: the same pod
  asked again goes as far as the first time and is rolled back the same way.
- StopPodSandbox and RemovePodSandbox, at every step: they have nothing to undo, and are
  idempotent: a shim without the fault, asked the same again, finishes, and then nothing is left.

Only this test's own state is looked at (the domains its state database defined, its own CNI
bridge, subnet, namespaces and addresses), so it runs beside other tests.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.rpc import rpc_points
from shim.rpc.remove_pod_sandbox import RPC as REMOVE
from shim.rpc.run_pod_sandbox import RPC as RUN
from shim.rpc.stop_pod_sandbox import RPC as STOP
from tests.integration.cni_kit import CniEnv, cni_env
from tests.integration.state_check import read_ledger
from tests.shim_kit import Shim, pod, require_host, start_shim, state_domains, stop_shim

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RPC_TIMEOUT = 300


@dataclass
class Env:
    tmp: Path
    cni: CniEnv
    shims: int = 0

    def start(self, fault: str = "") -> Shim:
        """A shim on this test's state; with ``fault``, one that fails the RPC right after that step."""
        log = self.tmp / "shim.log"
        if log.exists():
            self.shims += 1
            log.rename(self.tmp / f"shim-{self.shims:03d}.log")
        env = {"VMSANDBOX_FAULT": f"raise:{fault}"} if fault else None
        return start_shim(self.tmp, extra_config=self.cni.shim_config(), env=env, pull_busybox=False)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("rpcrollback")
    (tmp / "cni").mkdir()
    with cni_env(tmp / "cni", bridge="vmsbr-rpc0", subnet="10.236.0.0/24") as cni:
        (tmp / "shim").mkdir()
        e = Env(tmp / "shim", cni)
        try:
            yield e
        finally:
            shim = e.start()
            try:
                remove_everything(shim)
            finally:
                stop_shim(shim)
                shutil.rmtree(tmp, ignore_errors=True)


def remove_everything(shim: Shim) -> None:
    for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=RPC_TIMEOUT)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=RPC_TIMEOUT)


def sandboxes_named(shim: Shim, name: str) -> set[str]:
    """The sandboxes the shim's log says it claimed for pod ``test/<name>`` (ids cut to 12)."""
    return set(re.findall(rf"sandbox ([0-9a-f]{{12}}) for pod test/{re.escape(name)}: ", shim.log_text()))


def assert_nothing_left(env: Env, shim: Shim, tried: set[str]) -> None:
    """Nothing of any sandbox is held by this test's shim: rows, claims, domains, directories, pod
    networks; and nothing of the ``tried`` sandboxes (ids cut to 12) is on the host."""
    state = shim.state_dir
    led = read_ledger(state)
    assert led.rows == {} and led.claims == {} and led.containers == {}, led
    assert state_domains(state) == []
    sandboxes = state / "sandboxes"
    assert not sandboxes.is_dir() or list(sandboxes.iterdir()) == []
    assert list((state / "network").glob("*.json")) == []
    leftovers = env.cni.leftovers()
    assert leftovers["namespaces"] == [] and leftovers["allocations"] == [], leftovers
    assert env.cni.bridge_ports() == []
    assert not [m for m in leftovers["macvtaps"] if m.removeprefix("vmt") in tried], leftovers["macvtaps"]


def fails_at(shim: Shim, point: str, call: Callable[..., object], request: object) -> str:
    """``call(request)`` fails UNAVAILABLE, naming ``point``; its message."""
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=RPC_TIMEOUT)
    details = str(err.value.details())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, f"{details}\n{shim.log_text()[-3000:]}"
    assert f"fault injected at {point}" in details, details
    return details


@pytest.mark.parametrize("point", rpc_points(RUN))
def test_a_run_failed_after_any_step_leaves_nothing(env: Env, point: str) -> None:
    name = f"run-{point.split(':')[1]}"
    shim = env.start(point)
    try:
        request = pb.RunPodSandboxRequest(config=pod(name))
        first = fails_at(shim, point, shim.runtime.RunPodSandbox, request)
        tried = sandboxes_named(shim, name)
        assert_nothing_left(env, shim, tried)
        # the name is free: the same pod goes as far again, and is rolled back the same way
        again = fails_at(shim, point, shim.runtime.RunPodSandbox, request)
        assert re.sub(r"[0-9a-f]{12,}", "", again) == re.sub(r"[0-9a-f]{12,}", "", first)
        assert_nothing_left(env, shim, sandboxes_named(shim, name))
    finally:
        stop_shim(shim)


def run_pod(env: Env, shim: Shim, name: str) -> str:
    """A READY pod on the test's pod network."""
    config = pod(name)
    sandbox_id = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=RPC_TIMEOUT).pod_sandbox_id
    assert len(env.cni.allocations()) == 1 and len(env.cni.bridge_ports()) == 1, env.cni.leftovers()
    return str(sandbox_id)


@pytest.mark.parametrize("point", rpc_points(STOP))
def test_a_stop_failed_after_any_step_is_finished_by_the_next(env: Env, point: str) -> None:
    faulty = env.start(point)
    try:
        sandbox_id = run_pod(env, faulty, f"stop-{point.split(':')[1]}")
        stop = pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id)
        fails_at(faulty, point, faulty.runtime.StopPodSandbox, stop)
    finally:
        stop_shim(faulty)
    shim = env.start()
    try:
        shim.runtime.StopPodSandbox(stop, timeout=RPC_TIMEOUT)
        led = read_ledger(shim.state_dir)
        assert led.rows[sandbox_id][0] == "SANDBOX_NOTREADY" and led.claims == {}, led
        assert state_domains(shim.state_dir) == []
        assert env.cni.allocations() == [] and env.cni.bridge_ports() == []  # CNI DEL done
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=RPC_TIMEOUT)
        assert_nothing_left(env, shim, {sandbox_id[:12]})
    finally:
        stop_shim(shim)


@pytest.mark.parametrize("point", rpc_points(REMOVE))
def test_a_removal_failed_after_any_step_is_finished_by_the_next(env: Env, point: str) -> None:
    faulty = env.start(point)
    try:
        sandbox_id = run_pod(env, faulty, f"remove-{point.split(':')[1]}")
        remove = pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)
        fails_at(faulty, point, faulty.runtime.RemovePodSandbox, remove)
    finally:
        stop_shim(faulty)
    shim = env.start()
    try:
        shim.runtime.RemovePodSandbox(remove, timeout=RPC_TIMEOUT)
        assert_nothing_left(env, shim, {sandbox_id[:12]})
        assert not (shim.state_dir.parent / "console" / f"{sandbox_id}.log").exists()
    finally:
        stop_shim(shim)
