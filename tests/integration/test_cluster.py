"""A one-node Kubernetes cluster on vmsandbox (``scripts/cluster.sh``): a real API server, scheduler,
controller-manager and kubelet, the shim the kubelet's only endpoint, with the cluster's containerd
behind it for pods without a vmsandbox RuntimeClass. A Deployment whose image is a Docker schema 2
image (built by Debian's buildah, pushed to the cluster's registry) must run in a VM sized from its
resources, show its output through ``kubectl logs``, and leave nothing behind when deleted; a
host-network pod and an ordinary pod must run under runc beside a VM pod, the ordinary pod talking
TCP to the VM pod; ``down`` must stop and remove everything ``up`` made.

The Kubernetes binaries (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl)
come from the directory $KUBE_BIN; the test skips without it. It takes the script's ports and bridge
(``CLUSTER_*`` variables in scripts/cluster.sh, defaults unless set), so beside a running cluster
it needs other ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from shim.admin.inspect_state import claims, read_sandboxes
from shim.cri.runtime.v1 import api_pb2 as pb
from shim.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from tests.integration.conftest import LIBVIRT_URI, REPO, require_host
from tests.integration.image_setup import require_image_tools
from tests.registry_kit import BUSYBOX, DOCKER_MANIFEST, Buildah, served_manifest

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

KUBE_BIN = os.environ.get("KUBE_BIN", "")
SCRIPT = REPO / "scripts" / "cluster.sh"
# the cluster's registry and pod bridge, as scripts/cluster.sh reads them from the environment
REGISTRY = f"127.0.0.1:{os.environ.get('CLUSTER_REGISTRY_PORT', '15000')}"
BRIDGE = os.environ.get("CLUSTER_POD_BRIDGE", "vmsbr-k8s0")
MiB = 1 << 20
# the Deployment's container; deploy/profiles.yaml's `medium` profile (RuntimeClass vmsandbox-medium)
# backs guest RAM with 2 MiB hugepages and adds its 64Mi overhead (also the RuntimeClass overhead)
CPU, MEMORY_MIB, OVERHEAD_MIB = "1", 256, 64


@dataclass
class Cluster:
    dir: Path
    up_seconds: float
    host_before: dict[str, Any]
    figures: dict[str, float] = field(default_factory=dict)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        argv = [str(Path(KUBE_BIN) / "kubectl"), "--kubeconfig", str(self.dir / "admin.kubeconfig"), *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}\n{self.logs_tail()}"
        return done

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
            "domains": shim_domains(self.state_dir),
            "namespaces": sorted(p.name for p in (self.dir / "netns").iterdir()),
            "allocations": sorted(
                p.name for p in (self.dir / "ipam").glob("*/*") if p.name[0].isdigit() and p.name.count(".") == 3
            ),
            "claims": sorted(claims(self.state_dir)),
            "bridge ports": sorted(p.name for p in brif.iterdir()) if brif.is_dir() else [],
        }


def shim_domains(state_dir: Path) -> list[str]:
    """libvirt domains defined by the shim whose state database is in ``state_dir``."""
    import sqlite3

    import libvirt

    from vmsandbox.domain_xml import read_identity

    db = sqlite3.connect(f"{(state_dir / 'state.db').resolve().as_uri()}?mode=ro", uri=True, timeout=10)
    try:
        owner = str(db.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()[0])
    finally:
        db.close()
    conn = libvirt.open(LIBVIRT_URI)
    try:
        names = []
        for d in conn.listAllDomains(0):
            try:
                ident = read_identity(d.XMLDesc(0))
            except libvirt.libvirtError:
                continue  # gone while we looked
            if ident is not None and ident.owner == owner:
                names.append(d.name())
        return names
    finally:
        conn.close()


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


def script(cluster_dir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CLUSTER_DIR": str(cluster_dir), "KUBE_BIN": KUBE_BIN}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not KUBE_BIN:
        pytest.skip(
            "KUBE_BIN not set (a directory with kube-apiserver, kube-controller-manager, kube-scheduler, "
            "kubelet and kubectl v1.28)"
        )
    require_host()
    require_image_tools()
    # not below pytest's own 0700 directory: each sandbox's QEMU, as a uid of its own, must pass
    # through every directory above its sandbox's (the shim's state lives in the cluster's)
    tmp = Path(tempfile.mkdtemp(prefix="vmsandbox-cluster-", dir="/var/tmp"))
    tmp.chmod(0o711)
    cluster_dir = tmp / "c"
    before = host_state()
    t0 = time.monotonic()
    up = script(cluster_dir, "up")
    up_seconds = time.monotonic() - t0
    assert up.returncode == 0, f"cluster.sh up failed:\n{up.stdout[-3000:]}\n{up.stderr[-6000:]}"
    ready = [line for line in up.stdout.splitlines() if " Ready " in line]
    print(f"\ncluster: up in {up_seconds:.1f} s ({ready[-1] if ready else 'no Ready line'})")
    running = Cluster(cluster_dir, up_seconds, before)
    try:
        yield running
    finally:
        if cluster_dir.exists():
            # keep the logs for a look afterwards; `down` removes the cluster's directory
            shutil.copytree(cluster_dir / "logs", tmp / "logs", dirs_exist_ok=True)
            done = script(cluster_dir, "down")
            assert done.returncode == 0, f"cluster.sh down failed:\n{done.stdout}\n{done.stderr}"


def _image(tmp: Path) -> str:
    """A Docker schema 2 image built by buildah and pushed to the cluster's registry; the reference
    pods use (docker.io, which the cluster's shim mirrors from its registry)."""
    buildah = Buildah(tmp / "buildah")
    busybox = BUSYBOX.read_bytes()
    passwd = b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/:/bin/sh\n"
    buildah.image(
        "hello",
        [{"bin/busybox": busybox, "bin/sh": busybox, "etc/passwd": passwd}],
        cmd='["/bin/sh", "-c", "echo hello from a docker image; id -u; exec /bin/busybox sleep 3600"]',
        user="1000",
    )
    buildah.push("hello", f"{REGISTRY}/vmsandbox-test/hello:1")
    manifest = json.loads(served_manifest(REGISTRY, "vmsandbox-test/hello", "1", accept=DOCKER_MANIFEST))
    assert manifest["mediaType"] == DOCKER_MANIFEST, manifest
    return "docker.io/vmsandbox-test/hello:1"


def _deployment(image: str) -> dict[str, Any]:
    resources = {"cpu": CPU, "memory": f"{MEMORY_MIB}Mi"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "hello", "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "hello"}},
            "template": {
                "metadata": {"labels": {"app": "hello"}},
                "spec": {
                    "runtimeClassName": "vmsandbox-medium",
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {"name": "hello", "image": image, "resources": {"requests": resources, "limits": resources}}
                    ],
                },
            },
        },
    }


def _pod(cluster: Cluster) -> dict[str, Any] | None:
    items = json.loads(cluster.kubectl("get", "pods", "-l", "app=hello", "-o", "json").stdout)["items"]
    return items[0] if items else None


def test_node_is_ready_with_vmsandbox_as_its_runtime(cluster: Cluster) -> None:
    node = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert len(node) == 1
    ready = {c["type"]: c["status"] for c in node[0]["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert node[0]["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("vmsandbox://")
    assert node[0]["metadata"]["labels"]["vmsandbox.dev/runtime"] == "true"
    classes = cluster.kubectl("get", "runtimeclass", "-o", "name").stdout.split()
    assert "runtimeclass.node.k8s.io/vmsandbox-medium" in classes


def test_docker_format_deployment_runs_in_a_vm(cluster: Cluster, tmp_path: Path) -> None:
    image = _image(tmp_path)
    manifest = tmp_path / "deployment.yaml"
    manifest.write_text(yaml.safe_dump(_deployment(image)))
    t0 = time.monotonic()
    cluster.kubectl("apply", "-f", str(manifest))
    deadline = t0 + 300
    while True:
        pod = _pod(cluster)
        if pod is not None and pod["status"].get("phase") == "Running":
            break
        assert time.monotonic() < deadline, f"not Running: {json.dumps(pod and pod['status'])}\n{cluster.logs_tail()}"
        time.sleep(0.5)
    cluster.figures["apply to Running"] = time.monotonic() - t0
    print(f"\ncluster: kubectl apply to Running in {cluster.figures['apply to Running']:.1f} s")
    name = pod["metadata"]["name"]

    # the shim's sandbox list has it, in a VM sized from the pod's resources and its RuntimeClass
    listed = [s for s in cluster.sandboxes() if s.metadata.name == name]
    assert [(s.metadata.namespace, s.state) for s in listed] == [("default", pb.SANDBOX_READY)]
    views = [v for v in read_sandboxes(cluster.state_dir) if v.id == listed[0].id]
    assert len(views) == 1
    shape = views[0].record["shape"]
    guest_mib = MEMORY_MIB + OVERHEAD_MIB
    assert (shape["vcpus"], shape["memory_bytes"]) == (1, guest_mib * MiB), shape
    assert sum(count for _, size, count in views[0].claims.pages if size == 2 * MiB) == guest_mib // 2, views[0].claims
    assert shim_domains(cluster.state_dir) != []

    # kubectl logs: the container's output, through the API server, the kubelet and the shim
    deadline = time.monotonic() + 60
    while "hello from a docker image" not in (logs := cluster.kubectl("logs", name, check=False).stdout):
        assert time.monotonic() < deadline, logs
        time.sleep(0.5)
    assert logs.splitlines()[:2] == ["hello from a docker image", "1000"], logs


def test_delete_leaves_nothing_behind(cluster: Cluster) -> None:
    assert _pod(cluster) is not None, "the Deployment's pod is not there"
    cluster.kubectl("delete", "deployment", "hello", "--wait=true", timeout=180)
    # the kubelet stops the sandbox when the pod goes and removes it at its next garbage collection
    # (every minute)
    deadline = time.monotonic() + 180
    empty: dict[str, object] = {"domains": [], "namespaces": [], "allocations": [], "claims": [], "bridge ports": []}
    while (left := cluster.leftovers()) != empty or cluster.sandboxes():
        assert time.monotonic() < deadline, f"left behind: {left}, sandboxes {cluster.sandboxes()}"
        time.sleep(1)
    assert _pod(cluster) is None


def _bare_pod(name: str, command: str, **spec: Any) -> dict[str, Any]:
    resources = {"cpu": "500m", "memory": "64Mi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": "side-by-side"}},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": "docker.io/vmsandbox-test/hello:1",
                    "command": ["/bin/busybox", "sh", "-c", command],
                    "resources": {"requests": resources, "limits": resources},
                }
            ],
            **spec,
        },
    }


def _running(cluster: Cluster, name: str, deadline: float) -> dict[str, Any]:
    while True:
        pod: dict[str, Any] = json.loads(cluster.kubectl("get", "pod", name, "-o", "json").stdout)
        if pod["status"].get("phase") == "Running":
            return pod
        assert time.monotonic() < deadline, f"{name} not Running: {json.dumps(pod['status'])}\n{cluster.logs_tail()}"
        time.sleep(0.5)


def test_ordinary_and_host_network_pods_run_under_runc_beside_a_vm_pod(cluster: Cluster, tmp_path: Path) -> None:
    if not (cluster.dir / "containerd" / "containerd.sock").exists():
        pytest.skip("the cluster runs without containerd (CLUSTER_DOWNSTREAM=none)")
    _image(tmp_path)  # pushed again: the Deployment's test may not have run
    t0 = time.monotonic()
    server = _bare_pod(
        "vm-server",
        "echo serving; echo from-the-vm | /bin/busybox nc -l -p 8080; exec /bin/busybox sleep 3600",
        runtimeClassName="vmsandbox",
    )
    host = _bare_pod("host-net", "echo on the host network; exec /bin/busybox sleep 3600", hostNetwork=True)
    manifest = tmp_path / "pods.yaml"
    manifest.write_text(yaml.safe_dump_all([server, host]))
    cluster.kubectl("apply", "-f", str(manifest))
    vm_pod = _running(cluster, "vm-server", t0 + 300)
    vm_ip = vm_pod["status"]["podIP"]
    client = _bare_pod(
        "plain-client",
        f"for i in $(/bin/busybox seq 90); do /bin/busybox nc {vm_ip} 8080 && break; /bin/busybox sleep 1; done; "
        "exec /bin/busybox sleep 3600",
    )
    manifest.write_text(yaml.safe_dump(client))
    cluster.kubectl("apply", "-f", str(manifest))
    for name in ("host-net", "plain-client"):
        _running(cluster, name, t0 + 300)
    cluster.figures["three pods Running"] = time.monotonic() - t0

    # each pod's sandbox, with its runtime handler, in the one list the kubelet sees
    handlers = {s.metadata.name: s.runtime_handler for s in cluster.sandboxes() if s.state == pb.SANDBOX_READY}
    assert handlers.get("vm-server") == "vmsandbox", handlers
    assert handlers.get("plain-client") == "" and handlers.get("host-net") == "", handlers
    vms = {v.record["meta"]["name"] for v in read_sandboxes(cluster.state_dir)}
    assert "vm-server" in vms and not {"plain-client", "host-net"} & vms  # only the VM pod is vmsandbox's

    # kubectl logs for all three; the ordinary pod got the VM pod's answer over TCP
    expect = {"plain-client": "from-the-vm", "host-net": "on the host network", "vm-server": "serving"}
    deadline = time.monotonic() + 120
    for name, text in expect.items():
        while text not in (logs := cluster.kubectl("logs", name, check=False).stdout):
            assert time.monotonic() < deadline, f"{name}: {logs!r}\n{cluster.logs_tail()}"
            time.sleep(1)

    cluster.kubectl("delete", "pod", "-l", "app=side-by-side", "--wait=true", timeout=180)
    deadline = time.monotonic() + 180
    while any(s.metadata.name in expect for s in cluster.sandboxes()):
        assert time.monotonic() < deadline, [s.metadata.name for s in cluster.sandboxes()]
        time.sleep(1)
    assert shim_domains(cluster.state_dir) == []


def test_down_removes_everything_up_made(cluster: Cluster) -> None:
    run = cluster.dir / "run"
    pids = {p.stem: (int(p.read_text()), (run / f"{p.stem}.exe").read_text().strip()) for p in run.glob("*.pid")}
    assert set(pids) == {"etcd", "registry", "apiserver", "controller-manager", "scheduler", "shim", "kubelet"}
    containerd_pid = cluster.dir / "containerd" / "containerd.pid"
    if containerd_pid.exists():
        pids["containerd"] = (int(containerd_pid.read_text()), "containerd")
    shutil.copytree(cluster.dir / "logs", cluster.dir.parent / "logs", dirs_exist_ok=True)
    # `up` recorded ip_forward before its bridge turned it on (other users of the host may have
    # changed it since the test started: compare with what up saw)
    forward = (run / "ip_forward").read_text()
    done = script(cluster.dir, "down")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert not cluster.dir.exists()
    for name, (pid, exe) in pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            same = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)").rsplit("/", 1)[-1] == exe
        except OSError:
            continue  # gone
        assert state == "Z" or not same, f"{name} (pid {pid}) still runs"
    after = host_state()
    assert after["ip_forward"] == forward
    after["ip_forward"] = cluster.host_before["ip_forward"]
    assert after == cluster.host_before, f"before up: {cluster.host_before}\nafter down: {after}"
