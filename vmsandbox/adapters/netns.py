"""Network namespaces and the pod's macvtap, with iproute2 and util-linux.

A pod's namespace is a file bind-mounted over ``/proc/<pid>/ns/net`` (``unshare --net=FILE``), so
it outlives every process and CNI plugins can enter it by path. The guest's NIC is a macvtap in
passthru mode on the namespace's ``eth0``, made inside the namespace and then moved to the shim's
own namespace, where libvirt opens it (``/dev/tap<ifindex>``). Deleting ``eth0`` (CNI DEL) deletes
the macvtap with it.

A namespace someone else made (``given``: containerd's, when it runs CNI itself) is checked to be
a network namespace file and held open while it is read (``read_network``, bounded) and its
``eth0`` gets the macvtap; the shim never deletes it. In such a namespace the shim also listens on
the loopback (``listen_in``, from a thread that enters it) and adds a nat rule there (``run_in``),
for the loopback forward of ``shim.loopback_forwards``.

An ordinary (runc) pod's claimed network devices (``shim.dra.runc_nics``) are made in such a
namespace too: a veth pair whose host end joins a bridge (``add_veth_into``), or a macvlan on a
host interface made straight into the namespace (``add_macvlan_into``), then addressed and brought
up there (``address_in``) and read back (``addresses_in``).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import stat
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vmsandbox.errors import InfrastructureError, InvalidArgument
from vmsandbox.given_netns import MAX_OUTPUT, check_path

TIMEOUT_S = 30.0
NS_GET_NSTYPE = 0xB703  # ioctl on a namespace file: its kind, as a CLONE_NEW* flag (linux/nsfs.h)
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_KINDS = {
    0x00020000: "mount",
    0x02000000: "cgroup",
    0x04000000: "uts",
    0x08000000: "ipc",
    0x10000000: "user",
    0x20000000: "pid",
    0x00000080: "time",
}


class NetnsError(InfrastructureError):
    pass


def _run(argv: list[str], what: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{what}: {exc}") from None
    if done.returncode != 0:
        raise NetnsError(f"{what}: {(done.stderr or done.stdout).strip()[:512]}")
    return done.stdout


def create(path: Path) -> None:
    """A new, empty network namespace held by the file ``path`` (its lo is brought up by CNI's
    loopback plugin, or here when the configuration has none)."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    path.touch(mode=0o444, exist_ok=False)
    try:
        _run(["unshare", f"--net={path}", "true"], f"creating network namespace {path}")
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _mounted_on(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def delete(path: Path) -> None:
    """Unmounts and removes the namespace file; nothing there is fine."""
    if _mounted_on(path):
        _run(["umount", "--lazy", str(path)], f"unmounting network namespace {path}")
    path.unlink(missing_ok=True)


def link(path: Path, ifname: str) -> tuple[str, int]:
    """(MAC, MTU) of ``ifname`` in the namespace ``path``."""
    out = _run(["nsenter", f"--net={path}", "ip", "-j", "link", "show", "dev", ifname], f"reading {ifname} in {path}")
    try:
        (info,) = json.loads(out)
        return str(info["address"]), int(info["mtu"])
    except (ValueError, KeyError, TypeError):
        raise NetnsError(f"reading {ifname} in {path}: unexpected output {out[:200]!r}") from None


def lo_up(path: Path) -> None:
    _run(["nsenter", f"--net={path}", "ip", "link", "set", "dev", "lo", "up"], f"bringing lo up in {path}")


def add_macvtap(path: Path, lower: str, name: str) -> None:
    """A passthru macvtap ``name`` on ``lower`` in the namespace, moved into this process's
    namespace and brought up."""
    inside = ["nsenter", f"--net={path}", "ip", "link"]
    _run([*inside, "add", "link", lower, "name", name, "type", "macvtap", "mode", "passthru"], f"adding {name}")
    try:
        _run([*inside, "set", "dev", name, "netns", str(os.getpid())], f"moving {name} out of {path}")
        _run(["ip", "link", "set", "dev", name, "up"], f"bringing {name} up")
    except BaseException:
        delete_link(name)
        subprocess.run([*inside, "del", "dev", name], capture_output=True, check=False, timeout=TIMEOUT_S)
        raise


def add_veth_into(path: Path, host: str, name: str, mac: str, bridge: str) -> None:
    """A veth pair: ``host`` in this namespace, a port of ``bridge``, up; its peer ``name`` (MAC
    ``mac``) made straight into the namespace ``path`` (iproute2 opens a netns argument with a '/'
    as a path). Deleting ``host`` deletes both ends."""
    _run(
        ["ip", "link", "add", host, "type", "veth", "peer", "name", name, "address", mac, "netns", str(path)],
        f"adding the veth pair {host}/{name} into {path}",
    )
    try:
        _run(["ip", "link", "set", "dev", host, "master", bridge, "up"], f"putting {host} on the bridge {bridge}")
    except BaseException:
        delete_link(host)
        raise


def add_macvlan_into(path: Path, lower: str, mode: str, name: str, mac: str) -> None:
    """A macvlan ``name`` (MAC ``mac``) on the host interface ``lower`` in ``mode``, made straight
    into the namespace ``path``; it goes with the namespace."""
    _run(
        ["ip", "link", "add", "link", lower, "name", name, "address", mac, "netns", str(path),
         "type", "macvlan", "mode", mode],
        f"adding the macvlan {name} on {lower} into {path}",
    )  # fmt: skip


def address_in(path: Path, name: str, cidrs: tuple[str, ...]) -> None:
    """``cidrs`` on the link ``name`` of the namespace ``path``, and the link up."""
    inside = ["nsenter", f"--net={path}", "ip"]
    for cidr in cidrs:
        _run([*inside, "addr", "add", cidr, "dev", name], f"adding {cidr} to {name} in {path}")
    _run([*inside, "link", "set", "dev", name, "up"], f"bringing {name} up in {path}")


def addresses_in(path: Path, name: str) -> str:
    """What ``ip -j addr show dev NAME`` prints in the namespace ``path`` (bounded)."""
    return _read_bounded(
        ["nsenter", f"--net={path}", "ip", "-j", "addr", "show", "dev", name], f"reading {name} in {path}"
    )


def delete_link_in(path: Path, name: str) -> None:
    """Deletes the link ``name`` of the namespace ``path``; an absent one is fine."""
    subprocess.run(
        ["nsenter", f"--net={path}", "ip", "link", "del", "dev", name],
        capture_output=True,
        check=False,
        timeout=TIMEOUT_S,
    )


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def delete_link(name: str) -> None:
    """Deletes the link ``name`` of this namespace; an absent one is fine."""
    if link_exists(name):
        done = subprocess.run(["ip", "link", "del", "dev", name], capture_output=True, text=True, check=False)
        if done.returncode != 0 and link_exists(name):
            raise NetnsError(f"deleting link {name}: {done.stderr.strip()[:512]}")


def exists(path: Path) -> bool:
    """Whether ``path`` holds a namespace (is mounted), not just a left-over file."""
    return _mounted_on(path)


def hold_given(path: str) -> int:
    """An open descriptor of the network namespace someone else made at ``path``, which names that
    namespace even should ``path`` be replaced meanwhile (the caller closes it). InvalidArgument
    naming ``path`` unless it is a namespace file (nsfs, bind-mounted as ``ip netns add`` and
    containerd do; not a symbolic link such as ``/proc/<pid>/ns/net``) of a network namespace other
    than the shim's own."""
    check_path(path)
    own = os.stat("/proc/self/ns/net")
    try:
        seen = os.lstat(path)
    except FileNotFoundError:
        raise InvalidArgument(f"network namespace {path!r}: no such file") from None
    except OSError as exc:
        raise InvalidArgument(f"network namespace {path!r}: {exc.strerror}") from None
    if stat.S_ISLNK(seen.st_mode):
        raise InvalidArgument(f"network namespace {path!r} is a symbolic link, not a namespace file")
    not_one = f"{path!r} is not a network namespace: not a namespace file (as the bind mount `ip netns add` makes)"
    if not stat.S_ISREG(seen.st_mode) or seen.st_dev != own.st_dev:  # every namespace file is on nsfs
        raise InvalidArgument(not_one)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidArgument(f"network namespace {path!r}: {exc.strerror}") from None
    try:
        held = os.fstat(fd)
        if (held.st_dev, held.st_ino) != (seen.st_dev, seen.st_ino):
            raise InvalidArgument(f"network namespace {path!r} changed while it was opened")
        try:
            kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError:
            raise InvalidArgument(not_one) from None
        if kind != CLONE_NEWNET:
            raise InvalidArgument(
                f"network namespace {path!r} is a {_KINDS.get(kind, hex(kind))} namespace, not a network namespace"
            )
        if held.st_ino == own.st_ino:
            raise InvalidArgument(
                f"network namespace {path!r} is the shim's own (the host's network): a pod needs one of its own"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def held_path(fd: int) -> Path:
    """A path naming the namespace the descriptor ``fd`` (``hold_given``'s) holds, for nsenter."""
    return Path(f"/proc/{os.getpid()}/fd/{fd}")


@contextmanager
def given(path: str) -> Iterator[Path]:
    """The network namespace someone else made at ``path`` (checked as ``hold_given`` checks it),
    held open while the block runs: yields a path (``held_path``) that names that namespace even
    should ``path`` be replaced meanwhile."""
    fd = hold_given(path)
    try:
        yield held_path(fd)
    finally:
        os.close(fd)


def listen_in(fd: int, address: str, backlog: int) -> socket.socket:
    """A TCP socket listening on ``address`` (IPv4), on a port the kernel chooses, in the network
    namespace the descriptor ``fd`` holds: made by a short-lived thread that enters that namespace
    (``setns`` changes only the calling thread's), so this process stays in its own. The socket
    belongs to that namespace for its life, whichever thread uses it."""
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def inside() -> None:
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns: {os.strerror(err)}")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.bind((address, 0))
                sock.listen(backlog)
            except BaseException:
                sock.close()
                raise
            made.append(sock)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=inside, name="netns-listen", daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    if made:
        return made[0]
    why = failed[0] if failed else f"no answer in {TIMEOUT_S:.0f} s"
    raise NetnsError(f"listening on {address} in network namespace {held_path(fd)}: {why}")


def run_in(fd: int, argv: list[str], what: str) -> str:
    """What ``argv`` prints, run in the network namespace the descriptor ``fd`` holds."""
    return _run(["nsenter", f"--net={held_path(fd)}", *argv], what)


def _read_bounded(argv: list[str], what: str) -> str:
    """What ``argv`` prints, at most MAX_OUTPUT bytes of it (more is an error), within TIMEOUT_S."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise NetnsError(f"{what}: {exc}") from None
    timer = threading.Timer(TIMEOUT_S, proc.kill)
    timer.start()
    with proc:  # closes the pipes and waits for the process (killed below when it is still running)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            out = proc.stdout.read(MAX_OUTPUT + 1)
            if len(out) > MAX_OUTPUT:
                raise NetnsError(f"{what}: more than {MAX_OUTPUT} bytes")
            err = proc.stderr.read(4096)
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
    if code < 0:
        raise NetnsError(f"{what}: killed after {TIMEOUT_S:.0f} s" if code == -9 else f"{what}: signal {-code}")
    if code != 0:
        raise NetnsError(f"{what}: {(err or out).decode(errors='replace').strip()[:512]}")
    return out.decode(errors="replace")


def read_network(path: Path) -> tuple[str, str, str]:
    """What ``ip -j`` prints in the namespace ``path``: its interfaces with their addresses, and its
    main table's IPv4 and IPv6 routes (parsed by ``vmsandbox.given_netns``)."""
    inside = ["nsenter", f"--net={path}", "ip", "-j"]
    return (
        _read_bounded([*inside, "addr", "show"], f"reading the addresses in {path}"),
        _read_bounded([*inside, "-4", "route", "show", "table", "main"], f"reading the IPv4 routes in {path}"),
        _read_bounded([*inside, "-6", "route", "show", "table", "main"], f"reading the IPv6 routes in {path}"),
    )
