"""What the ``test_cluster*.py`` files need around a one-node cluster of ``scripts/cluster.sh``: the
binaries (``$KUBE_BIN``, else ``scripts/build-k8s.sh``'s), ``up``/``down`` (``running_cluster``, the
body of each file's module fixture), kubectl, ``apply``/``running``/``until``/``exec_in``, the
shim's view of its sandboxes, what a pod may leave behind on the host, and the test image
(busybox-static and ``tests/cluster_kit/probe``, built by buildah in Docker format)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from cli.inspect_state import claims
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from tests.integration.image_setup import require_image_tools
from tests.registry_kit import BUSYBOX, DOCKER_MANIFEST, Buildah, served_manifest
from tests.shim_kit import REPO, require_host, state_domains

SCRIPT = REPO / "scripts" / "cluster.sh"
BUILD_K8S = REPO / "scripts" / "build-k8s.sh"
PROBE_SRC = REPO / "tests" / "cluster_kit" / "probe"
GO = Path("/usr/local/go/bin/go")
# the cluster's registry and pod bridge, as scripts/cluster.sh reads them from the environment
REGISTRY = f"127.0.0.1:{os.environ.get('CLUSTER_REGISTRY_PORT', '15000')}"
BRIDGE = os.environ.get("CLUSTER_POD_BRIDGE", "vmsbr-k8s0")
# the pods' image: docker.io, which the cluster's shim and containerd mirror from its registry
IMAGE = "docker.io/vmsandbox-test/hello:1"


def _go() -> str | None:
    return str(GO) if GO.is_file() else shutil.which("go")


def built_crictl() -> str | None:
    """crictl for the tests that drive it: $CRICTL, else one on PATH, else the one
    ``scripts/build-k8s.sh`` keeps for its pin (K8S_CACHE, K8S_PIN as the script reads them) when
    it has been built; None (those tests skip) otherwise. Nothing is built here."""
    if os.environ.get("CRICTL"):
        return os.environ["CRICTL"]
    on_path = shutil.which("crictl")
    if on_path:
        return on_path
    pin = os.environ.get("K8S_PIN", "1.37").removeprefix("v")
    cached = Path(os.environ.get("K8S_CACHE", "/var/cache/vmsandbox/k8s")) / pin / "bin" / "crictl"
    return str(cached) if os.access(cached, os.X_OK) else None


def kube_bin() -> str:
    """$KUBE_BIN, else the bin directory of ``scripts/build-k8s.sh`` (instant when its cache is up
    to date, about 10 minutes cold). Skipped without Go, except under CI, where that fails."""
    if os.environ.get("KUBE_BIN"):
        return os.environ["KUBE_BIN"]
    if _go() is None:
        message = "KUBE_BIN not set and no Go to build the cluster's binaries (scripts/build-k8s.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    done = subprocess.run(
        ["bash", str(BUILD_K8S)], capture_output=True, text=True, timeout=2400, stdin=subprocess.DEVNULL, check=False
    )
    assert done.returncode == 0, f"scripts/build-k8s.sh failed:\n{done.stderr[-4000:]}"
    return done.stdout.strip().splitlines()[-1]


@dataclass
class Cluster:
    dir: Path
    bin: str
    up_seconds: float
    host_before: dict[str, Any]
    figures: dict[str, float] = field(default_factory=dict)

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 120, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(Path(self.bin) / "kubectl"), "--kubeconfig", str(self.dir / "admin.kubeconfig"), *args]
        stdin = None if input is not None else subprocess.DEVNULL
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=stdin, input=input)
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}\n{self.logs_tail()}"
        return done

    def kubectl_argv(self, *args: str) -> list[str]:
        return [str(Path(self.bin) / "kubectl"), "--kubeconfig", str(self.dir / "admin.kubeconfig"), *args]

    def logs_tail(self) -> str:
        out = []
        for name in ("shim.log", "kubelet.log"):
            path = self.dir / "logs" / name
            if path.is_file():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    @property
    def state_dir(self) -> Path:
        return self.dir / "shim" / "state"

    def sandboxes(self) -> list[pb.PodSandbox]:
        with grpc.insecure_channel(f"unix:{self.dir / 'shim' / 'cri.sock'}") as channel:
            rt = pb_grpc.RuntimeServiceStub(channel)
            return list(rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items)

    def leftovers(self) -> dict[str, object]:
        """What a pod may leave behind: VMs of this shim, network namespaces, host-local
        allocations, hugepage/CPU/memory claims, ports on the pod bridge."""
        brif = Path("/sys/class/net", BRIDGE, "brif")
        return {
            "domains": state_domains(self.state_dir),
            "namespaces": sorted(p.name for p in (self.dir / "netns").iterdir()),
            "allocations": sorted(
                p.name for p in (self.dir / "ipam").glob("*/*") if p.name[0].isdigit() and p.name.count(".") == 3
            ),
            "claims": sorted(claims(self.state_dir)),
            "bridge ports": sorted(p.name for p in brif.iterdir()) if brif.is_dir() else [],
        }


def iptables_chains() -> set[str]:
    out = set()
    for family in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            done = subprocess.run([family, "-w", "5", "-t", table, "-S"], capture_output=True, text=True, check=False)
            out |= {
                f"{family} {table} {line.split()[1]}" for line in done.stdout.splitlines() if line.startswith("-N ")
            }
    return out


def host_state() -> dict[str, Any]:
    """What ``up`` changes on the host and ``down`` must put back."""
    return {
        "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text(),
        "bridge": Path("/sys/class/net", BRIDGE).exists(),
        "kubelet paths": [p for p in ("/var/lib/kubelet", "/var/log/pods", "/var/log/containers") if Path(p).exists()],
        "iptables": iptables_chains(),
    }


def script(
    cluster_dir: Path, bin_dir: str, *args: str, timeout: float = 600, mode: str = "proxy"
) -> subprocess.CompletedProcess[str]:
    # the kubelet syncs each pod every 10 s, so that a ConfigMap update reaches its volume soon
    env = {
        **os.environ,
        "CLUSTER_DIR": str(cluster_dir),
        "KUBE_BIN": bin_dir,
        "CLUSTER_SYNC_FREQUENCY": "10s",
        "CLUSTER_MODE": mode,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


def build_probe(out: Path) -> bytes:
    """tests/cluster_kit/probe, static (no cgo), with the Go on this host."""
    go = _go()
    if go is None:
        pytest.skip("no Go to build tests/cluster_kit/probe")
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOWORK": "off", "GOFLAGS": "-mod=readonly"}
    done = subprocess.run(
        [go, "build", "-trimpath", "-ldflags", "-s -w", "-o", str(out), "."],
        cwd=PROBE_SRC,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"go build probe: {done.stderr}"
    return out.read_bytes()


def push_image(tmp: Path) -> str:
    """A Docker schema 2 image with busybox-static and the probe, built by buildah and pushed to the
    cluster's registry; the reference pods use."""
    buildah = Buildah(tmp / "buildah")
    busybox = BUSYBOX.read_bytes()
    passwd = b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/:/bin/sh\n"
    files = {"bin/busybox": busybox, "bin/sh": busybox, "etc/passwd": passwd, "bin/probe": build_probe(tmp / "probe")}
    buildah.image(
        "hello",
        [files],
        cmd='["/bin/sh", "-c", "echo hello from a docker image; id -u; exec /bin/busybox sleep 3600"]',
        user="1000",
    )
    buildah.push("hello", f"{REGISTRY}/vmsandbox-test/hello:1")
    manifest = json.loads(served_manifest(REGISTRY, "vmsandbox-test/hello", "1", accept=DOCKER_MANIFEST))
    assert manifest["mediaType"] == DOCKER_MANIFEST, manifest
    return IMAGE


def running_cluster(mode: str = "proxy") -> Iterator[Cluster]:
    """``up`` a cluster in a directory of its own, yield it, ``down`` it (its logs kept beside it).
    The body of each cluster test file's module fixture; one cluster at a time on a host (the
    script's ports and bridge, ``CLUSTER_*`` variables, unless set otherwise). ``mode``: the
    script's ``CLUSTER_MODE``, "proxy" (the kubelet on vmsandbox's socket) or "shim" (on
    containerd's, vmsandbox its runtime shim)."""
    bin_dir = kube_bin()
    require_host()
    require_image_tools()
    # not below pytest's own 0700 directory: each sandbox's QEMU, as a uid of its own, must pass
    # through every directory above its sandbox's (the shim's state lives in the cluster's)
    tmp = Path(tempfile.mkdtemp(prefix="vmsandbox-cluster-", dir="/var/tmp"))
    tmp.chmod(0o711)
    cluster_dir = tmp / "c"
    before = host_state()
    t0 = time.monotonic()
    up = script(cluster_dir, bin_dir, "up", mode=mode)
    up_seconds = time.monotonic() - t0
    assert up.returncode == 0, f"cluster.sh up failed:\n{up.stdout[-3000:]}\n{up.stderr[-6000:]}"
    ready = [line for line in up.stdout.splitlines() if " Ready " in line]
    print(f"\ncluster: up in {up_seconds:.1f} s ({ready[-1] if ready else 'no Ready line'})")
    running = Cluster(cluster_dir, bin_dir, up_seconds, before)
    try:
        yield running
    finally:
        if cluster_dir.exists():
            # keep the logs for a look afterwards; `down` removes the cluster's directory
            shutil.copytree(cluster_dir / "logs", tmp / "logs", dirs_exist_ok=True)
            done = script(cluster_dir, bin_dir, "down", mode=mode)
            assert done.returncode == 0, f"cluster.sh down failed:\n{done.stdout}\n{done.stderr}"


def apply(cluster: Cluster, tmp: Path, *docs: dict[str, Any]) -> None:
    """``kubectl apply`` of these objects (written to a manifest under ``tmp``)."""
    manifest = tmp / f"apply-{time.monotonic_ns()}.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    cluster.kubectl("apply", "-f", str(manifest))


def running(cluster: Cluster, name: str, deadline: float) -> dict[str, Any]:
    """The pod ``name`` once its phase is Running (fails at ``deadline``, a monotonic time)."""
    while True:
        pod: dict[str, Any] = json.loads(cluster.kubectl("get", "pod", name, "-o", "json").stdout)
        if pod["status"].get("phase") == "Running":
            return pod
        assert time.monotonic() < deadline, f"{name} not Running: {json.dumps(pod['status'])}\n{cluster.logs_tail()}"
        time.sleep(0.5)


def until(what: str, deadline_s: float, probe: Callable[[], Any]) -> Any:
    """Call ``probe`` every second until it returns something true; that value."""
    deadline = time.monotonic() + deadline_s
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {deadline_s} s (last: {got!r})"
        time.sleep(1)


def exec_in(cluster: Cluster, pod: str, *argv: str, container: str = "main") -> subprocess.CompletedProcess[str]:
    """``kubectl exec`` of ``argv`` in a container of ``pod``; not checked."""
    return cluster.kubectl("exec", pod, "-c", container, "--", *argv, check=False, timeout=60)


def resize(cluster: Cluster, pod: str, cpu: str, memory: str, container: str = "main") -> None:
    """An in-place resize (KEP-1287) of ``container``'s requests and limits to ``cpu``/``memory``."""
    resources = {"cpu": cpu, "memory": memory}
    patch = {"spec": {"containers": [{"name": container, "resources": {"requests": resources, "limits": resources}}]}}
    cluster.kubectl("patch", "pod", pod, "--subresource", "resize", "--type", "strategic", "-p", json.dumps(patch))


def pod_doc(cluster: Cluster, pod: str) -> dict[str, Any]:
    """``kubectl get pod -o json`` of ``pod``."""
    doc: dict[str, Any] = json.loads(cluster.kubectl("get", "pod", pod, "-o", "json").stdout)
    return doc


def resize_conditions(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod's resize conditions (``PodResizePending``, ``PodResizeInProgress``) by type."""
    return {
        c["type"]: c
        for c in pod["status"].get("conditions", [])
        if c["type"] in ("PodResizePending", "PodResizeInProgress")
    }


def port_forwarded(cluster: Cluster, pod: str, port: int) -> bytes:
    """What a connection to ``kubectl port-forward pod/POD :PORT``'s local port reads until the
    pod's server closes it."""
    forward = subprocess.Popen(
        cluster.kubectl_argv("port-forward", f"pod/{pod}", f":{port}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline()
        match = re.search(rf"127\.0\.0\.1:(\d+) -> {port}", line)
        assert match, line
        with socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=30) as conn:
            conn.settimeout(30)
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
        return answer
    finally:
        forward.terminate()
        forward.wait(timeout=30)
