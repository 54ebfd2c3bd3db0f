"""The guest image (images/build.sh) booted with a plain qemu-system-x86_64 under TCG: the /init
agent greets on virtio-serial port io.vmsandbox.agent.0 and answers requests
(vmsandbox.adapters.guest_channel on the host side).

The image directory comes from $VMSANDBOX_IMAGE_DIR (default /var/lib/vmsandbox/images/default);
build it with `images/build.sh DIR`."""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from vmsandbox import agent_protocol
from vmsandbox.adapters.guest_channel import GuestChannel, GuestRequestFailed, wait_for_hello
from vmsandbox.agent_protocol import (
    CHANNEL_NAME,
    Ack,
    Hello,
    HugePages,
    Message,
    Request,
    Response,
    decode,
    encode,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

IMAGE_DIR = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default"))
QEMU = shutil.which("qemu-system-x86_64")
# quiet: the serial console costs time under TCG; cryptomgr.notests: skips the kernel's crypto
# self-tests (~0.35 s under TCG); panic=-1 + -no-reboot: a guest panic ends QEMU at once.
CMDLINE = "console=ttyS0 quiet panic=-1 cryptomgr.notests hugepagesz=2M hugepages=8"
VCPUS = 2
MEM_MIB = 256
BOOT_TIMEOUT_S = 60.0


def _image_or_skip() -> dict[str, object]:
    if QEMU is None:
        pytest.skip("qemu-system-x86_64 not installed (apt-get install qemu-system-x86)")
    missing = [n for n in ("vmlinux", "initramfs.img", "manifest.json") if not (IMAGE_DIR / n).is_file()]
    if missing:
        pytest.skip(f"guest image not built in {IMAGE_DIR} (missing {', '.join(missing)}): run images/build.sh")
    manifest: dict[str, object] = json.loads((IMAGE_DIR / "manifest.json").read_text())
    return manifest


@dataclass
class Guest:
    proc: subprocess.Popen[bytes]
    socket_path: str
    console: Path

    def console_tail(self) -> str:
        return self.console.read_text(errors="replace")[-3000:] if self.console.exists() else ""


@contextmanager
def booted_guest(tmp: Path, qemu_args: tuple[str, ...] = (), cmdline: str = "") -> Iterator[Guest]:
    """QEMU running the image (q35, TCG), with ``qemu_args`` and ``cmdline`` appended to the kernel's;
    killed on exit whatever happened."""
    assert QEMU is not None
    sock = str(tmp / "agent.sock")
    console = tmp / "console.log"
    argv = [
        QEMU, "-accel", "tcg", "-machine", "q35", "-nographic", "-nodefaults", "-no-user-config",
        "-no-reboot", "-serial", "stdio",
        "-kernel", str(IMAGE_DIR / "vmlinux"), "-initrd", str(IMAGE_DIR / "initramfs.img"),
        "-append", f"{CMDLINE} {cmdline}".strip(), "-smp", str(VCPUS), "-m", str(MEM_MIB),
        "-chardev", f"socket,id=agent,path={sock},server=on,wait=off",
        "-device", "virtio-serial-pci",
        "-device", f"virtserialport,chardev=agent,name={CHANNEL_NAME}",
        *qemu_args,
    ]  # fmt: skip
    with console.open("wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    guest = Guest(proc, sock, console)
    try:
        yield guest
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def manifest() -> dict[str, object]:
    return _image_or_skip()


@pytest.fixture(scope="module")
def guest(manifest: dict[str, object], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guest]:
    with booted_guest(tmp_path_factory.mktemp("guest")) as g:
        yield g


@pytest.fixture
def channel(guest: Guest) -> Iterator[GuestChannel]:
    try:
        ch = GuestChannel.open(guest.socket_path, BOOT_TIMEOUT_S)
    except Exception as e:
        pytest.fail(f"{e}\n--- guest console ---\n{guest.console_tail()}")
    with ch:
        yield ch


def test_hello_describes_the_guest(channel: GuestChannel, manifest: dict[str, object]) -> None:
    report = channel.report
    assert report.agent.startswith("vmsandbox-agent/")
    assert report.protocol == agent_protocol.VERSION
    assert report.kernel == manifest["kernel_release"]
    assert report.vcpus == VCPUS
    # 256 MiB minus what the kernel keeps for itself
    assert 150 * 1024 < report.mem_total_kib <= MEM_MIB * 1024
    assert report.hugepages[2048] == HugePages(total=8, free=8)
    assert report.cmdline.split() == CMDLINE.split()
    assert 0 < report.boot_ms < BOOT_TIMEOUT_S * 1000
    assert report.errors == ()


def test_ping_and_report(channel: GuestChannel) -> None:
    assert channel.request("ping", timeout_s=10) == {}
    fresh = channel.report_now(timeout_s=10)
    assert fresh.vcpus == VCPUS
    assert fresh.boot_ms >= channel.report.boot_ms


def test_unknown_op_is_refused_and_the_agent_survives(channel: GuestChannel) -> None:
    with pytest.raises(GuestRequestFailed, match="unknown op: dance"):
        channel.request("dance", timeout_s=10)
    assert channel.request("ping", timeout_s=10) == {}


def read_skipping_hellos(f: io.BufferedIOBase) -> Message:
    """The next message that is not a hello (a guest that saw the last host leave greets again)."""
    while isinstance(msg := decode(f.readline()), Hello):
        pass
    return msg


def test_unparsable_line_gets_an_error_response(guest: Guest) -> None:
    wait_for_hello(guest.socket_path, BOOT_TIMEOUT_S)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(guest.socket_path)
        s.settimeout(10)
        f = s.makefile("rwb")
        f.write(b"this is not json\n" + encode(Request(id="after", op="ping")))
        f.flush()
        first = read_skipping_hellos(f)
        assert isinstance(first, Response) and first.id is None and not first.ok
        assert "unparsable" in first.error
        assert read_skipping_hellos(f) == Response(id="after", ok=True, body={})


def test_hosts_can_come_and_go(guest: Guest) -> None:
    """Each new host gets the guest's report, however soon it connects after the last one left."""
    for pause_s in (0, 0, 1.5, 0):
        time.sleep(pause_s)
        with GuestChannel.open(guest.socket_path, 10) as ch:
            assert ch.report.vcpus == VCPUS
            assert ch.request("ping", timeout_s=10) == {}


def test_a_host_that_comes_back_is_answered_without_a_poll(guest: Guest) -> None:
    """The agent waits for the port's SIGIO, not a 100 ms nap, when no host is there: a host that
    comes back is answered within a round trip, however long it was away (pauses chosen so that
    no two meet a polling agent in the same phase of its naps)."""
    wait_for_hello(guest.socket_path, BOOT_TIMEOUT_S)
    late = []  # the first answer's time beyond a round trip on the open channel (the host's load)
    for i in range(9):
        time.sleep(0.3 + 0.037 * i)
        start = time.monotonic()
        with GuestChannel.open(guest.socket_path, 10) as ch:
            first = time.monotonic() - start
            start = time.monotonic()
            assert ch.request("ping", timeout_s=10) == {}
            late.append(first - (time.monotonic() - start))
    assert "is polled" not in guest.console_tail()  # SIGIO was armed on the port
    # a polling agent answers 0-100 ms late, 50 ms at the median
    assert sorted(late)[len(late) // 2] < 0.025, [round(t * 1000, 1) for t in late]


def test_fresh_guest_greets_until_acked_then_powers_off(manifest: dict[str, object], tmp_path: Path) -> None:
    with booted_guest(tmp_path) as g, socket.socket(socket.AF_UNIX) as s:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            try:
                s.connect(g.socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.monotonic() < deadline, g.console_tail()
                time.sleep(0.01)
        s.settimeout(BOOT_TIMEOUT_S)
        f = s.makefile("rwb")
        arrivals = []
        for _ in range(3):
            assert isinstance(decode(f.readline()), Hello), g.console_tail()
            arrivals.append(time.monotonic())
            s.settimeout(10)
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert all(0.5 < gap < 3.0 for gap in gaps), gaps
        f.write(encode(Ack()) + encode(Request(id="bye", op="poweroff")))
        f.flush()
        assert read_skipping_hellos(f) == Response(id="bye", ok=True, body={})
        assert g.proc.wait(timeout=20) == 0, g.console_tail()


def test_claimed_nics_are_renamed_and_addressed_by_mac(manifest: dict[str, object], tmp_path: Path) -> None:
    """/init gives each NIC of ``vmsandbox.xnic=MAC,NAME,CIDR...`` (vmsandbox.dra.claimed_nic_args)
    its name and addresses and brings it up, whatever name the kernel gave it; the agent reports them."""
    first, second = "02:00:00:00:0a:01", "02:00:00:00:0a:02"
    nics = (
        "-netdev", "user,id=n1,restrict=on", "-device", f"virtio-net-pci,netdev=n1,mac={first}",
        "-netdev", "user,id=n2,restrict=on", "-device", f"virtio-net-pci,netdev=n2,mac={second}",
    )  # fmt: skip
    # the first gets the name the kernel gives the second (eth1): renamed in order, each by its MAC
    cmdline = f"vmsandbox.xnic={second},lan0,192.168.50.7/24 vmsandbox.xnic={first},fast1,10.9.0.7/16,fd09::7/64"
    with booted_guest(tmp_path, nics, cmdline) as guest:
        try:
            ch = GuestChannel.open(guest.socket_path, BOOT_TIMEOUT_S)
        except Exception as e:
            pytest.fail(f"{e}\n--- guest console ---\n{guest.console_tail()}")
        with ch:
            report = ch.report
    assert not [e for e in report.errors if e.startswith("network:")], report.errors
    got = {n.mac: n for n in report.nics}
    assert (got[second].name, got[second].up, "192.168.50.7/24" in got[second].addresses) == ("lan0", True, True)
    assert (got[first].name, got[first].up) == ("fast1", True)
    assert {"10.9.0.7/16", "fd09::7/64"} <= set(got[first].addresses), got[first]
