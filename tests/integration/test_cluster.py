"""A one-node Kubernetes cluster on vmsandbox (``scripts/cluster.sh``): a real API server, scheduler,
controller-manager, kubelet, kube-proxy and CoreDNS, the shim the kubelet's only endpoint, with the
cluster's containerd behind it for pods without a vmsandbox RuntimeClass.

- A Deployment whose image is a Docker schema 2 image (built by Debian's buildah, pushed to the
  cluster's registry) runs in a VM sized from its resources and shows its output through
  ``kubectl logs``.
- A host-network pod and an ordinary pod run under runc beside a VM pod; the ordinary pod talks TCP
  to the VM pod.
- ClusterIP Services reach pods by name both ways (runc pod -> VM pod, VM pod -> runc pod), through
  kube-proxy and the cluster DNS.
- ``kubectl exec`` (stdin, exit code), ``attach``, ``port-forward`` and ``logs`` into a VM pod.
- From inside a VM pod, its service-account token and CA authenticate it to the API server.
- ConfigMap and Secret volumes are read in a VM pod, and a ConfigMap update reaches it running.
- ``kubectl delete`` leaves nothing behind; ``down`` stops and removes everything ``up`` made.

The binaries come from $KUBE_BIN, else from ``scripts/build-k8s.sh`` (its cache makes that instant;
cold it builds for about 10 minutes). The test takes the script's ports and bridge (``CLUSTER_*``
variables in scripts/cluster.sh, defaults unless set), so beside a running cluster it needs other
ones."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.inspect_state import read_sandboxes
from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.cluster_support import (
    Cluster,
    apply,
    exec_in,
    host_state,
    port_forwarded,
    push_image,
    running,
    running_cluster,
    script,
    until,
)
from tests.shim_kit import state_domains

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]

MiB = 1 << 20
# the Deployment's container; deploy/profiles.yaml's `medium` profile (RuntimeClass vmsandbox-medium)
# backs guest RAM with 2 MiB hugepages and adds its 64Mi overhead (also the RuntimeClass overhead)
CPU, MEMORY_MIB, OVERHEAD_MIB = "1", 256, 64
PROBE = "/bin/probe"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from running_cluster()


@pytest.fixture(scope="module")
def image(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    return push_image(tmp_path_factory.mktemp("image"))


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


def _hello_pod(cluster: Cluster) -> dict[str, Any] | None:
    items = json.loads(cluster.kubectl("get", "pods", "-l", "app=hello", "-o", "json").stdout)["items"]
    return items[0] if items else None


def test_node_is_ready_with_vmsandbox_as_its_runtime(cluster: Cluster) -> None:
    node = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert len(node) == 1
    ready = {c["type"]: c["status"] for c in node[0]["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert node[0]["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("vmsandbox://")
    assert node[0]["metadata"]["labels"]["vmsandbox.dev/runtime"] == "true"
    print(f"\ncluster: kubelet {node[0]['status']['nodeInfo']['kubeletVersion']}")
    classes = cluster.kubectl("get", "runtimeclass", "-o", "name").stdout.split()
    assert "runtimeclass.node.k8s.io/vmsandbox-medium" in classes


def test_docker_format_deployment_runs_in_a_vm(cluster: Cluster, image: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    apply(cluster, tmp_path, _deployment(image))
    deadline = t0 + 300
    while True:
        pod = _hello_pod(cluster)
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
    assert state_domains(cluster.state_dir) != []

    # kubectl logs: the container's output, through the API server, the kubelet and the shim
    def output() -> str:
        # both lines the command prints: the shim writes each to the log file as the guest sends it
        out = cluster.kubectl("logs", name, check=False).stdout
        return out if "hello from a docker image" in out and len(out.splitlines()) >= 2 else ""

    logs = until("the Deployment's output in kubectl logs", 60, output)
    assert logs.splitlines()[:2] == ["hello from a docker image", "1000"], logs

    # its CPU back for the pods below (test_delete_leaves_nothing_behind checks what it left)
    cluster.kubectl("delete", "deployment", "hello", "--wait=true", timeout=180)
    cluster.kubectl("wait", "--for=delete", "pod", "-l", "app=hello", "--timeout=120s", timeout=180)


# ---- a VM pod and runc pods side by side, with Services, DNS, volumes and streaming ------------------
def _pod(name: str, image: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    # small: the node has 2 CPUs, and the Deployment's pod may not be gone from the scheduler's count
    resources = {"cpu": "100m", "memory": "64Mi"}
    for c in containers:
        c.setdefault("image", image)
        c["resources"] = {"requests": resources, "limits": resources}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name, "group": "side-by-side"}},
        "spec": {"terminationGracePeriodSeconds": 2, "containers": containers, **spec},
    }


def _service(name: str, app: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": {"group": "side-by-side"}},
        "spec": {"selector": {"app": app}, "ports": [{"port": 8080, "targetPort": 8080}]},
    }


def _config_map(greeting: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "vm-config", "namespace": "default"},
        "data": {"greeting": greeting},
    }


@pytest.fixture(scope="module")
def pods(cluster: Cluster, image: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """vm-app (a VM: serves `from-the-vm` on 8080, a ConfigMap and a Secret mounted, a second
    container for attach), runc-app (runc: serves `from-runc` on 8080), host-net (runc, host
    network), each of the first two behind a ClusterIP Service; all Running."""
    if not (cluster.dir / "containerd" / "containerd.sock").exists():
        pytest.skip("the cluster runs without containerd (CLUSTER_DOWNSTREAM=none)")
    tmp = tmp_path_factory.mktemp("pods")
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "vm-secret", "namespace": "default"},
        "stringData": {"password": "s3cret-in-a-vm"},
    }
    vm = _pod(
        "vm-app",
        image,
        [
            {
                "name": "main",
                "command": [PROBE, "serve", "8080", "from-the-vm"],
                "volumeMounts": [
                    {"name": "config", "mountPath": "/config", "readOnly": True},
                    {"name": "secret", "mountPath": "/secret", "readOnly": True},
                ],
            },
            {
                # reads one line from an attached stdin, answers it and exits (and is restarted)
                "name": "echo",
                "command": ["/bin/busybox", "sh", "-c", 'read line; echo "got $line"'],
                "stdin": True,
                "stdinOnce": True,
            },
        ],
        runtimeClassName="vmsandbox",
        volumes=[
            {"name": "config", "configMap": {"name": "vm-config"}},
            {"name": "secret", "secret": {"secretName": "vm-secret"}},
        ],
    )
    runc = _pod("runc-app", image, [{"name": "main", "command": [PROBE, "serve", "8080", "from-runc"]}])
    host = _pod(
        "host-net",
        image,
        [{"name": "main", "command": ["/bin/busybox", "sh", "-c", "echo on the host network; exec sleep 3600"]}],
        hostNetwork=True,
    )
    t0 = time.monotonic()
    apply(
        cluster,
        tmp,
        _config_map("hello from a config map"),
        secret,
        _service("vm-svc", "vm-app"),
        _service("runc-svc", "runc-app"),
        vm,
        runc,
        host,
    )
    pods_up = {name: running(cluster, name, t0 + 300) for name in ("vm-app", "runc-app", "host-net")}
    cluster.figures["three pods Running"] = time.monotonic() - t0
    print(f"\ncluster: vm-app, runc-app and host-net Running {cluster.figures['three pods Running']:.1f} s after apply")
    return pods_up


def _dial(cluster: Cluster, pod: str, address: str, want: str) -> str:
    done = exec_in(cluster, pod, PROBE, "dial", address)
    return done.stdout if want in done.stdout else ""


def test_ordinary_and_host_network_pods_run_under_runc_beside_a_vm_pod(
    cluster: Cluster, pods: dict[str, dict[str, Any]]
) -> None:
    # each pod's sandbox, with its runtime handler, in the one list the kubelet sees
    handlers = {s.metadata.name: s.runtime_handler for s in cluster.sandboxes() if s.state == pb.SANDBOX_READY}
    assert handlers.get("vm-app") == "vmsandbox", handlers
    assert handlers.get("runc-app") == "" and handlers.get("host-net") == "", handlers
    vms = {v.record["meta"]["name"] for v in read_sandboxes(cluster.state_dir)}
    assert "vm-app" in vms and not {"runc-app", "host-net"} & vms  # only the VM pod is vmsandbox's

    # the ordinary pod reaches the VM pod over TCP by its address, across the shared bridge
    vm_ip = pods["vm-app"]["status"]["podIP"]
    until("runc-app -> vm-app by pod IP", 60, lambda: _dial(cluster, "runc-app", f"{vm_ip}:8080", "from-the-vm"))

    # kubectl logs for all three
    expect = {"runc-app": "serving on :8080", "host-net": "on the host network", "vm-app": "serving on :8080"}
    for name, text in expect.items():

        def logged(n: str = name, t: str = text) -> bool:
            return t in cluster.kubectl("logs", n, "-c", "main").stdout

        until(f"kubectl logs {name}", 60, logged)


def test_services_reach_pods_by_name_both_ways(cluster: Cluster, pods: dict[str, dict[str, Any]]) -> None:
    # both pods are ClusterFirst: their resolv.conf names the kube-dns Service (CoreDNS behind it)
    for name in ("vm-app", "runc-app"):
        resolv = exec_in(cluster, name, "/bin/busybox", "cat", "/etc/resolv.conf").stdout
        assert "nameserver 10.0.0.10" in resolv and "default.svc.cluster.local" in resolv, (name, resolv)
    t0 = time.monotonic()
    # a runc pod to the VM pod, by the Service's short name (search domains) and its full one
    until("runc-app -> vm-svc", 90, lambda: _dial(cluster, "runc-app", "vm-svc:8080", "from-the-vm"))
    until(
        "runc-app -> vm-svc FQDN",
        30,
        lambda: _dial(cluster, "runc-app", "vm-svc.default.svc.cluster.local:8080", "from-the-vm"),
    )
    # and the VM pod to the runc pod
    until("vm-app -> runc-svc", 90, lambda: _dial(cluster, "vm-app", "runc-svc:8080", "from-runc"))
    print(f"\ncluster: Services reached by name both ways after {time.monotonic() - t0:.1f} s")


def test_exec_attach_port_forward_and_logs_into_a_vm_pod(cluster: Cluster, pods: dict[str, dict[str, Any]]) -> None:
    # exec with stdin, and the command's exit code passed back through kubectl
    done = cluster.kubectl(
        "exec",
        "-i",
        "vm-app",
        "-c",
        "main",
        "--",
        "/bin/busybox",
        "sh",
        "-c",
        'read x; echo "in the vm: $x"; exit 3',
        check=False,
        input="over stdin\n",
    )
    assert (done.returncode, done.stdout) == (3, "in the vm: over stdin\n"), done
    assert exec_in(cluster, "vm-app", "/bin/busybox", "true").returncode == 0

    # attach: a line to the `echo` container's stdin comes back on its stdout; it then exits
    done = cluster.kubectl("attach", "-i", "vm-app", "-c", "echo", check=False, input="through attach\n", timeout=90)
    assert "got through attach" in done.stdout, done

    # port-forward from this host to the VM pod's port 8080
    assert port_forwarded(cluster, "vm-app", 8080) == b"from-the-vm\n"

    # logs: the serving container's own output, and the attached one's answer
    assert "serving on :8080" in cluster.kubectl("logs", "vm-app", "-c", "main").stdout
    until(
        "kubectl logs of the attached container",
        30,
        lambda: (
            "got through attach"
            in (
                cluster.kubectl("logs", "vm-app", "-c", "echo", check=False).stdout
                + cluster.kubectl("logs", "vm-app", "-c", "echo", "--previous", check=False).stdout
            )
        ),
    )


def test_service_account_token_calls_the_api_server_from_a_vm_pod(
    cluster: Cluster, pods: dict[str, dict[str, Any]]
) -> None:
    # by the `kubernetes` Service's name (cluster DNS, kube-proxy to the API server), verified with
    # the pod's CA, authenticated with the pod's token
    def version() -> str:
        out = exec_in(cluster, "vm-app", PROBE, "api", "https://kubernetes.default.svc/version").stdout
        return out if out.startswith("status ") else ""

    api = until("GET /version from vm-app", 60, version)
    assert api.startswith("status 200"), api
    assert json.loads(api.split("\n", 1)[1])["gitVersion"].startswith("v"), api
    # the token is the pod's service account: listing pods is not granted to it
    denied = exec_in(cluster, "vm-app", PROBE, "api", "https://10.0.0.1/api/v1/namespaces/default/pods").stdout
    assert denied.startswith("status 403"), denied
    assert 'User \\"system:serviceaccount:default:default\\" cannot list resource \\"pods\\"' in denied, denied


def test_config_map_and_secret_volumes_in_a_vm_pod_follow_updates(
    cluster: Cluster, pods: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    read = exec_in(cluster, "vm-app", "/bin/busybox", "cat", "/config/greeting", "/secret/password")
    assert read.stdout == "hello from a config map" + "s3cret-in-a-vm", read
    t0 = time.monotonic()
    apply(cluster, tmp_path, _config_map("an update while it runs"))
    until(
        "the ConfigMap update in the VM pod",
        120,
        lambda: (
            exec_in(cluster, "vm-app", "/bin/busybox", "cat", "/config/greeting").stdout == "an update while it runs"
        ),
    )
    print(f"\ncluster: ConfigMap update seen in the VM pod {time.monotonic() - t0:.1f} s after apply")


def test_pod_level_resources_size_the_vm_and_containers_without_limits_share_them(
    cluster: Cluster, image: str, tmp_path: Path
) -> None:
    """KEP-2837: a pod with ``spec.resources`` and two containers without limits. The kubelet sends
    the pod-level limits as the sandbox's and hands them to each container; the VM is sized from
    them, and both containers are admitted, sharing them as they share a pod cgroup."""
    limits = {"cpu": "200m", "memory": "96Mi"}
    sleeper = ["/bin/busybox", "sh", "-c", "exec sleep 3600"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "vm-pod-level", "namespace": "default", "labels": {"group": "side-by-side"}},
        "spec": {
            "runtimeClassName": "vmsandbox",
            "terminationGracePeriodSeconds": 2,
            "resources": {"requests": limits, "limits": limits},
            "containers": [{"name": n, "image": image, "command": sleeper} for n in ("first", "second")],
        },
    }
    apply(cluster, tmp_path, pod)
    up = running(cluster, "vm-pod-level", time.monotonic() + 300)
    assert [c["name"] for c in up["status"]["containerStatuses"] if c.get("ready")] == ["first", "second"]
    listed = [s for s in cluster.sandboxes() if s.metadata.name == "vm-pod-level"]
    assert len(listed) == 1
    (view,) = [v for v in read_sandboxes(cluster.state_dir) if v.id == listed[0].id]
    demand = view.record["shape"]["demand"]
    assert (demand["mode"], demand["cpu_millis"], demand["memory_bytes"]) == ("linux-resources", 200, 96 * MiB), demand
    for name in ("first", "second"):  # each container's cgroup holds the pod-level limit
        done = exec_in(
            cluster,
            "vm-pod-level",
            "/bin/busybox",
            "cat",
            "/sys/fs/cgroup/memory.max",
            "/sys/fs/cgroup/cpu.max",
            container=name,
        )
        assert done.returncode == 0 and done.stdout.split() == [str(96 * MiB), "20000", "100000"], done


def test_delete_leaves_nothing_behind(cluster: Cluster) -> None:
    cluster.kubectl("delete", "deployment", "hello", "--ignore-not-found", "--wait=true", timeout=180)
    cluster.kubectl("delete", "pod,service", "-l", "group=side-by-side", "--wait=true", timeout=180)
    cluster.kubectl("delete", "configmap/vm-config", "secret/vm-secret", "--ignore-not-found")
    # the kubelet stops each sandbox when its pod goes and removes it at its next garbage collection
    # (every minute)
    deadline = time.monotonic() + 180
    empty: dict[str, object] = {"domains": [], "namespaces": [], "allocations": [], "claims": [], "bridge ports": []}
    while (left := cluster.leftovers()) != empty or cluster.sandboxes():
        assert time.monotonic() < deadline, f"left behind: {left}, sandboxes {cluster.sandboxes()}"
        time.sleep(1)
    assert json.loads(cluster.kubectl("get", "pods", "-o", "json").stdout)["items"] == []


def test_down_removes_everything_up_made(cluster: Cluster) -> None:
    run = cluster.dir / "run"
    pids = {p.stem: (int(p.read_text()), (run / f"{p.stem}.exe").read_text().strip()) for p in run.glob("*.pid")}
    expect = {"etcd", "registry", "apiserver", "controller-manager", "scheduler", "shim", "kubelet"}
    if (Path(cluster.bin) / "kube-proxy").exists():
        expect.add("kube-proxy")
        if (Path(cluster.bin) / "coredns").exists():
            expect.add("coredns")
    assert set(pids) == expect
    containerd_pid = cluster.dir / "containerd" / "containerd.pid"
    if containerd_pid.exists():
        pids["containerd"] = (int(containerd_pid.read_text()), "containerd")
    shutil.copytree(cluster.dir / "logs", cluster.dir.parent / "logs", dirs_exist_ok=True)
    # `up` recorded ip_forward before its bridge turned it on (other users of the host may have
    # changed it since the test started: compare with what up saw)
    forward = (run / "ip_forward").read_text()
    done = script(cluster.dir, cluster.bin, "down")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert not cluster.dir.exists()
    for name, (pid, exe) in pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            same = Path(f"/proc/{pid}/exe").readlink().name.removesuffix(" (deleted)") == exe
        except OSError:
            continue  # gone
        assert state == "Z" or not same, f"{name} (pid {pid}) still runs"
    after = host_state()
    assert after["ip_forward"] == forward
    after["ip_forward"] = cluster.host_before["ip_forward"]
    assert after == cluster.host_before, f"before up: {cluster.host_before}\nafter down: {after}"
