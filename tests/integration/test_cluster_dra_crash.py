"""vmsandbox as the DRA driver in the one-node cluster (``CLUSTER_DRA=1``), with claims that take
their address from CNI host-local, and the shim killed (SIGKILL, ``shim/faults.py``) at each point
of NodePrepareResources -> RunPodSandbox -> the claim's status write -> NodeUnprepareResources.

First a VM pod whose claim has no static address Runs with the one host-local gave (kept in the
claim's record, its file in host-local's dataDir under the shim's state), its claim's status saying
what its guest has (the NIC's name, CIDRs and MAC, as ``ip addr`` in the guest shows them), written
again after a restart, and deleting it frees the claim, the allocation and the tap. A claim that
cannot be attached has its device Ready False with the reason. Then, for each crash point: the shim is
restarted armed with it (``scripts/cluster.sh restart-shim``, ``VMSANDBOX_FAULT``), a pod of such a
claim is applied, the shim dies at that point and is started again as usual; the kubelet retries,
the pod Runs with its NIC addressed from host-local, and once it is deleted nothing is left: no
claim record, no host-local allocation, no tap on the network's bridge, no domain, no
ResourceClaim."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_support import (
    SCRIPT,
    Cluster,
    apply,
    exec_in,
    push_image,
    running,
    until,
)
from tests.integration.dra_cluster_kit import BRIDGE, DRIVER, bridge_ports, dra_cluster, kube_json, stored_claims
from tests.registry_kit import BUSYBOX

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from dra_cluster()


SUBNET = ipaddress.ip_network("10.240.0.0/24")

# the shim dies at each: NodePrepareResources with its record kept (adding) and after host-local's
# ADD; RunPodSandbox with the pod's guest (and its tap) up, not yet READY; READY with the claim's
# status not written, then written but not answered; NodeUnprepareResources after host-local's DEL
CRASH_POINTS = (
    "dra:after-record",
    "dra:after-ipam-add",
    "RunPodSandbox:guest-start",
    "dra:before-status",
    "dra:after-status",
)


@pytest.fixture(scope="module")
def image(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    return push_image(tmp_path_factory.mktemp("image"))


def allocations(cluster: Cluster) -> list[str]:
    """host-local's allocation files for the DRA network (files named by an address)."""
    directory = cluster.state_dir / "dra" / "ipam" / "net1"
    out = []
    for p in sorted(directory.iterdir()) if directory.is_dir() else []:
        try:
            ipaddress.ip_address(p.name)
        except ValueError:
            continue
        out.append(p.name)
    return out


def links_on_bridge() -> list[str]:
    """``ip -o link``'s interfaces whose master is the DRA bridge."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return [line.split(":")[1].strip() for line in out.splitlines() if f" master {BRIDGE} " in line]


def manifests(image: str, pod: str) -> list[dict[str, Any]]:
    """A ResourceClaimTemplate of the network class naming the interface only (its address from
    host-local) and a VM pod of it."""
    return [
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
         "metadata": {"name": pod, "namespace": "default"},
         "spec": {"spec": {"devices": {
             "requests": [{"name": "net", "exactly": {"deviceClassName": "vmsandbox-network"}}],
             "config": [{"requests": ["net"], "opaque": {"driver": DRIVER, "parameters": {"interfaceName": "net1"}}}],
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


def shim_pid(cluster: Cluster) -> int | None:
    try:
        pid = int((cluster.dir / "run" / "shim.pid").read_text())
    except (OSError, ValueError):
        return None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return None if state == "Z" else pid


def restart_shim(cluster: Cluster, fault: str = "") -> None:
    """The shim stopped (cleanly) and started again, armed with ``fault`` when given."""
    env = {k: v for k, v in os.environ.items() if k != "VMSANDBOX_FAULT"}
    env.update(CLUSTER_DIR=str(cluster.dir), KUBE_BIN=cluster.bin, CLUSTER_MODE="proxy")
    if fault:
        env["VMSANDBOX_FAULT"] = fault
    done = subprocess.run(
        ["bash", str(SCRIPT), "restart-shim"], capture_output=True, text=True, timeout=300, env=env,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, f"restart-shim:\n{done.stdout}\n{done.stderr}\n{cluster.logs_tail()}"


def guest_nic(cluster: Cluster, pod: str) -> tuple[str, set[str]] | None:
    """net1's MAC and CIDRs in the pod's guest (busybox ``ip addr``); None while the exec fails (a
    kubelet reconnects to a restarted runtime in its own time)."""
    shown = exec_in(cluster, pod, "/bin/busybox", "ip", "addr", "show", "net1")
    if shown.returncode != 0:
        print(f"exec in {pod}: {shown.stderr.strip()[:300]}")
        return None
    assert ",UP," in shown.stdout, shown.stdout
    mac = re.search(r"link/ether ([0-9a-f:]{17})", shown.stdout)
    assert mac is not None, shown.stdout
    return mac.group(1), set(re.findall(r"inet6? ([0-9a-f.:]+/[0-9]+)", shown.stdout))


def check_running_with_host_local_address(cluster: Cluster, pod_name: str, deadline_s: float) -> str:
    """The pod Runs; its claim's record has host-local's address, which its guest's net1 has, the
    host reaches and the claim's status shows as the guest does. The address."""
    pod = running(cluster, pod_name, time.monotonic() + deadline_s)
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = kube_json(cluster, "get", "resourceclaim", status["resourceClaimName"])
    (record,) = [c for c in stored_claims(cluster) if c["uid"] == claim["metadata"]["uid"]]
    assert record["ipam"] == "added" and record["podUIDs"] == [pod["metadata"]["uid"]], record
    ((device, allocated),) = [(d, d["allocated"]) for d in record["devices"]]
    assert device["addresses"] == [] and device["interfaceName"] == "net1", record
    (address,) = allocated
    assert isinstance(address, str)
    assert ipaddress.ip_interface(address).ip in SUBNET, address
    assert address.split("/")[0] in allocations(cluster)

    def nic_with_address() -> tuple[str, set[str]] | None:
        got = guest_nic(cluster, pod_name)
        return got if got is not None and address in got[1] else None

    mac, _ = until(f"{pod_name}'s net1 at {address}", 60, nic_with_address)
    ping = subprocess.run(
        [str(BUSYBOX), "ping", "-c", "1", "-W", "10", address.split("/")[0]], capture_output=True, text=True
    )
    assert ping.returncode == 0, f"the host does not reach {pod_name} over {BRIDGE}: {ping.stdout}"

    def status_as_the_guest() -> Any:
        got = kube_json(cluster, "get", "resourceclaim", status["resourceClaimName"])
        devices = got.get("status", {}).get("devices")
        if not devices or not devices[0].get("networkData"):
            return None
        nic = guest_nic(cluster, pod_name)  # link-local addresses come in their own time: read both again
        if nic is None:
            return None
        cidrs = nic[1]
        data = devices[0]["networkData"]
        shown = (data["interfaceName"], data["hardwareAddress"], set(data["ips"]))
        return devices if shown == ("net1", mac, cidrs) else None

    (written,) = until(f"{pod_name}'s claim status as its guest has net1", 120, status_as_the_guest)
    assert [(c["type"], c["status"]) for c in written["conditions"]] == [("Ready", "True")]
    return address


def delete_and_check_nothing_left(cluster: Cluster, pod_name: str) -> None:
    cluster.kubectl("delete", "pod", pod_name, "--wait=true", timeout=300)
    nothing_left(cluster, pod_name)


def nothing_left(cluster: Cluster, pod_name: str) -> None:
    """The pod gone: no claim record, no host-local allocation, no tap, no domain, no ResourceClaim."""
    until(f"{pod_name}'s claim unprepared", 180, lambda: stored_claims(cluster) == [])
    until(f"{pod_name}'s ResourceClaim gone", 120, lambda: kube_json(cluster, "get", "resourceclaims")["items"] == [])
    assert allocations(cluster) == []
    assert bridge_ports() == [] and links_on_bridge() == []
    assert cluster.leftovers()["domains"] == []
    cluster.kubectl("delete", "resourceclaimtemplate", pod_name, "--wait=true")


def test_a_claim_without_static_addresses_gets_one_from_host_local(
    cluster: Cluster, image: str, tmp_path: Path
) -> None:
    until(
        "the ResourceSlice",
        90,
        lambda: any(s["spec"]["driver"] == DRIVER for s in kube_json(cluster, "get", "resourceslices")["items"]),
    )
    apply(cluster, tmp_path, *manifests(image, "dra-ipam"))
    check_running_with_host_local_address(cluster, "dra-ipam", 600)
    # a restart writes the READY pod's claim status again: the same, so nothing changes
    restart_shim(cluster)
    shim_log = cluster.dir / "logs" / "shim.log"
    until("the status written again", 120, lambda: "status of 1 running pods written again" in shim_log.read_text())
    check_running_with_host_local_address(cluster, "dra-ipam", 60)
    delete_and_check_nothing_left(cluster, "dra-ipam")


def test_a_claim_that_cannot_be_attached_says_why_in_its_status(cluster: Cluster, image: str, tmp_path: Path) -> None:
    """A claim whose static address is not of its network's subnet: RunPodSandbox refuses the pod
    (before anything is held), and the claim's device is Ready False, reason AttachFailed, the
    refusal its message; deleting the pod leaves nothing."""
    docs = manifests(image, "dra-refused")
    docs[0]["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["addresses"] = ["10.9.9.9/24"]
    apply(cluster, tmp_path, *docs)

    def not_ready() -> Any:
        statuses = kube_json(cluster, "get", "pod", "dra-refused")["status"].get("resourceClaimStatuses")
        if not statuses:
            return None
        claim = kube_json(cluster, "get", "resourceclaim", statuses[0]["resourceClaimName"])
        devices = claim.get("status", {}).get("devices") or []
        return devices[0] if devices else None

    device = until("the claim's status says why the pod has no NIC", 300, not_ready)
    (cond,) = device["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "False", "AttachFailed"), cond
    assert '"10.9.9.9/24" is not in 10.240.0.0/24' in cond["message"], cond
    assert "networkData" not in device
    assert kube_json(cluster, "get", "pod", "dra-refused")["status"].get("phase") == "Pending"
    assert allocations(cluster) == [] and bridge_ports() == []  # a static address: host-local not run
    delete_and_check_nothing_left(cluster, "dra-refused")


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_killed_at_each_point_leaves_nothing(cluster: Cluster, image: str, tmp_path: Path, point: str) -> None:
    pod_name = "dra-crash-" + re.sub(r"[^a-z0-9]+", "-", point.lower()).strip("-")
    restart_shim(cluster, point)
    killed = shim_pid(cluster)
    assert killed is not None
    log_size = (cluster.dir / "logs" / "shim.log").stat().st_size
    apply(cluster, tmp_path, *manifests(image, pod_name))
    until(f"the shim killed at {point}", 600, lambda: shim_pid(cluster) != killed)
    said = (cluster.dir / "logs" / "shim.log").read_text(errors="replace")[log_size:]
    assert f"fault injection: SIGKILL at {point}" in said, said[-3000:]
    restart_shim(cluster)
    check_running_with_host_local_address(cluster, pod_name, 900)
    assert len(stored_claims(cluster)) == 1 and len(allocations(cluster)) == 1 and len(bridge_ports()) == 1
    delete_and_check_nothing_left(cluster, pod_name)


def test_killed_after_the_unprepares_del_leaves_nothing(cluster: Cluster, image: str, tmp_path: Path) -> None:
    """NodeUnprepareResources DELeted host-local's address and the shim died before forgetting the
    claim: the kubelet's unprepare again DELs (nothing there now) and forgets it."""
    pod_name = "dra-crash-unprepare"
    apply(cluster, tmp_path, *manifests(image, pod_name))
    check_running_with_host_local_address(cluster, pod_name, 600)
    restart_shim(cluster, "dra:after-ipam-del")
    killed = shim_pid(cluster)
    cluster.kubectl("delete", "pod", pod_name, "--wait=false")
    until("the shim killed at dra:after-ipam-del", 300, lambda: shim_pid(cluster) != killed)
    assert allocations(cluster) == [] and len(stored_claims(cluster)) == 1  # DELeted, not yet forgotten
    restart_shim(cluster)
    until(f"{pod_name} gone", 300, lambda: cluster.kubectl("get", "pod", pod_name, check=False).returncode != 0)
    nothing_left(cluster, pod_name)
