"""Image volumes (KEP-4639, GA in Kubernetes 1.36) in a VM pod of a one-node cluster
(``scripts/cluster.sh``): a pod with ``runtimeClassName: vmsandbox`` mounts an image (a second
small image, built by buildah and pushed to the cluster's registry) whole and by ``subPath``; the
kubelet pulls it through the shim and passes it as ``Mount.image``. ``kubectl exec`` reads its
files at the mount paths, a write fails (read-only), and deleting the pod leaves nothing behind."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_support import REGISTRY, Cluster, apply, exec_in, push_image, running, running_cluster
from tests.registry_kit import Buildah

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]

# the cluster's registry stands in for docker.io
DATA_IMAGE = "docker.io/vmsandbox-test/data:1"
HELLO = b"hello from an image volume\n"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from running_cluster()


@pytest.fixture(scope="module")
def images(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The pods' image (push_image) and the data image the volume mounts (files only)."""
    tmp = tmp_path_factory.mktemp("image")
    app = push_image(tmp)
    buildah = Buildah(tmp / "data-buildah")
    buildah.image("data", [{"srv/hello.txt": HELLO, "srv/sub/inner.txt": b"inner\n"}], cmd='["/none"]')
    buildah.push("data", f"{REGISTRY}/vmsandbox-test/data:1")
    return app, DATA_IMAGE


def _pod(app: str, data: str) -> dict[str, Any]:
    resources = {"cpu": "200m", "memory": "64Mi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "vm-image-volume", "namespace": "default"},
        "spec": {
            "runtimeClassName": "vmsandbox",
            "terminationGracePeriodSeconds": 2,
            "volumes": [{"name": "data", "image": {"reference": data, "pullPolicy": "IfNotPresent"}}],
            "containers": [
                {
                    "name": "main",
                    "image": app,
                    "command": ["/bin/busybox", "sh", "-c", "exec sleep 3600"],
                    "resources": {"requests": resources, "limits": resources},
                    "volumeMounts": [
                        {"name": "data", "mountPath": "/data"},
                        {"name": "data", "mountPath": "/inner", "subPath": "srv/sub"},
                    ],
                }
            ],
        },
    }


def test_an_image_volume_is_read_in_a_vm_pod_and_its_deletion_leaves_nothing(
    cluster: Cluster, images: tuple[str, str], tmp_path: Path
) -> None:
    app, data = images
    apply(cluster, tmp_path, _pod(app, data))
    running(cluster, "vm-image-volume", time.monotonic() + 300)
    assert len(cluster.sandboxes()) == 1

    read = exec_in(cluster, "vm-image-volume", "/bin/busybox", "cat", "/data/srv/hello.txt", "/inner/inner.txt")
    assert read.returncode == 0 and read.stdout == HELLO.decode() + "inner\n", read
    write = exec_in(cluster, "vm-image-volume", "/bin/busybox", "touch", "/data/new")
    assert write.returncode != 0 and "Read-only file system" in write.stderr, write

    cluster.kubectl("delete", "pod", "vm-image-volume", "--wait=true", timeout=180)
    # the kubelet stops the sandbox when its pod goes and removes it at its next garbage collection
    deadline = time.monotonic() + 180
    empty: dict[str, object] = {"domains": [], "namespaces": [], "allocations": [], "claims": [], "bridge ports": []}
    while (left := cluster.leftovers()) != empty or cluster.sandboxes():
        assert time.monotonic() < deadline, f"left behind: {left}, sandboxes {cluster.sandboxes()}"
        time.sleep(1)
    assert json.loads(cluster.kubectl("get", "pods", "-o", "json").stdout)["items"] == []
