"""Shim mode in the one-node cluster (``CLUSTER_MODE=shim``): the kubelet talks to containerd 2.4,
whose drop-in maps the profiles' handlers to vmsandbox's runtime shim. A Deployment with
``runtimeClassName: vmsandbox`` runs in a VM sized from its resources (seen on vmsandbox's own
socket), with its ConfigMap and service-account token readable; ``kubectl logs``, ``exec``,
``attach`` and ``port-forward`` work through containerd's streaming; a runc pod beside it reaches
it; deleting it leaves nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_support import (
    Cluster,
    apply,
    exec_in,
    pod_doc,
    port_forwarded,
    push_image,
    resize,
    resize_conditions,
    running,
    running_cluster,
    until,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from running_cluster(mode="shim")


PROBE = "/bin/probe"  # tests/cluster_kit/probe, in the pods' image
SERVE = f"cat /etc/cm/greeting; echo; exec {PROBE} serve 8080 from-the-vm"


def deployment(image: str) -> list[dict[str, Any]]:
    resources = {"cpu": "300m", "memory": "96Mi"}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "shim-cm", "namespace": "default"},
         "data": {"greeting": "hello through containerd"}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "shim-web", "namespace": "default"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "shim-web"}},
                "template": {
                    "metadata": {"labels": {"app": "shim-web"}},
                    "spec": {
                        "runtimeClassName": "vmsandbox",
                        "terminationGracePeriodSeconds": 2,
                        "volumes": [{"name": "cm", "configMap": {"name": "shim-cm"}}],
                        "containers": [{
                            "name": "main",
                            "image": image,
                            "command": ["/bin/busybox", "sh", "-c", SERVE],
                            "resources": {"requests": resources, "limits": resources},
                            "volumeMounts": [{"name": "cm", "mountPath": "/etc/cm"}],
                        }, {
                            # reads one line from an attached stdin, answers it and exits (and is restarted)
                            "name": "echo",
                            "image": image,
                            "command": ["/bin/busybox", "sh", "-c", 'read line; echo "got $line"'],
                            "stdin": True,
                            "stdinOnce": True,
                        }],
                    },
                },
            },
        },
    ]  # fmt: skip


def test_a_deployment_runs_in_a_vm_through_containerd(cluster: Cluster, tmp_path: Path) -> None:
    image = push_image(tmp_path)
    apply(cluster, tmp_path, *deployment(image))

    def pod() -> dict[str, Any] | None:
        items = json.loads(cluster.kubectl("get", "pods", "-l", "app=shim-web", "-o", "json").stdout)["items"]
        ready = [p for p in items if p["status"].get("phase") == "Running"]
        return ready[0] if ready else None

    p = until("the Deployment's pod Running", 300, pod)
    name, ip = p["metadata"]["name"], p["status"]["podIP"]
    # a VM of vmsandbox's, under the id containerd gave it, sized from the pod's resources
    sandboxes = cluster.sandboxes()
    assert len(sandboxes) == 1 and sandboxes[0].metadata.name == name
    until("the ConfigMap's text in its log", 60, lambda: "through containerd" in cluster.kubectl("logs", name).stdout)
    token = exec_in(cluster, name, "/bin/busybox", "wc", "-c", "/var/run/secrets/kubernetes.io/serviceaccount/token")
    assert token.returncode == 0 and int(token.stdout.split()[0]) > 100, token
    assert exec_in(cluster, name, "/bin/busybox", "nproc").stdout.strip() == "1"
    # exec with stdin, and the command's exit code, through containerd's streaming and the task's fifos
    done = cluster.kubectl(
        "exec", "-i", name, "-c", "main", "--", "/bin/busybox", "sh", "-c", 'read x; echo "in the vm: $x"; exit 3',
        check=False, input="over stdin\n",
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (3, "in the vm: over stdin\n"), done
    # attach: a line to the `echo` container's stdin comes back on its stdout
    done = cluster.kubectl("attach", "-i", name, "-c", "echo", check=False, input="through attach\n", timeout=90)
    assert "got through attach" in done.stdout, done
    # port-forward: containerd dials the pod namespace's loopback, which vmsandbox forwards into the guest
    assert port_forwarded(cluster, name, 8080) == b"from-the-vm\n"
    # a runc pod on the same node reaches the VM pod's address
    apply(cluster, tmp_path, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runc-client", "namespace": "default"},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
            "name": "main", "image": image, "command": ["/bin/busybox", "sleep", "3600"]}]},
    })  # fmt: skip
    until(
        "the runc pod's dial of the VM pod",
        120,
        lambda: "from-the-vm" in exec_in(cluster, "runc-client", PROBE, "dial", f"{ip}:8080").stdout,
    )
    cluster.kubectl("delete", "pod", "runc-client", "--wait=true", timeout=120)
    cluster.kubectl("delete", "deployment", "shim-web", "--wait=true", timeout=120)
    until("the VM pod gone", 180, lambda: cluster.sandboxes() == [])
    until("nothing left", 60, lambda: cluster.leftovers()["domains"] == [])


def test_a_resize_through_containerd_is_applied_or_refused_with_vmsandboxs_message(
    cluster: Cluster, tmp_path: Path
) -> None:
    """In-place resize (KEP-1287) of a VM pod whose kubelet talks to containerd: a resize the VM holds
    reaches the guest's cgroup through the task's Update; one beyond the profile's headroom is
    refused, and vmsandbox's message is the pod's ``PodResizeInProgress`` condition and the
    kubelet's ``ResizeError`` event (``kubectl describe pod``)."""
    image = push_image(tmp_path)
    resources = {"cpu": "500m", "memory": "64Mi"}
    apply(cluster, tmp_path, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "shim-resizable", "namespace": "default"},
        "spec": {"runtimeClassName": "vmsandbox-resizable", "terminationGracePeriodSeconds": 2, "containers": [{
            "name": "main", "image": image, "command": ["/bin/busybox", "sh", "-c", "exec sleep 3600"],
            "resources": {"requests": resources, "limits": resources}}]},
    })  # fmt: skip
    running(cluster, "shim-resizable", time.monotonic() + 300)

    def cgroup() -> list[str]:
        done = exec_in(cluster, "shim-resizable", "/bin/busybox", "cat", "/sys/fs/cgroup/cpu.max")
        assert done.returncode == 0, done
        return done.stdout.split()

    assert cgroup() == ["50000", "100000"]
    resize(cluster, "shim-resizable", "800m", "64Mi")
    until("the resize to 800m in the guest", 120, lambda: cgroup() == ["80000", "100000"])

    resize(cluster, "shim-resizable", "800m", "512Mi")

    def refused() -> dict[str, Any] | None:
        condition = resize_conditions(pod_doc(cluster, "shim-resizable")).get("PodResizeInProgress")
        return condition if condition and "resize_headroom" in condition.get("message", "") else None

    condition = until("the refusal in PodResizeInProgress", 180, refused)
    assert condition["reason"] == "Error" and "can grow by 128Mi" in condition["message"], condition
    print(f"\ncluster (shim mode): the pod's resize condition says: {condition['message']}")
    # and the kubelet's event carries it: `kubectl describe pod` shows the refusal
    until(
        "the ResizeError event in kubectl describe",
        60,
        lambda: (lambda d: "ResizeError" in d and "can grow by 128Mi" in d)(
            cluster.kubectl("describe", "pod", "shim-resizable").stdout
        ),
    )
    assert cgroup() == ["80000", "100000"]
    cluster.kubectl("delete", "pod", "shim-resizable", "--wait=true", timeout=180)
    until("nothing left", 120, lambda: cluster.leftovers()["domains"] == [])
