"""An ordinary (runc) pod on the DRA driver's secondary network in the one-node cluster
(``CLUSTER_DRA=1``, proxy mode: containerd runs ordinary pods, with NRI on, on a socket of its own,
where vmsandbox is an NRI plugin): a VM pod and a runc pod, each with a ResourceClaimTemplate on
``net1`` with a static address, reach each other over the network's bridge (the VM pod's NIC a tap,
the runc pod's a veth pair made at its RunPodSandbox through NRI); the runc pod's claim's
``status.devices[]`` has its ``networkData``; deleting both pods unprepares both claims and leaves
no veth on the host."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_support import Cluster, apply, exec_in, push_image, running, until
from tests.integration.dra_cluster_kit import DRIVER, bridge_ports, dra_cluster, kube_json, our_veths, stored_claims

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from dra_cluster()


VM_ADDRESS, RUNC_ADDRESS = "10.240.0.21/24", "10.240.0.22/24"


def manifests(image: str, pod: str, address: str, runtime_class: str | None) -> list[dict[str, Any]]:
    """A ResourceClaimTemplate of the network class (``net1`` at ``address``) and a pod of it, run
    as root (ping's raw socket): a VM pod of ``runtime_class``, or with None an ordinary pod."""
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 2,
        "securityContext": {"runAsUser": 0},
        "resourceClaims": [{"name": "net1", "resourceClaimTemplateName": pod}],
        "containers": [{"name": "main", "image": image, "command": ["/bin/busybox", "sleep", "3600"],
                        "resources": {"claims": [{"name": "net1"}]}}],
    }  # fmt: skip
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    return [
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
         "metadata": {"name": pod, "namespace": "default"},
         "spec": {"spec": {"devices": {
             "requests": [{"name": "net", "exactly": {"deviceClassName": "vmsandbox-network"}}],
             "config": [{"requests": ["net"], "opaque": {"driver": DRIVER, "parameters": {
                 "interfaceName": "net1", "addresses": [address]}}}],
         }}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": "default"}, "spec": spec},
    ]  # fmt: skip


def test_runc_pod_and_vm_pod_reach_each_other_over_the_claimed_network(cluster: Cluster, tmp_path: Path) -> None:
    image = push_image(tmp_path)
    until(
        "the ResourceSlice",
        90,
        lambda: any(s["spec"]["driver"] == DRIVER for s in kube_json(cluster, "get", "resourceslices")["items"]),
    )
    shim_log = cluster.dir / "logs" / "shim.log"
    until("the NRI plugin registered", 60, lambda: "DRA: registered as NRI plugin" in shim_log.read_text())
    apply(cluster, tmp_path, *manifests(image, "dra-vm", VM_ADDRESS, "vmsandbox"))
    apply(cluster, tmp_path, *manifests(image, "dra-runc", RUNC_ADDRESS, None))
    vm = running(cluster, "dra-vm", time.monotonic() + 600)
    runc = running(cluster, "dra-runc", time.monotonic() + 300)
    assert not runc["spec"].get("runtimeClassName")

    # the runc pod has net1 with its claim's address, on a veth whose host end is a port of the bridge
    shown = exec_in(cluster, "dra-runc", "/bin/busybox", "ip", "addr", "show", "net1")
    assert shown.returncode == 0, shown.stderr
    assert f"inet {RUNC_ADDRESS} " in shown.stdout and ",UP" in shown.stdout, shown.stdout
    veths = our_veths()
    assert len(veths) == 1 and veths[0] in bridge_ports(), (veths, bridge_ports())

    # over the network: runc pod -> VM pod, VM pod -> runc pod
    ping = exec_in(cluster, "dra-runc", "/bin/busybox", "ping", "-c", "3", "-W", "10", VM_ADDRESS.split("/")[0])
    assert ping.returncode == 0, f"the runc pod does not reach the VM pod: {ping.stdout}{ping.stderr}"
    back = exec_in(cluster, "dra-vm", "/bin/busybox", "ping", "-c", "3", "-W", "10", RUNC_ADDRESS.split("/")[0])
    assert back.returncode == 0, f"the VM pod does not reach the runc pod: {back.stdout}{back.stderr}"

    # the runc pod's claim status: its NIC's name, CIDRs and MAC as its namespace shows them
    (status,) = runc["status"]["resourceClaimStatuses"]
    claim_name = status["resourceClaimName"]
    mac = re.search(r"link/ether ([0-9a-f:]{17})", shown.stdout)
    cidrs = set(re.findall(r"inet6? ([0-9a-f.:]+/[0-9]+)", shown.stdout))
    assert mac is not None, shown.stdout

    def status_of() -> Any:
        devices = kube_json(cluster, "get", "resourceclaim", claim_name).get("status", {}).get("devices")
        return devices if devices and devices[0].get("networkData") else None

    (device,) = until("the runc pod's claim status", 60, status_of)
    claim = kube_json(cluster, "get", "resourceclaim", claim_name)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (device["driver"], device["pool"], device["device"]) == (DRIVER, result["pool"], "net1")
    assert device.get("shareID", "") == result.get("shareID", "")
    assert [(c["type"], c["status"]) for c in device["conditions"]] == [("Ready", "True")]
    data = device["networkData"]
    assert (data["interfaceName"], data["hardwareAddress"]) == ("net1", mac.group(1))
    assert RUNC_ADDRESS in data["ips"] and set(data["ips"]) <= cidrs, (data, cidrs)

    uids = {vm["metadata"]["uid"], runc["metadata"]["uid"]}
    assert {u for c in stored_claims(cluster) for u in c["podUIDs"]} == uids

    # deleting both: the claims unprepared, no veth left on the host, nothing on the bridge
    cluster.kubectl("delete", "pod", "dra-runc", "dra-vm", "--wait=true", timeout=240)
    until("both claims unprepared", 120, lambda: stored_claims(cluster) == [])
    until("no veth of a runc pod left", 60, lambda: our_veths() == [])
    assert bridge_ports() == []
    assert list((cluster.state_dir / "dra" / "runc").glob("*.json")) == []
    assert cluster.leftovers()["domains"] == []


def test_a_runc_pod_whose_claim_has_no_address_gets_one_from_host_local(cluster: Cluster, tmp_path: Path) -> None:
    """A claimed device without static addresses takes the one host-local gave it at
    NodePrepareResources, in the runc pod's namespace as in a VM; its status says so; deleting the
    pod frees the allocation."""
    image = push_image(tmp_path)
    docs = manifests(image, "dra-runc-ipam", RUNC_ADDRESS, None)
    docs[0]["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"] = {"interfaceName": "net1"}
    apply(cluster, tmp_path, *docs)
    pod = running(cluster, "dra-runc-ipam", time.monotonic() + 300)
    shown = exec_in(cluster, "dra-runc-ipam", "/bin/busybox", "ip", "addr", "show", "net1")
    assert shown.returncode == 0, shown.stderr
    (given,) = re.findall(r"inet (10\.240\.0\.[0-9]+/24) ", shown.stdout)
    (status,) = pod["status"]["resourceClaimStatuses"]

    def ips() -> Any:
        devices = kube_json(cluster, "get", "resourceclaim", status["resourceClaimName"]).get("status", {})
        data = (devices.get("devices") or [{}])[0].get("networkData")
        return data["ips"] if data else None

    assert given in until("the claim's status", 60, ips)
    allocations = cluster.state_dir / "dra" / "ipam"
    assert any(given.split("/")[0] == p.name for p in allocations.rglob("*")), sorted(allocations.rglob("*"))
    cluster.kubectl("delete", "pod", "dra-runc-ipam", "--wait=true", timeout=240)
    until("its claim unprepared", 120, lambda: stored_claims(cluster) == [])
    assert not any(given.split("/")[0] == p.name for p in allocations.rglob("*"))
    assert our_veths() == []


def test_a_host_network_runc_pod_with_a_claimed_network_is_refused_with_the_reason(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A claimed network device needs the pod's own network namespace: a host-network pod's
    RunPodSandbox fails through NRI with the driver's reason, and nothing is left."""
    image = push_image(tmp_path)
    docs = manifests(image, "dra-runc-bad", RUNC_ADDRESS, None)
    docs[1]["spec"]["hostNetwork"] = True
    apply(cluster, tmp_path, *docs)

    def refused() -> str:
        events = kube_json(cluster, "get", "events", "--field-selector", "involvedObject.name=dra-runc-bad")["items"]
        return next((e["message"] for e in events if "has no network namespace of its own" in e.get("message", "")), "")

    message = until("the pod's sandbox refused", 300, refused)
    assert "vmsandbox-dra" in message, message
    assert our_veths() == []
    cluster.kubectl("delete", "pod", "dra-runc-bad", "--wait=true", timeout=240)
    until("its claim unprepared", 120, lambda: stored_claims(cluster) == [])
