"""The DRA driver in shim mode (``CLUSTER_MODE=shim CLUSTER_DRA=1``): the kubelet talks to
containerd 2.4, whose drop-in maps vmsandbox's handlers to its runtime shim, and vmsandbox is also
the DRA driver ``vmsandbox.dev`` and an NRI plugin of that containerd. A VM pod (RuntimeClass
``vmsandbox``) with a claim on ``net1`` gets its NIC at CreateSandbox (the claim found by the pod's
uid, from the ``PodSandboxConfig`` containerd passes on), a runc pod (containerd's default runtime)
its veth through NRI, and NRI's RunPodSandbox of the VM pod is left alone; the two ping each other
over the network's bridge; each claim's ``status.devices[]`` has the NIC as the pod shows it;
deleting both unprepares the claims and leaves no tap or veth on the host."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_support import Cluster, apply, exec_in, push_image, running, until
from tests.integration.dra_cluster_kit import (
    DRIVER,
    bridge_ports,
    dra_cluster,
    kube_json,
    our_veths,
    records,
    stored_claims,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from dra_cluster("shim")


VM_ADDRESS, RUNC_ADDRESS = "10.240.0.31/24", "10.240.0.32/24"
RUNC_SLEEP = "3607"  # the runc pod's `sleep` argument: its process is found on the host by it


def manifests(image: str, pod: str, address: str, runtime_class: str | None, sleep: str) -> list[dict[str, Any]]:
    """A ResourceClaimTemplate of the network class (``net1`` at ``address``) and a pod of it, run as
    root (ping's raw socket): a VM pod of ``runtime_class``, or with None an ordinary pod."""
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 2,
        "securityContext": {"runAsUser": 0},
        "resourceClaims": [{"name": "net1", "resourceClaimTemplateName": pod}],
        "containers": [{"name": "main", "image": image, "command": ["/bin/busybox", "sleep", sleep],
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


def runc_pid() -> int | None:
    """The host pid of the runc pod's ``sleep`` (the VM pod's runs in its guest)."""
    want = f"/bin/busybox\0sleep\0{RUNC_SLEEP}\0".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes() == want:
                    return int(proc.name)
            except OSError:
                continue
    return None


def ip_j_addr(pid: int, name: str) -> dict[str, Any]:
    """``ip -j addr show dev NAME`` in the network namespace of ``pid``: the NIC's name, MAC, CIDRs."""
    done = subprocess.run(
        ["nsenter", "-t", str(pid), "-n", "ip", "-j", "addr", "show", "dev", name],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (link,) = json.loads(done.stdout)
    cidrs = {f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"]}
    up = "UP" in link["flags"]
    return {"interfaceName": link["ifname"], "hardwareAddress": link["address"], "ips": cidrs, "up": up}


def guest_addr(cluster: Cluster, pod: str, name: str) -> dict[str, Any]:
    """The same of the VM pod's guest, from its busybox ``ip addr show`` (which has no ``-j``)."""
    shown = exec_in(cluster, pod, "/bin/busybox", "ip", "addr", "show", name)
    assert shown.returncode == 0, shown.stderr
    mac = re.search(r"link/ether ([0-9a-f:]{17})", shown.stdout)
    assert mac is not None, shown.stdout
    cidrs = set(re.findall(r"inet6? ([0-9a-f.:]+/[0-9]+)", shown.stdout))
    first = shown.stdout.splitlines()[0]
    return {"interfaceName": name, "hardwareAddress": mac.group(1), "ips": cidrs, "up": ",UP" in first}


def claim_device(cluster: Cluster, pod: dict[str, Any], what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's one claim's allocation result and its ``status.devices[0]`` once it has networkData."""
    (status,) = pod["status"]["resourceClaimStatuses"]
    name = status["resourceClaimName"]

    def written() -> Any:
        devices = kube_json(cluster, "get", "resourceclaim", name).get("status", {}).get("devices")
        return devices if devices and devices[0].get("networkData") else None

    (device,) = until(f"{what}'s claim status", 90, written)
    (result,) = kube_json(cluster, "get", "resourceclaim", name)["status"]["allocation"]["devices"]["results"]
    assert (device["driver"], device["pool"], device["device"]) == (DRIVER, result["pool"], "net1")
    assert device.get("shareID", "") == result.get("shareID", "")
    assert [(c["type"], c["status"]) for c in device["conditions"]] == [("Ready", "True")]
    return result, device


def test_vm_pod_and_runc_pod_with_claims_reach_each_other_through_containerd(cluster: Cluster, tmp_path: Path) -> None:
    image = push_image(tmp_path)
    until(
        "the ResourceSlice",
        90,
        lambda: any(s["spec"]["driver"] == DRIVER for s in kube_json(cluster, "get", "resourceslices")["items"]),
    )
    shim_log = cluster.dir / "logs" / "shim.log"
    until("the kubelet registers the plugin", 60, lambda: "DRA: registered with the kubelet" in shim_log.read_text())
    until("the NRI plugin registered", 60, lambda: "DRA: registered as NRI plugin" in shim_log.read_text())
    apply(cluster, tmp_path, *manifests(image, "dra-shim-vm", VM_ADDRESS, "vmsandbox", "3600"))
    apply(cluster, tmp_path, *manifests(image, "dra-shim-runc", RUNC_ADDRESS, None, RUNC_SLEEP))
    vm = running(cluster, "dra-shim-vm", time.monotonic() + 600)
    runc = running(cluster, "dra-shim-runc", time.monotonic() + 300)
    assert not runc["spec"].get("runtimeClassName")

    # the VM pod is vmsandbox's, under containerd's sandbox id; the runc pod is not
    (sandbox,) = cluster.sandboxes()
    assert sandbox.metadata.name == "dra-shim-vm" and sandbox.metadata.uid == vm["metadata"]["uid"]
    # both claims prepared, each for its pod's uid (the VM pod's claim found by it at CreateSandbox)
    uids = {vm["metadata"]["uid"], runc["metadata"]["uid"]}
    assert sorted(u for c in stored_claims(cluster) for u in c["podUIDs"]) == sorted(uids)
    # NRI's RunPodSandbox made a veth for the runc pod only: the VM pod's NIC is its domain's tap
    made = records(cluster, "runc")
    assert [r["podUID"] for r in made] == [runc["metadata"]["uid"]], made
    veths = our_veths()
    assert len(veths) == 1 and veths[0] in bridge_ports(), (veths, bridge_ports())
    assert len(bridge_ports()) == 2, bridge_ports()  # the veth's host end and the VM's tap

    # each pod has net1 with its claim's address, up
    pid = until("the runc pod's process on the host", 60, runc_pid)
    in_runc = ip_j_addr(pid, "net1")
    in_vm = guest_addr(cluster, "dra-shim-vm", "net1")
    assert RUNC_ADDRESS in in_runc["ips"] and in_runc["up"], in_runc
    assert VM_ADDRESS in in_vm["ips"] and in_vm["up"], in_vm

    # over the network: runc pod -> VM pod, VM pod -> runc pod
    ping = exec_in(cluster, "dra-shim-runc", "/bin/busybox", "ping", "-c", "3", "-W", "10", VM_ADDRESS.split("/")[0])
    assert ping.returncode == 0, f"the runc pod does not reach the VM pod: {ping.stdout}{ping.stderr}"
    back = exec_in(cluster, "dra-shim-vm", "/bin/busybox", "ping", "-c", "3", "-W", "10", RUNC_ADDRESS.split("/")[0])
    assert back.returncode == 0, f"the VM pod does not reach the runc pod: {back.stdout}{back.stderr}"

    # each claim's status: its NIC's name, CIDRs and MAC as the pod shows them
    _, vm_device = claim_device(cluster, vm, "the VM pod")
    data = vm_device["networkData"]
    assert (data["interfaceName"], data["hardwareAddress"], set(data["ips"])) == (
        in_vm["interfaceName"],
        in_vm["hardwareAddress"],
        in_vm["ips"],
    ), (data, in_vm)
    _, runc_device = claim_device(cluster, runc, "the runc pod")
    data = runc_device["networkData"]
    in_runc = ip_j_addr(pid, "net1")
    assert (data["interfaceName"], data["hardwareAddress"], set(data["ips"])) == (
        in_runc["interfaceName"],
        in_runc["hardwareAddress"],
        in_runc["ips"],
    ), (data, in_runc)

    # deleting both: the claims unprepared, no tap or veth left, nothing on the bridge
    cluster.kubectl("delete", "pod", "dra-shim-runc", "dra-shim-vm", "--wait=true", timeout=240)
    until("both claims unprepared", 120, lambda: stored_claims(cluster) == [])
    until("no veth of a runc pod left", 60, lambda: our_veths() == [])
    until("nothing on the bridge", 60, lambda: bridge_ports() == [])
    assert records(cluster, "runc") == []
    until("no VM pod left", 120, lambda: cluster.sandboxes() == [])
    until("no domain left", 60, lambda: cluster.leftovers()["domains"] == [])
