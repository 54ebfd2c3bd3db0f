"""vmsandbox as the DRA driver ``vmsandbox.dev`` in the one-node cluster (``CLUSTER_DRA=1``): the
plugin registers with the real 1.37 kubelet, its network pool's ResourceSlice is published, VM pods
with a ResourceClaimTemplate of the ``vmsandbox-network`` class are scheduled onto it, the kubelet's
NodePrepareResources keeps each claim (with the pod's uid and the claim's opaque config) in the
driver's store, each pod Runs with its claimed NIC (a tap on the network's bridge) named ``net1``
and addressed in its guest, the host reaches each over that bridge, each claim's
``status.devices[]`` says what the guest has (the NIC's name, CIDRs and MAC), and deleting a pod
unprepares its claim and removes its tap.

The guest image is the host's (``scripts/setup-host.sh`` builds it from this tree): its /init
configures the claimed NICs."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_support import Cluster, apply, exec_in, push_image, running, until
from tests.integration.dra_cluster_kit import BRIDGE, DRIVER, bridge_ports, dra_cluster, kube_json, stored_claims
from tests.registry_kit import BUSYBOX

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from dra_cluster()


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


def test_vm_pods_with_network_claims_run_with_their_nics_and_unprepare_when_deleted(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Two VM pods, each with its own claim on the one network device (each a share of it): each claim
    is prepared with its pod's uid and its config; each pod Runs, its guest has ``net1`` with the
    claim's address, reached from the host over the network's bridge; deleting a pod unprepares its
    claim and removes its tap."""
    image = push_image(tmp_path)
    until(
        "the ResourceSlice",
        90,
        lambda: any(s["spec"]["driver"] == DRIVER for s in kube_json(cluster, "get", "resourceslices")["items"]),
    )
    addresses = {"dra-vm-a": "10.240.0.10/24", "dra-vm-b": "10.240.0.11/24"}
    for pod_name, address in addresses.items():
        apply(cluster, tmp_path, *manifests(image, pod_name, address))

    want = {}
    for pod_name, address in addresses.items():
        pod = running(cluster, pod_name, time.monotonic() + 600)
        (status,) = pod["status"]["resourceClaimStatuses"]
        claim = kube_json(cluster, "get", "resourceclaim", status["resourceClaimName"])
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
        shown = exec_in(cluster, pod_name, "/bin/busybox", "ip", "addr", "show", "net1")
        assert shown.returncode == 0, shown.stderr
        assert f"inet {address} " in shown.stdout and ",UP," in shown.stdout, shown.stdout
        ping = subprocess.run(
            [str(BUSYBOX), "ping", "-c", "1", "-W", "10", address.split("/")[0]], capture_output=True, text=True
        )
        assert ping.returncode == 0, f"the host does not reach {pod_name} over {BRIDGE}: {ping.stdout}"
        # the claim's status says what the guest has: the NIC's name, its CIDRs and its MAC
        mac = re.search(r"link/ether ([0-9a-f:]{17})", shown.stdout)
        cidrs = set(re.findall(r"inet6? ([0-9a-f.:]+/[0-9]+)", shown.stdout))
        assert mac is not None and address in cidrs, shown.stdout

        def status_of(claim_name: str = status["resourceClaimName"]) -> Any:
            devices = kube_json(cluster, "get", "resourceclaim", claim_name).get("status", {}).get("devices")
            return devices if devices and devices[0].get("networkData") else None

        (device,) = until(f"{pod_name}'s claim status", 60, status_of)
        assert (device["driver"], device["pool"], device["device"]) == (DRIVER, result["pool"], "net1")
        assert device.get("shareID", "") == result.get("shareID", "")
        assert [(c["type"], c["status"]) for c in device["conditions"]] == [("Ready", "True")]
        data = device["networkData"]
        assert (data["interfaceName"], data["hardwareAddress"], set(data["ips"])) == ("net1", mac.group(1), cidrs)
    assert {c["uid"]: c for c in stored_claims(cluster)} == want
    assert len({c["devices"][0]["shareID"] for c in want.values()}) == 2  # one share of the device each
    assert len(bridge_ports()) == 2

    cluster.kubectl("delete", "pod", "dra-vm-a", "--wait=true", timeout=180)
    until("dra-vm-a's claim unprepared", 120, lambda: len(stored_claims(cluster)) == 1)
    assert stored_claims(cluster)[0]["name"] == want[next(u for u in want if "dra-vm-b" in want[u]["name"])]["name"]
    assert len(bridge_ports()) == 1
    cluster.kubectl("delete", "pod", "dra-vm-b", "--wait=true", timeout=180)
    until("every claim unprepared", 120, lambda: stored_claims(cluster) == [])
    assert bridge_ports() == []
    assert cluster.leftovers()["domains"] == []
