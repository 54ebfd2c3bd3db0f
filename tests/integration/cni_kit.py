"""A CNI set-up of the tests' own: a configuration directory with a bridge network (Debian's
containernetworking-plugins from /usr/lib/cni: bridge, host-local, portmap) on a bridge and a
subnet only the tests use, host-local's allocations in a directory of the test, and a way to see
everything the network left on the host. The host's ``ip_forward`` (the bridge plugin's
``isGateway`` turns it on) is put back afterwards."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

PLUGIN_DIR = Path("/usr/lib/cni")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


@dataclass
class CniEnv:
    conf_dir: Path
    bin_dirs: list[str]
    netns_dir: Path
    ipam_dir: Path
    bridge: str
    subnet: str
    gateway: str

    def shim_config(self) -> dict[str, object]:
        return {
            "pod_network": "cni",
            "cni_conf_dir": str(self.conf_dir),
            "cni_bin_dirs": self.bin_dirs,
            "netns_dir": str(self.netns_dir),
        }

    def allocations(self) -> list[str]:
        """host-local's allocated addresses (its bookkeeping files are named after them)."""
        return sorted(p.name for p in self.ipam_dir.glob("*/*") if p.name[0].isdigit() and p.name.count(".") == 3)

    def bridge_ports(self) -> list[str]:
        brif = Path("/sys/class/net", self.bridge, "brif")
        return sorted(p.name for p in brif.iterdir()) if brif.is_dir() else []

    def leftovers(self) -> dict[str, list[str]]:
        return {
            "namespaces": sorted(p.name for p in self.netns_dir.iterdir()) if self.netns_dir.is_dir() else [],
            "allocations": self.allocations(),
            "bridge ports (veths)": self.bridge_ports(),
            "macvtaps": sorted(p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith("vmt")),
        }


def require_cni() -> None:
    missing = [p for p in ("bridge", "host-local", "portmap", "loopback") if not (PLUGIN_DIR / p).is_file()]
    if missing:
        pytest.skip(f"CNI plugins {', '.join(missing)} not in {PLUGIN_DIR} (scripts/setup-host.sh installs them)")


def bridge_conflist(name: str, bridge: str, subnet: str, gateway: str, ipam_dir: Path) -> dict[str, object]:
    return {
        "cniVersion": "1.0.0",
        "name": name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(ipam_dir),
                    "ranges": [[{"subnet": subnet, "gateway": gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


@contextmanager
def cni_env(tmp: Path, *, bridge: str = "vmsbr-test0", subnet: str = "10.231.0.0/24") -> Iterator[CniEnv]:
    require_cni()
    gateway = subnet.rsplit(".", 1)[0] + ".1"
    env = CniEnv(
        conf_dir=tmp / "net.d",
        bin_dirs=[str(tmp / "bin"), str(PLUGIN_DIR)],
        netns_dir=tmp / "netns",
        ipam_dir=tmp / "ipam",
        bridge=bridge,
        subnet=subnet,
        gateway=gateway,
    )
    env.conf_dir.mkdir()
    (tmp / "bin").mkdir()
    (env.conf_dir / "10-test.conflist").write_text(
        json.dumps(bridge_conflist("vmsandbox-test", bridge, subnet, gateway, env.ipam_dir))
    )
    forward = IP_FORWARD.read_text()
    try:
        yield env
    finally:
        IP_FORWARD.write_text(forward)
        subprocess.run(["ip", "link", "del", "dev", bridge], capture_output=True, check=False)
