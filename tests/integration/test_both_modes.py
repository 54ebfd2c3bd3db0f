"""The same CRI-level scenarios against both of vmsandbox's modes, on one vmsandbox and one
containerd 2.4: the CRI proxy mode (crictl on vmsandbox's socket, containerd downstream) and the
shim mode (crictl on containerd's socket, the ``vmsandbox`` handler through vmsandbox's runtime
shim). Each scenario runs once per mode; what differs between the modes is in ``Mode`` (the
socket, and the RPC at which a divergent container is refused: containerd makes the task at
StartContainer), and one test proves that a pod gets the same VM either way."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.containerd_shim_kit import Env, container_config, pod_config, shim_mode
from tests.ports import quiet_port
from tests.shim_kit import state_domains

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Mode:
    name: str
    refused_at: str  # the crictl verb whose RPC refuses a container the pod's VM cannot hold

    def endpoint(self, env: Env) -> str:
        return f"unix://{env.shim.socket}" if self.name == "proxy" else env.ctd.endpoint


MODES = [Mode("proxy", refused_at="create"), Mode("shim", refused_at="start")]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with shim_mode("vmsandbox-modes-", bridge="vmsbr-mod0", subnet="10.235.0.0/24", proxy=True) as env:
        yield env


class Run:
    """crictl on one mode's socket, with the pod and container documents it writes."""

    def __init__(self, env: Env, mode: Mode) -> None:
        self.env, self.mode = env, mode
        self.logs = env.tmp / "logs" / mode.name
        self.logs.mkdir(parents=True, exist_ok=True)

    def __call__(self, *args: str, check: bool = True) -> str:
        return self.env.crictl_on(self.mode.endpoint(self.env), *args, check=check).stdout

    def failing(self, *args: str) -> str:
        done = self.env.crictl_on(self.mode.endpoint(self.env), *args, check=False)
        assert done.returncode != 0, f"crictl {' '.join(args)} succeeded: {done.stdout}"
        return done.stderr

    def pod(self, name: str, **sizing: int) -> tuple[str, str]:
        """A VM pod: its id and its config file."""
        config = pod_config(f"{self.mode.name}-{name}", **sizing)
        config["log_directory"] = str(self.logs / name)
        path = self.env.write(f"{self.mode.name}-{name}-pod.json", config)
        return self("runp", "--runtime", "vmsandbox", path).strip(), path

    def container(self, sid: str, pod: str, name: str, command: list[str], memory: int = 64 << 20) -> str:
        path = self.env.write(
            f"{self.mode.name}-{name}-ctr.json", container_config(name, command, self.env.image, memory=memory)
        )
        return self("create", sid, path, pod).strip()

    def until(self, what: Callable[[], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline, self.env.shim.log_text()[-2000:]
            time.sleep(0.5)

    def remove_pod(self, sid: str) -> None:
        self("stopp", sid)
        self("rmp", sid)
        listed = self.env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
        assert sid not in [s.id for s in listed]


def vm_pods(env: Env) -> dict[str, str]:
    """Pod id -> runtime handler, of the pods vmsandbox's own socket lists as VMs."""
    listed = env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
    return {s.id: s.runtime_handler for s in listed if s.runtime_handler}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_a_vm_pod_runs_logs_execs_resizes_stops_and_leaves_nothing(env: Env, mode: Mode) -> None:
    run = Run(env, mode)
    run("pull", env.image)
    domains = set(state_domains(env.shim.state_dir))
    sid, pod = run.pod("life")
    status = json.loads(run("inspectp", sid))["status"]
    assert status["state"] == "SANDBOX_READY" and status["network"]["ip"].startswith("10.235.0."), status
    assert vm_pods(env).get(sid) == "vmsandbox"
    assert len(set(state_domains(env.shim.state_dir)) - domains) == 1

    cid = run.container(sid, pod, "app", ["/bin/sh", "-c", "echo hello from a VM; exec sleep 3600"])
    run("start", cid)
    run.until(lambda: "hello from a VM" in run("logs", cid))
    done = env.crictl_on(mode.endpoint(env), "exec", cid, "/bin/sh", "-c", "echo $((6*7)); exit 3", check=False)
    assert done.stdout.strip() == "42" and done.returncode != 0 and "exit code 3" in done.stderr, done.stderr

    def working_set() -> bool:
        stats = json.loads(run("stats", "-o", "json", "--id", cid))["stats"]
        return bool(stats) and int(stats[0]["memory"]["workingSetBytes"]["value"]) > 0

    run.until(working_set)
    # within what the pod's VM holds a container resizes, and its cgroup in the guest follows
    run("update", "--memory", str(96 << 20), cid)
    assert run("exec", cid, "cat", "/sys/fs/cgroup/memory.max").strip() == str(96 << 20)

    run("stop", "--timeout", "5", cid)
    state = json.loads(run("inspect", cid))["status"]
    assert state["state"] == "CONTAINER_EXITED" and state["exitCode"] in (137, 143), state
    run("rm", cid)
    run.remove_pod(sid)
    assert set(state_domains(env.shim.state_dir)) == domains


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_a_container_beyond_the_pods_vm_is_refused_with_the_reason(env: Env, mode: Mode) -> None:
    run = Run(env, mode)
    run("pull", env.image)
    sid, pod = run.pod("divergent", memory=128 << 20)
    big = env.write(f"{mode.name}-big.json", container_config("big", ["/bin/sleep", "3600"], env.image, memory=4 << 30))
    if mode.refused_at == "create":
        refused = run.failing("create", sid, big, pod)
    else:
        cid = run("create", sid, big, pod).strip()
        refused = run.failing("start", cid)
        run("rm", cid)
    assert "memory" in refused and len(refused) < 4096, refused
    # the refusal cost the pod nothing: it still runs what fits
    assert json.loads(run("inspectp", sid))["status"]["state"] == "SANDBOX_READY"
    cid = run.container(sid, pod, "small", ["/bin/sh", "-c", "echo fits; exec sleep 3600"])
    run("start", cid)
    run.until(lambda: "fits" in run("logs", cid))
    run.remove_pod(sid)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_port_forward_reaches_a_server_in_the_guest(env: Env, mode: Mode) -> None:
    """crictl port-forward: vmsandbox's streaming server connects to the pod's address in proxy
    mode; containerd's dials the pod namespace's loopback in shim mode, which vmsandbox forwards
    into the guest. Either way a line reaches the container's server and its answer comes back."""
    run = Run(env, mode)
    run("pull", env.image)
    sid, pod = run.pod("forward")
    script = "while true; do nc -l -p 8080 -e sh -c 'read l; echo pong:$l'; done"
    cid = run.container(sid, pod, "server", ["/bin/sh", "-c", script])
    run("start", cid)
    # the first connection a port-forward cannot make ends crictl's forwarding: the server listens first
    env.until_listening(mode.endpoint(env), cid, 8080)
    local = quiet_port()
    forward = subprocess.Popen(
        [env.crictl_bin, "--runtime-endpoint", mode.endpoint(env), "port-forward", sid, f"{local}:8080"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    answers: list[bytes] = []

    def answered() -> bool:  # once crictl listens and the container's server is up
        try:
            with socket.create_connection(("127.0.0.1", local), timeout=20) as c:
                c.sendall(f"{mode.name}\n".encode())
                answers.append(c.recv(100))
        except OSError:
            return False
        return bool(answers[-1])

    try:
        run.until(answered, timeout_s=90)
    finally:
        forward.terminate()
        forward.wait(timeout=10)
    assert answers[-1] == f"pong:{mode.name}\n".encode()
    run.remove_pod(sid)


def test_a_pod_gets_the_same_vm_in_both_modes(env: Env) -> None:
    """One pod config through each socket: the guest's CPUs and memory, and the container's
    cgroup limits in it, are the same (one core sizes both)."""
    seen: dict[str, tuple[str, ...]] = {}
    for mode in MODES:
        run = Run(env, mode)
        run("pull", env.image)
        sid, pod = run.pod("shape", cpu_millis=1500, memory=256 << 20)
        cid = run.container(sid, pod, "shape", ["/bin/sleep", "3600"], memory=96 << 20)
        run("start", cid)
        seen[mode.name] = tuple(
            run("exec", cid, "/bin/sh", "-c", command).strip()
            for command in (
                "nproc",
                "grep MemTotal /proc/meminfo",
                "cat /sys/fs/cgroup/memory.max",
                "cat /sys/fs/cgroup/cpu.max",
            )
        )
        run.remove_pod(sid)
    assert seen["proxy"] == seen["shim"], seen
    assert seen["proxy"][2] == str(96 << 20)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_a_pod_with_a_user_namespace_of_its_own_runs_its_container_mapped(env: Env, mode: Mode) -> None:
    """``hostUsers: false``, as the kubelet sends it (the container's config carries the user
    namespace too): the container runs in the pod's user namespace with the kubelet's mapping. In
    shim mode containerd makes the pod's network namespace inside it, and starts the container's
    task with runc's options naming its fifos' owner, which vmsandbox's runtime takes."""
    run = Run(env, mode)
    run("pull", env.image)
    mapping = [{"host_id": 20 * 65536, "container_id": 0, "length": 65536}]
    namespaces = {"pid": 1, "userns_options": {"mode": 0, "uids": mapping, "gids": mapping}}  # pid CONTAINER, POD
    config = pod_config(f"{mode.name}-userns")
    config["log_directory"] = str(run.logs / "userns")
    config["linux"]["security_context"] = {"namespace_options": namespaces}  # type: ignore[index]
    pod = env.write(f"{mode.name}-userns-pod.json", config)
    sid = run("runp", "--runtime", "vmsandbox", pod).strip()
    ctr = container_config("mapped", ["/bin/sleep", "3600"], env.image)
    ctr["linux"]["security_context"] = {"namespace_options": namespaces}  # type: ignore[index]  # as the kubelet's
    cid = run("create", sid, env.write(f"{mode.name}-mapped-ctr.json", ctr), pod).strip()
    run("start", cid)
    assert run("exec", cid, "cat", "/proc/self/uid_map").split() == ["0", str(20 * 65536), "65536"]
    run.remove_pod(sid)
