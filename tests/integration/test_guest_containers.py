"""Containers run by the guest agent with crun inside a real guest (QEMU, TCG), their root file
system an overlay of a tree shared from the host over virtio-9p and a writable layer in the guest.

The guest image comes from $VMSANDBOX_IMAGE_DIR (default /var/lib/vmsandbox/images/default,
built by images/build.sh); the container tree is built here from busybox-static (installed by
scripts/setup-host.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.qemu_direct import DirectGuest, qemu_argv
from vmsandbox.adapters import agent_streams
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.adapters.guest_channel import GuestRequestFailed
from vmsandbox.agent_protocol import VERSION
from vmsandbox.oci_spec import ContainerRequest, ImageConfig, Resources, UserIds, build_spec

pytestmark = [pytest.mark.slow, pytest.mark.integration]

IMAGE_DIR = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default"))
BOOT_TIMEOUT_S = 120.0
MEM_MIB = 256
TREE = "images/busybox/rootfs"
LOWER = f"shared/{TREE}"
MiB = 1 << 20


def _busybox_tree(root: Path) -> None:
    busybox = shutil.which("busybox")
    assert busybox is not None, "busybox-static is installed by scripts/setup-host.sh"
    for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "data"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, root / "bin/busybox")
    for applet in ("sh", "echo", "cat", "sleep", "head", "dd", "ls", "true", "trap", "id", "printf"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc/passwd").write_text("root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nnobody:x:65534:\n")
    (root / "data/original").write_text("from the image\n")


class Guest:
    def __init__(self, proc: subprocess.Popen[bytes], sock: str, shared: Path, console: Path) -> None:
        self.proc = proc
        self.sock = sock
        self.shared = shared
        self.console = console

    def console_tail(self) -> str:
        return self.console.read_text(errors="replace")[-3000:] if self.console.exists() else ""


@pytest.fixture(scope="module")
def guest() -> Iterator[Guest]:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 not installed")
    if not (IMAGE_DIR / "initramfs.img").is_file():
        pytest.skip(f"no guest image in {IMAGE_DIR}: run images/build.sh")
    with tempfile.TemporaryDirectory(prefix="vmsandbox-gc-") as tmp:
        shared = Path(tmp) / "shared"
        _busybox_tree(shared / TREE)
        (shared / "containers").mkdir()
        sock = os.path.join(tmp, "agent.sock")
        console = Path(tmp) / "console.log"
        argv = qemu_argv(
            DirectGuest.from_image(IMAGE_DIR, vcpus=2, mem_mib=MEM_MIB),
            sock,
            console_path=str(console),
            shared_dir=str(shared),
        )
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield Guest(proc, sock, shared, console)
        finally:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def agent(guest: Guest) -> Iterator[AgentClient]:
    try:
        client = AgentClient.open(guest.sock, BOOT_TIMEOUT_S)
    except Exception as e:
        pytest.fail(f"{e}\n--- console ---\n{guest.console_tail()}")
    with client:
        yield client


def _spec(argv: tuple[str, ...], **kw: object) -> dict[str, object]:
    request = ContainerRequest(command=argv, **kw)  # type: ignore[arg-type]
    return build_spec(request, ImageConfig(), UserIds(0, 0))


class _Log:
    """A container's CRI log, read from its agent (``log_read``) as it grows."""

    def __init__(self, agent: AgentClient, cid: str) -> None:
        self.agent, self.cid = agent, cid
        self.offset = 0
        self.text = b""

    def read(self, wait_s: float = 0) -> bytes:
        while True:
            chunk = self.agent.log_read(self.cid, self.offset, 1 << 16, wait_s)
            assert chunk.offset == self.offset
            self.offset += len(chunk.data)
            self.text += chunk.data
            if not chunk.data or chunk.eof:
                return self.text
            wait_s = 0


def _create(agent: AgentClient, guest: Guest, cid: str, argv: tuple[str, ...], **kw: object) -> _Log:
    (guest.shared / "containers" / cid).mkdir()
    agent.create(cid, lower=LOWER, spec=_spec(argv, **kw))
    return _Log(agent, cid)


def _log_lines(log: _Log) -> list[tuple[str, str, str]]:
    """(stream, tag, text) of each CRI log line."""
    out = []
    for line in log.read().decode().splitlines():
        stamp, stream, tag, text = line.split(" ", 3)
        assert stamp.endswith("Z") and "T" in stamp, line
        out.append((stream, tag, text))
    return out


def test_agent_speaks_this_hosts_protocol(agent: AgentClient) -> None:
    assert agent.report.protocol == VERSION
    assert agent.report.agent.startswith("vmsandbox-agent/")
    assert agent.report.errors == ()


def test_exit_code_and_logs(agent: AgentClient, guest: Guest) -> None:
    log = _create(agent, guest, "exit3", ("sh", "-c", "echo hello; echo oops >&2; printf partial; exit 3"))
    assert agent.status("exit3").state == "created"
    agent.start("exit3")
    st = agent.wait("exit3", timeout_s=60)
    assert (st.state, st.exit_code, st.signal, st.oom_killed) == ("exited", 3, 0, False)
    assert st.started_at_ns <= st.finished_at_ns
    lines = _log_lines(log)
    assert ("stdout", "F", "hello") in lines
    assert ("stderr", "F", "oops") in lines
    assert ("stdout", "P", "partial") in lines
    assert not (guest.shared / "containers" / "exit3" / "log").exists()  # nothing is written to the share
    assert agent.log_read("exit3", log.offset, 100, 0).eof
    agent.delete("exit3")
    with pytest.raises(GuestRequestFailed, match="no container"):
        agent.log_read("exit3", log.offset, 100, 0)
    with pytest.raises(GuestRequestFailed, match="no container"):
        agent.status("exit3")


def test_oom_killed_by_its_own_limit(agent: AgentClient, guest: Guest) -> None:
    _create(
        agent, guest, "oom", ("dd", "if=/dev/zero", "of=/dev/null", "bs=96M", "count=1"),
        resources=Resources(memory_limit_bytes=32 * MiB),
    )  # fmt: skip
    agent.start("oom")
    st = agent.wait("oom", timeout_s=120)
    assert st.state == "exited"
    assert st.oom_killed, st
    assert st.signal == 9
    agent.delete("oom")


def test_stop_with_sigterm_and_exec(agent: AgentClient, guest: Guest) -> None:
    log = _create(
        agent, guest, "long", ("sh", "-c", "trap 'echo bye; exit 0' TERM; echo up; while :; do sleep 0.2; done")
    )
    agent.start("long")
    deadline = time.monotonic() + 30
    while ("stdout", "F", "up") not in _log_lines(log):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    res = agent.exec("long", ["sh", "-c", "echo in; echo err >&2; exit 7"], timeout_s=30)
    assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (7, b"in\n", b"err\n", False)
    slow = agent.exec("long", ["sleep", "30"], timeout_s=1)
    assert slow.timed_out
    big = agent.exec("long", ["dd", "if=/dev/zero", "bs=1k", "count=64"], timeout_s=30, max_bytes=1000)
    assert len(big.stdout) == 1000 and big.dropped_bytes == 64 * 1024 - 1000
    stats = agent.stats("long")
    assert stats.cpu_usage_ns > 0 and stats.memory_working_set_bytes > 0 and stats.pids >= 1
    agent.kill("long", "TERM")
    st = agent.wait("long", timeout_s=30)
    assert (st.state, st.exit_code) == ("exited", 0)
    assert ("stdout", "F", "bye") in _log_lines(log)
    agent.delete("long")


def test_writes_stay_in_the_writable_layer(agent: AgentClient, guest: Guest) -> None:
    _create(
        agent, guest, "writer", ("sh", "-c", "echo changed > /data/original; echo new > /data/new; cat /data/original")
    )
    agent.start("writer")
    assert agent.wait("writer", timeout_s=60).exit_code == 0
    lower = guest.shared / TREE / "data"
    assert (lower / "original").read_text() == "from the image\n"
    assert not (lower / "new").exists()
    agent.delete("writer")


def test_containers_survive_a_reconnect(guest: Guest) -> None:
    with AgentClient.open(guest.sock, BOOT_TIMEOUT_S) as first:
        _create(first, guest, "survivor", ("sleep", "60"))
        first.start("survivor")
    with AgentClient.open(guest.sock, 30) as second:
        assert {c.id: c.state for c in second.list()}.get("survivor") == "running"
        second.kill("survivor", "KILL")
        st = second.wait("survivor", timeout_s=30)
        assert (st.state, st.signal) == ("exited", 9)
        second.delete("survivor")


def test_masked_and_read_only_paths(agent: AgentClient, guest: Guest) -> None:
    script = "cat /etc/group; echo --; echo x > /data/new 2>&1 || echo refused; echo y > /tmp/ok && echo written"
    log = _create(agent, guest, "masks", ("sh", "-c", script), masked_paths=("/etc/group",), readonly_paths=("/data",))
    agent.start("masks")
    st = agent.wait("masks", timeout_s=60)
    assert (st.state, st.exit_code) == ("exited", 0)
    # stdout and stderr are copied apart: their lines keep their order within a stream only
    out = [text for stream, _, text in _log_lines(log) if stream == "stdout"]
    err = [text for stream, _, text in _log_lines(log) if stream == "stderr"]
    assert out == ["--", "refused", "written"], out  # the masked file reads as empty
    assert len(err) == 1 and err[0].endswith("Read-only file system"), err
    agent.delete("masks")


def test_log_back_pressure_blocks_the_writer_not_the_guest(agent: AgentClient, guest: Guest) -> None:
    """A container writing far more than the agent holds waits for the host to take it: the
    agent's memory stays small, and once read, every line is there."""
    script = "i=0; while [ $i -lt 4000 ]; do printf '%04d %02000d\\n' $i 0; i=$((i+1)); done; echo done"
    log = _create(agent, guest, "flood", ("sh", "-c", script))
    agent.start("flood")
    time.sleep(8)
    assert agent.status("flood").state == "running"  # blocked on its full pipe
    rss = int(str(agent.request("stats", {"id": ""}, 30).get("agent_rss_bytes", 0)))
    assert 0 < rss < 16 * MiB, rss
    held = agent.log_read("flood", 0, 4 * MiB, 0)
    assert len(held.data) <= 512 * 1024  # one answer is bounded by the agent
    deadline = time.monotonic() + 120
    while not (text := log.read(1.0)).endswith(b"stdout F done\n"):
        assert time.monotonic() < deadline, len(text)
    lines = text.decode().splitlines()
    assert [int(line.split(" ", 4)[3]) for line in lines[:-1]] == list(range(4000))
    assert agent.wait("flood", timeout_s=30).exit_code == 0
    agent.delete("flood")


def test_a_terminal_nobody_reads_blocks_its_writer_not_the_guest(agent: AgentClient, guest: Guest) -> None:
    """A container with a terminal (tty) writing far more than the agent holds, with an attach
    session that never reads: the writer waits on the terminal, the agent's memory stays small,
    and once the host reads the log every line is there, as containerd writes it."""
    script = "tty; i=0; while [ $i -lt 4000 ]; do printf '%04d %02000d\\n' $i 0; i=$((i+1)); done; echo done"
    (guest.shared / "containers" / "tty-flood").mkdir()
    agent.create("tty-flood", lower=LOWER, spec=_spec(("sh", "-c", script)), tty=True)
    log = _Log(agent, "tty-flood")
    agent.start("tty-flood")
    session = agent_streams.attach_open(agent, "tty-flood")  # attached, never read
    time.sleep(8)
    assert agent.status("tty-flood").state == "running"  # blocked writing to its terminal
    rss = int(str(agent.request("stats", {"id": ""}, 30).get("agent_rss_bytes", 0)))
    assert 0 < rss < 16 * MiB, rss
    deadline = time.monotonic() + 120
    while not (text := log.read(1.0)).endswith(b" stdout F done\n"):
        assert time.monotonic() < deadline, len(text)
    records = [line.split(" ", 3) for line in text.decode().splitlines()]
    assert {stream for _, stream, _, _ in records} == {"stdout"}
    assert records[0][3] == "/dev/pts/0"
    assert [int(body.split(" ")[0]) for _, _, _, body in records[1:-1]] == list(range(4000))
    assert all(tag == "F" and not body.endswith("\r") for _, _, tag, body in records)
    assert agent.wait("tty-flood", timeout_s=30).exit_code == 0
    session.release()
    agent.delete("tty-flood")
