"""In-place resize of a VM pod by a real kubelet (KEP-1287, ``kubectl patch --subresource resize``)
in the one-node cluster of ``scripts/cluster.sh``, through ``kubectl`` alone.

The pod's RuntimeClass is ``vmsandbox-resizable`` (deploy/profiles.yaml's ``resizable`` profile:
one vCPU and 128Mi of resize headroom reserved beyond what the pod asks).

- A resize the VM holds as booted is applied in the guest: the container's cgroup changes, the
  pod's status shows the new resources, no resize condition is left.
- A resize into the headroom plugs it: inside the container ``nproc`` and ``MemTotal`` grow.
- A resize beyond the headroom is refused by the runtime: the pod's ``PodResizeInProgress``
  condition carries vmsandbox's message, and the container keeps its limits.
- Deleting the pod leaves nothing behind.
"""

from __future__ import annotations

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
    push_image,
    resize,
    resize_conditions,
    running,
    running_cluster,
    until,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]

POD = "resizable"
MI = 1 << 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from running_cluster()


@pytest.fixture(scope="module")
def pod(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    image = push_image(tmp_path_factory.mktemp("image"))
    resources = {"cpu": "500m", "memory": "64Mi"}
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "namespace": "default"},
        "spec": {
            "runtimeClassName": "vmsandbox-resizable",
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "command": ["/bin/busybox", "sh", "-c", "exec sleep 3600"],
                    "resources": {"requests": resources, "limits": resources},
                }
            ],
        },
    }
    apply(cluster, tmp_path_factory.mktemp("apply"), manifest)
    return running(cluster, POD, time.monotonic() + 300)


def _actuated(cluster: Cluster, cpu: str, memory: str) -> bool:
    """The kubelet reports the container running with these limits, and no resize is pending."""
    pod = pod_doc(cluster, POD)
    status = pod["status"]["containerStatuses"][0].get("resources", {}).get("limits", {})
    return status == {"cpu": cpu, "memory": memory} and not resize_conditions(pod)


def _guest(cluster: Cluster) -> tuple[int, int, list[str]]:
    """(nproc, MemTotal KiB, [cpu.max..., memory.max]) inside the container."""
    nproc = exec_in(cluster, POD, "/bin/busybox", "nproc")
    meminfo = exec_in(cluster, POD, "/bin/busybox", "cat", "/proc/meminfo")
    cgroup = exec_in(cluster, POD, "/bin/busybox", "cat", "/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/memory.max")
    assert nproc.returncode == meminfo.returncode == cgroup.returncode == 0, (nproc, meminfo, cgroup)
    total = next(int(line.split()[1]) for line in meminfo.stdout.splitlines() if line.startswith("MemTotal:"))
    return int(nproc.stdout), total, cgroup.stdout.split()


def test_a_resize_the_vm_holds_is_applied_in_the_guest(cluster: Cluster, pod: dict[str, Any]) -> None:
    nproc, mem, cgroup = _guest(cluster)
    assert (nproc, cgroup) == (1, ["50000", "100000", str(64 * MI)]), (nproc, cgroup)
    resize(cluster, POD, "800m", "64Mi")
    until("the resize to 800m actuated", 120, lambda: _actuated(cluster, "800m", "64Mi"))
    assert _guest(cluster) == (1, mem, ["80000", "100000", str(64 * MI)])


def test_a_resize_into_the_headroom_plugs_it(cluster: Cluster, pod: dict[str, Any]) -> None:
    _, mem, _ = _guest(cluster)
    resize(cluster, POD, "1500m", "160Mi")
    until("the resize into the headroom actuated", 180, lambda: _actuated(cluster, "1500m", "160Mi"))
    nproc, grown, cgroup = _guest(cluster)
    assert nproc == 2 and grown >= mem + 128 * 1024 * 63 // 64, (nproc, grown, mem)
    assert cgroup == ["150000", "100000", str(160 * MI)], cgroup
    spec = pod_doc(cluster, POD)["spec"]["containers"][0]["resources"]["limits"]
    assert spec == {"cpu": "1500m", "memory": "160Mi"}, spec  # kubectl get pod shows the new resources


def test_a_resize_beyond_the_headroom_is_refused_with_the_runtimes_message(
    cluster: Cluster, pod: dict[str, Any]
) -> None:
    before = _guest(cluster)
    resize(cluster, POD, "1500m", "512Mi")

    def refused() -> dict[str, Any] | None:
        condition = resize_conditions(pod_doc(cluster, POD)).get("PodResizeInProgress")
        return condition if condition and "resize_headroom" in condition.get("message", "") else None

    condition = until("the refusal in PodResizeInProgress", 180, refused)
    assert condition["reason"] == "Error", condition
    assert "can grow by 128Mi" in condition["message"], condition
    print(f"\ncluster: the pod's resize condition says: {condition['message']}")
    # nothing disturbed: the container keeps its limits, the guest what it had
    limits = pod_doc(cluster, POD)["status"]["containerStatuses"][0]["resources"]["limits"]
    assert limits == {"cpu": "1500m", "memory": "160Mi"}, limits
    assert _guest(cluster) == before


def test_delete_leaves_nothing_behind(cluster: Cluster, pod: dict[str, Any], tmp_path: Path) -> None:
    cluster.kubectl("delete", "pod", POD, "--wait=true", timeout=180)
    empty: dict[str, object] = {"domains": [], "namespaces": [], "allocations": [], "claims": [], "bridge ports": []}
    until("nothing left behind", 180, lambda: cluster.leftovers() == empty and not cluster.sandboxes())
