"""PodNetworks with a namespace its caller made (shim mode: containerd ran CNI in it): the guest's
macvtap on its eth0, the address and routes read from it, and only the macvtap removed after.
Real namespaces and links, no guest."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.config import ShimConfig
from shim.pod_networks import PodNetworks
from vmsandbox.errors import InvalidArgument, VmSandboxError
from vmsandbox.network import NamespaceOptions, Route
from vmsandbox.pod import PodMeta

pytestmark = [pytest.mark.integration]
SID = "a1" * 32
META = PodMeta(name="p", namespace="n", uid="u", attempt=0)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def namespace() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    name = f"vmst-{uuid.uuid4().hex[:8]}"
    peer = f"vp{uuid.uuid4().hex[:8]}"
    ip("netns", "add", name)
    try:
        ip("link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("-n", name, "addr", "add", "10.230.0.5/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "route", "add", "default", "via", "10.230.0.1")
        yield Path("/run/netns") / name
    finally:
        subprocess.run(["ip", "link", "del", peer], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def networks(tmp_path: Path) -> PodNetworks:
    return PodNetworks(ShimConfig(state_dir=str(tmp_path), pod_network="cni", cni_conf_dir=str(tmp_path / "none")))


def macvtaps() -> set[str]:
    return {p.name for p in Path("/sys/class/net").iterdir() if p.name == f"vmt{SID[:12]}"}


def test_the_guest_gets_the_given_namespaces_address_and_leaves_it_as_it_was(tmp_path: Path, namespace: Path) -> None:
    nets = networks(tmp_path)
    att = nets.attach(SID, META, NamespaceOptions(), (), {}, str(namespace))
    try:
        assert att.network.ips == ("10.230.0.5",)
        assert att.network.nic is not None
        assert att.network.nic.addresses == ("10.230.0.5/24",)
        assert att.network.nic.routes == (Route("0.0.0.0/0", "10.230.0.1"),)
        assert att.interface is not None and att.interface.target_dev == f"vmt{SID[:12]}"
        assert macvtaps() == {f"vmt{SID[:12]}"}
    finally:
        nets.detach(SID)
        nets.remove(SID)
    assert macvtaps() == set() and namespace.exists()
    out = subprocess.run(["ip", "-n", namespace.name, "-br", "addr", "show", "eth0"], capture_output=True, text=True)
    assert "10.230.0.5/24" in out.stdout  # containerd's CNI attachment is containerd's to delete
    assert not (tmp_path / "network" / f"{SID}.json").exists()


def test_not_a_namespace_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(InvalidArgument, match="not a network namespace"):
        networks(tmp_path).attach(SID, META, NamespaceOptions(), (), {}, str(plain))


def test_a_namespace_without_eth0_leaves_nothing(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    name = f"vmst-{uuid.uuid4().hex[:8]}"
    ip("netns", "add", name)
    try:
        with pytest.raises(VmSandboxError, match="eth0"):
            networks(tmp_path).attach(SID, META, NamespaceOptions(), (), {}, f"/run/netns/{name}")
        assert macvtaps() == set() and not (tmp_path / "network" / f"{SID}.json").exists()
    finally:
        ip("netns", "del", name)
