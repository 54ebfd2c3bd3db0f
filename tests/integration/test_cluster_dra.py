"""vmsandbox as the DRA driver ``vmsandbox.dev`` in the one-node cluster (``CLUSTER_DRA=1``): the
plugin registers with the real 1.37 kubelet, its network pool's ResourceSlice is published, a VM pod
with a ResourceClaimTemplate of the ``vmsandbox-network`` class is scheduled onto it, the kubelet's
NodePrepareResources keeps the claim (with the pod's uid and the claim's opaque config) in the
driver's store, RunPodSandbox refuses the pod (its NIC does not reach a VM yet, docs/dra.md: a pod
never runs without what it claimed), and deleting the pod unprepares the claim."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_support import Cluster, apply, push_image, running_cluster, until

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]

DRIVER = "vmsandbox.dev"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    before = os.environ.get("CLUSTER_DRA")
    os.environ["CLUSTER_DRA"] = "1"  # scripts/cluster.sh reads it (running_cluster passes the environment on)
    try:
        yield from running_cluster()
    finally:
        if before is None:
            os.environ.pop("CLUSTER_DRA", None)
        else:
            os.environ["CLUSTER_DRA"] = before


def kube_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)


def stored_claims(cluster: Cluster) -> list[dict[str, Any]]:
    directory = cluster.state_dir / "dra" / "claims"
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))] if directory.is_dir() else []


def manifests(image: str, pod: str, address: str) -> list[dict[str, Any]]:
    """A ResourceClaimTemplate of the network class (interface net1 at ``address``) and a VM pod of it."""
    return [
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
         "metadata": {"name": pod, "namespace": "default"},
         "spec": {"spec": {"devices": {
             "requests": [{"name": "net", "exactly": {"deviceClassName": "vmsandbox-network"}}],
             "config": [{"requests": ["net"], "opaque": {"driver": DRIVER, "parameters": {
                 "interfaceName": "net1", "addresses": [address]}}}],
         }}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": "default"},
         "spec": {
             "runtimeClassName": "vmsandbox",
             "terminationGracePeriodSeconds": 2,
             "resourceClaims": [{"name": "net1", "resourceClaimTemplateName": pod}],
             "containers": [{"name": "main", "image": image, "command": ["/bin/busybox", "sleep", "3600"],
                             "resources": {"claims": [{"name": "net1"}]}}],
         }},
    ]  # fmt: skip


def refused(cluster: Cluster, pod_name: str) -> bool:
    """The kubelet's events of ``pod_name`` carry vmsandbox's refusal of a pod with claims."""
    events = cluster.kubectl("get", "events", "--field-selector", f"involvedObject.name={pod_name}", "-o", "json")
    return "do not attach yet" in events.stdout


def test_registered_and_slice_published(cluster: Cluster) -> None:
    shim_log = cluster.dir / "logs" / "shim.log"
    until("the kubelet registers the plugin", 60, lambda: "DRA: registered with the kubelet" in shim_log.read_text())

    def published() -> dict[str, Any] | None:
        items = kube_json(cluster, "get", "resourceslices")["items"]
        ours = [s for s in items if s["spec"]["driver"] == DRIVER]
        return ours[0] if ours else None

    found = until("the ResourceSlice", 30, published)
    assert found["spec"]["pool"]["name"].endswith("-networks")
    assert [d["name"] for d in found["spec"]["devices"]] == ["net1"]
    assert found["spec"]["devices"][0]["attributes"]["vmsandbox.dev/kind"] == {"string": "bridge"}


def test_vm_pods_with_network_claims_are_prepared_refused_and_unprepared(cluster: Cluster, tmp_path: Path) -> None:
    """Two VM pods, each with its own claim on the one network device (each a share of it): each claim
    is prepared with its pod's uid and its config; the pod is then refused at RunPodSandbox, its
    claimed NIC not reaching a VM yet (a pod never runs without what it claimed: the kubelet's event
    says why), and its claim is unprepared when it is deleted."""
    image = push_image(tmp_path)
    until(
        "the ResourceSlice",
        90,
        lambda: any(s["spec"]["driver"] == DRIVER for s in kube_json(cluster, "get", "resourceslices")["items"]),
    )
    addresses = {"dra-vm-a": "10.240.0.10/24", "dra-vm-b": "10.240.0.11/24"}
    for pod_name, address in addresses.items():
        apply(cluster, tmp_path, *manifests(image, pod_name, address))

    def claim_of(pod_name: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        pod = kube_json(cluster, "get", "pod", pod_name)
        statuses = pod["status"].get("resourceClaimStatuses") or []
        if not statuses or not statuses[0].get("resourceClaimName"):
            return None
        claim = kube_json(cluster, "get", "resourceclaim", statuses[0]["resourceClaimName"])
        return (pod, claim) if claim.get("status", {}).get("allocation") else None

    want = {}
    for pod_name, address in addresses.items():
        pod, claim = until(f"{pod_name}'s claim allocated", 300, functools.partial(claim_of, pod_name))
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["device"]) == (DRIVER, "net1")
        want[claim["metadata"]["uid"]] = {
            "uid": claim["metadata"]["uid"],
            "namespace": "default",
            "name": claim["metadata"]["name"],
            "podUIDs": [pod["metadata"]["uid"]],
            "devices": [{"request": "net", "pool": result["pool"], "device": "net1", "interfaceName": "net1",
                         "addresses": [address], "shareID": result.get("shareID", "")}],
        }  # fmt: skip
        until(f"{pod_name}'s refusal in its events", 180, functools.partial(refused, cluster, pod_name))
        assert kube_json(cluster, "get", "pod", pod_name)["status"]["phase"] == "Pending"
        assert not any(s.metadata.uid == pod["metadata"]["uid"] for s in cluster.sandboxes())  # no VM
    until("both claims prepared", 60, lambda: {c["uid"]: c for c in stored_claims(cluster)} == want)
    assert len({c["devices"][0]["shareID"] for c in want.values()}) == 2  # one share of the device each
    assert cluster.leftovers()["domains"] == []

    cluster.kubectl("delete", "pod", "dra-vm-a", "--wait=true", timeout=180)
    until("dra-vm-a's claim unprepared", 120, lambda: len(stored_claims(cluster)) == 1)
    assert stored_claims(cluster)[0]["name"] == want[next(u for u in want if "dra-vm-b" in want[u]["name"])]["name"]
    cluster.kubectl("delete", "pod", "dra-vm-b", "--wait=true", timeout=180)
    until("every claim unprepared", 120, lambda: stored_claims(cluster) == [])
