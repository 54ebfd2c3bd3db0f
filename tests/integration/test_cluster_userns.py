"""A ``hostUsers: false`` pod (KEP-127) with RuntimeClass ``vmsandbox`` in the one-node cluster
(``scripts/cluster.sh``): the 1.37 kubelet sees the handler's ``user_namespaces`` feature in the
runtime's Status, picks the pod's mappings and sends them; inside the VM the container's
``/proc/self/uid_map`` is exactly that (non-identity) mapping, it is root in it, its ConfigMap
volume reads with the kubelet's owner (root), and its service-account token authenticates it to
the API server. The cluster needs no setting for it: the ``UserNamespacesSupport`` gate is GA
and locked on in 1.36+."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cli.inspect_state import read_sandboxes
from tests.integration.cluster_support import Cluster, apply, exec_in, push_image, running, running_cluster, until

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]

PROBE = "/bin/probe"
BUSYBOX = "/bin/busybox"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from running_cluster()


@pytest.fixture(scope="module")
def pod(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("userns")
    image = push_image(tmp)
    # a whole CPU: the probe's TLS handshake with the API server, emulated (TCG) under a 100m quota,
    # takes longer than its 20 s client timeout
    resources = {"cpu": "1", "memory": "64Mi"}
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "userns-config", "namespace": "default"},
        "data": {"greeting": "hello in a user namespace"},
    }
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "userns-vm", "namespace": "default"},
        "spec": {
            "hostUsers": False,
            "runtimeClassName": "vmsandbox",
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "command": [BUSYBOX, "sleep", "3600"],
                    # the image's user is 1000: root here, to show the namespace's root is the container's
                    "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                    "resources": {"requests": resources, "limits": resources},
                    "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
                }
            ],
            "volumes": [{"name": "config", "configMap": {"name": "userns-config"}}],
        },
    }
    t0 = time.monotonic()
    apply(cluster, tmp, config, manifest)
    up = running(cluster, "userns-vm", t0 + 300)
    print(f"\ncluster: a hostUsers: false VM pod Running {time.monotonic() - t0:.1f} s after apply")
    return up


def _kubelet_mapping(cluster: Cluster) -> tuple[list[list[int]], list[list[int]]]:
    """The uid and gid mappings the kubelet sent for the pod, as the shim recorded them."""
    (view,) = [v for v in read_sandboxes(cluster.state_dir) if v.record["meta"]["name"] == "userns-vm"]
    userns = view.record["userns"]
    return userns["uids"], userns["gids"]


def test_the_container_has_the_kubelets_mapping_and_is_root_in_it(cluster: Cluster, pod: dict[str, Any]) -> None:
    uids, gids = _kubelet_mapping(cluster)
    assert len(uids) == 1 and uids == gids, uids
    container_id, host_id, length = uids[0]
    # the kubelet's choice: root mapped to a range of its own, past its own ids, 65536 long
    assert container_id == 0 and host_id >= 65536 and host_id % 65536 == 0 and length == 65536, uids
    for name in ("uid_map", "gid_map"):
        out = exec_in(cluster, "userns-vm", BUSYBOX, "cat", f"/proc/self/{name}")
        assert out.returncode == 0, out
        assert out.stdout.split() == [str(container_id), str(host_id), str(length)], out.stdout
    ids = exec_in(cluster, "userns-vm", BUSYBOX, "sh", "-c", f"{BUSYBOX} id -u; {BUSYBOX} id -g")
    assert ids.stdout.split() == ["0", "0"], ids


def test_the_config_map_reads_with_the_kubelets_owner(cluster: Cluster, pod: dict[str, Any]) -> None:
    read = exec_in(cluster, "userns-vm", BUSYBOX, "cat", "/config/greeting")
    assert read.stdout == "hello in a user namespace", read
    owner = exec_in(cluster, "userns-vm", BUSYBOX, "stat", "-L", "-c", "%u %g %a", "/config/greeting")
    assert owner.stdout.split() == ["0", "0", "644"], owner


def test_the_service_account_token_calls_the_api_server(cluster: Cluster, pod: dict[str, Any]) -> None:
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    owner = exec_in(cluster, "userns-vm", BUSYBOX, "stat", "-L", "-c", "%u", f"{sa}/token")
    if owner.stdout.split() != ["0"]:
        for argv in (["ls", "-lan", sa], ["stat", "-c", "%n %u %g %a", sa, f"{sa}/..data", "/var/run/secrets"]):
            got = exec_in(cluster, "userns-vm", BUSYBOX, *argv)
            print(f"\n{argv}: {got.stdout} {got.stderr}")
    assert owner.stdout.split() == ["0"], owner

    def version() -> str:
        out = exec_in(cluster, "userns-vm", PROBE, "api", "https://kubernetes.default.svc/version").stdout
        return out if out.startswith("status ") else ""

    api = until("GET /version from userns-vm", 60, version)
    assert api.startswith("status 200"), api
    assert json.loads(api.split("\n", 1)[1])["gitVersion"].startswith("v"), api


def test_delete_leaves_nothing_behind(cluster: Cluster, pod: dict[str, Any]) -> None:
    cluster.kubectl("delete", "pod", "userns-vm", "--wait=true", timeout=180)
    cluster.kubectl("delete", "configmap/userns-config", "--ignore-not-found")
    # the kubelet stops the sandbox when its pod goes and removes it at its next garbage collection
    deadline = time.monotonic() + 180
    empty: dict[str, object] = {"domains": [], "namespaces": [], "allocations": [], "claims": [], "bridge ports": []}
    while (left := cluster.leftovers()) != empty or cluster.sandboxes():
        assert time.monotonic() < deadline, f"left behind: {left}, sandboxes {cluster.sandboxes()}"
        time.sleep(1)
