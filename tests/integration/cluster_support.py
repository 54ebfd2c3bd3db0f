"""What ``test_cluster.py`` needs around a one-node cluster of ``scripts/cluster.sh``: the binaries
(``$KUBE_BIN``, else ``scripts/build-k8s.sh``'s), ``up``/``down``, kubectl, the shim's view of its
sandboxes, what a pod may leave behind on the host, and the test image (busybox-static and
``tests/cluster_kit/probe``, built by buildah in Docker format)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from cli.inspect_state import claims
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from tests.registry_kit import BUSYBOX, DOCKER_MANIFEST, Buildah, served_manifest
from tests.shim_kit import REPO, state_domains

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


def script(cluster_dir: Path, bin_dir: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # the kubelet syncs each pod every 10 s, so that a ConfigMap update reaches its volume soon
    env = {**os.environ, "CLUSTER_DIR": str(cluster_dir), "KUBE_BIN": bin_dir, "CLUSTER_SYNC_FREQUENCY": "10s"}
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
