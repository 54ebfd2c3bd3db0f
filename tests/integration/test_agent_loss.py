"""Guest root against the CRI, with a real guest through the real socket: a privileged container
that shares the guest's PID namespace kills the agent (``kill -9``); /init starts a new agent,
which has none of the pod's containers. The shim must not keep reporting them: within a bounded
time the sandbox is NOTREADY and the container EXITED as containerd reports a lost task (255,
``Unknown``), and Stop/Remove leave nothing behind (pages, claims, domain, shared directory). A
shim restart that reconnects to the same agent (adoption) is not a lost agent, and an ExecSync
answer of several MiB (one line of the protocol) arrives whole."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.state_check import assert_consistent, vmsandbox_free_baseline
from tests.registry_kit import BUSYBOX
from tests.shim_kit import (
    Shim,
    container,
    our_domains,
    pod,
    q,
    remove_all,
    require_host,
    start_shim,
    stop_shim,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]

RES = q({"cpu": "250m", "memory": "32Mi"})
# busybox ash without pidof: find the agent by its command name, wait until the shim saw the start
KILL_AGENT = (
    "sleep 3; for d in /proc/[0-9]*; do read -r c < $d/comm 2>/dev/null; "
    '[ "$c" = vmsandbox-agent ] && kill -9 ${d#/proc/}; done; sleep 3600'
)


def _sandbox_state(shim: Shim, sid: str) -> int:
    return int(shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=30).status.state)


def _container_status(shim: Shim, cid: str) -> pb.ContainerStatus:
    return shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status


def _run(
    shim: Shim, name: str, command: str, *, privileged: bool = False, res: pb.KubernetesResources = RES
) -> tuple[str, str]:
    config = pod(name, containers=[("app", res)])
    sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    c = container("app", res)
    c.command[:] = ["sh", "-c", command]
    if privileged:
        c.linux.security_context.privileged = True
        c.linux.security_context.namespace_options.pid = pb.NODE  # sees guest init and the agent
    cid = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
    ).container_id
    shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    return sid, cid


def test_guest_root_killing_the_agent_turns_the_sandbox_notready(tmp_path: Path) -> None:
    require_host()
    (tmp_path / "shim").mkdir()
    shim = start_shim(tmp_path / "shim")
    try:
        baseline = vmsandbox_free_baseline()
        sid, cid = _run(shim, "agent-killer", KILL_AGENT, privileged=True)
        assert _container_status(shim, cid).state == pb.CONTAINER_RUNNING
        started = time.monotonic()
        deadline = started + 60
        while _sandbox_state(shim, sid) != pb.SANDBOX_NOTREADY:
            assert time.monotonic() < deadline, f"the sandbox stayed READY\n{shim.log_text()[-3000:]}"
            time.sleep(0.2)
        print(f"NOTREADY {time.monotonic() - started:.1f} s after StartContainer (the kill comes 3 s in)")
        status = _container_status(shim, cid)
        assert (status.state, status.exit_code, status.reason) == (pb.CONTAINER_EXITED, 255, "Unknown")
        assert "guest agent was lost" in status.message and "started over" in status.message, status.message
        assert status.finished_at >= status.started_at > 0
        assert "its guest agent was lost" in shim.log_text()

        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        assert not shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
        assert not shim.runtime.ListContainers(pb.ListContainersRequest(), timeout=30).containers
        assert not our_domains(shim)
        assert not (shim.state_dir / "sandboxes" / sid).exists()
        led = assert_consistent(shim.state_dir, baseline)  # the host's pages back, claims released
        assert not led.rows and not led.claims
    finally:
        remove_all(shim)
        stop_shim(shim)


def test_a_restarted_shim_adopts_the_same_agent(tmp_path: Path) -> None:
    require_host()
    (tmp_path / "shim").mkdir()
    shim = start_shim(tmp_path / "shim")
    try:
        # room for the agent's copies of a large exec answer (a 128 MiB guest's agent is OOM-killed
        # building one of 4 MB: the lost agent this module is about)
        sid, cid = _run(shim, "adopted", "sleep 3600", res=q({"cpu": "250m", "memory": "160Mi"}))
        stop_shim(shim)
        shim = start_shim(tmp_path / "shim")
        time.sleep(5)  # the start-up pass connects to the adopted guest's agent meanwhile
        assert _sandbox_state(shim, sid) == pb.SANDBOX_READY, shim.log_text()[-3000:]
        assert _container_status(shim, cid).state == pb.CONTAINER_RUNNING
        res = shim.runtime.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["echo", "still here"], timeout=60), timeout=120
        )
        assert res.stdout == b"still here\n"
        # an answer over a mebibyte (the line limit was 1 MiB): the image's busybox, about 2 MB
        res = shim.runtime.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["cat", "/bin/busybox"], timeout=120), timeout=300
        )
        assert res.exit_code == 0 and res.stdout == BUSYBOX.read_bytes()
        assert _sandbox_state(shim, sid) == pb.SANDBOX_READY
        assert "agent was lost" not in shim.log_text()
    finally:
        remove_all(shim)
        stop_shim(shim)
