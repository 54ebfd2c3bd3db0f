"""The guest side of the pod network, through libvirt with the domain the shim builds: a NIC
(QEMU's user-mode network here, which needs nothing on the host) whose MAC the kernel command line
names gets the addresses, routes and hostname; the agent's hello reports what the guest ended up
with; a NIC that is not there is reported as a boot error.

The image directory comes from $VMSANDBOX_IMAGE_DIR (default /var/lib/vmsandbox/images/default).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from vmsandbox.adapters.guest_channel import wait_for_hello
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.agent_protocol import GuestReport
from vmsandbox.domain import AGENT_CHANNEL, NetworkInterface, SandboxIdentity, build_domain
from vmsandbox.domain_xml import render
from vmsandbox.network import GuestNic, Route
from vmsandbox.profile import Profile
from vmsandbox.record_docs import shape_doc
from vmsandbox.sizing import LinuxResources, demand_from_linux, shape_for

pytestmark = [pytest.mark.slow, pytest.mark.integration]

IMAGE_DIR = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default"))
URI = "qemu:///system"
MAC = "52:54:00:6e:65:74"
SLIRP = GuestNic(MAC, ("10.0.2.15/24",), (Route("0.0.0.0/0", "10.0.2.2"),), mtu=1400)


@contextmanager
def guest(tmp: Path, nic: NetworkInterface | None, guest_nic: GuestNic | None, hostname: str) -> Iterator[GuestReport]:
    if not (IMAGE_DIR / "vmlinux").is_file():
        pytest.skip(f"guest image not built in {IMAGE_DIR}")
    profile = Profile(name="net", handler="net", cpu_policy="shared", page_size_bytes=4096)
    shape = shape_for(demand_from_linux(LinuxResources(), {}, profile), profile)
    sandbox_id = uuid.uuid4().hex * 2
    domain = build_domain(
        identity=SandboxIdentity(sandbox_id, "net-test", "default", "uid", 0, "net"),
        uuid=str(uuid.uuid4()),
        shape=shape,
        host_cpus=(),
        emulator_cpus=(),
        hugepage_nodes=(),
        accel="tcg",
        kernel=str(IMAGE_DIR / "vmlinux"),
        initrd=str(IMAGE_DIR / "initramfs.img"),
        machine="q35",
        extra_cmdline="",
        shape_json=json.dumps(shape_doc(shape)),
        console_log=str(tmp / "console.log"),
        interfaces=(nic,) if nic else (),
        guest_nic=guest_nic,
        hostname=hostname,
    )
    hv = Hypervisor(URI)
    hv.define(render(domain))
    try:
        hv.start(domain.name)
        yield wait_for_hello(hv.channel_path(domain.name, AGENT_CHANNEL), 90)
    finally:
        hv.destroy(domain.name)
        hv.teardown(domain.name)
        hv.close()


def test_the_guest_takes_the_addresses_routes_and_hostname_it_is_given(tmp_path: Path) -> None:
    with guest(tmp_path, NetworkInterface("user", MAC), SLIRP, "web-0.pods") as report:
        assert report.errors == ()
        assert report.hostname == "web-0.pods"
        (nic,) = [n for n in report.nics if n.mac == MAC]
        assert nic.up
        assert "10.0.2.15/24" in nic.addresses


def test_a_nic_the_guest_does_not_have_is_a_boot_error(tmp_path: Path) -> None:
    with guest(tmp_path, None, SLIRP, "") as report:
        assert report.nics == ()
        assert any(e.startswith("network: no NIC with MAC 52:54:00:6e:65:74") for e in report.errors), report.errors


def test_boot_cost_of_a_nic_is_reported(tmp_path: Path) -> None:
    """Not a timing assertion: prints the guest's own boot time with and without a NIC."""
    times = {}
    for label, nic, gn in (("none", None, None), ("nic", NetworkInterface("user", MAC), SLIRP)):
        (tmp_path / label).mkdir()
        started = time.monotonic()
        with guest(tmp_path / label, nic, gn, "") as report:
            assert report.errors == ()
            times[label] = {"guest_boot_ms": report.boot_ms, "to_hello_ms": int((time.monotonic() - started) * 1000)}
    print(json.dumps(times))
