"""Network namespaces and the pod's macvtap, with iproute2 and util-linux.

A pod's namespace is a file bind-mounted over ``/proc/<pid>/ns/net`` (``unshare --net=FILE``), so
it outlives every process and CNI plugins can enter it by path. The guest's NIC is a macvtap in
passthru mode on the namespace's ``eth0``, made inside the namespace and then moved to the shim's
own namespace, where libvirt opens it (``/dev/tap<ifindex>``). Deleting ``eth0`` (CNI DEL) deletes
the macvtap with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
from pathlib import Path

from vmsandbox.errors import InfrastructureError

TIMEOUT_S = 30.0


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


def addresses(path: Path, ifname: str) -> list[dict[str, object]]:
    """``ip -j addr show dev ifname`` in the namespace: [{"local", "prefixlen", "family"}, ...]
    of its global addresses."""
    out = _run(["nsenter", f"--net={path}", "ip", "-j", "addr", "show", "dev", ifname], f"reading {ifname} in {path}")
    try:
        (info,) = json.loads(out)
        return [
            {"local": str(a["local"]), "prefixlen": int(a["prefixlen"]), "family": str(a["family"])}
            for a in info.get("addr_info", [])
            if a.get("scope") == "global"
        ]
    except (ValueError, KeyError, TypeError):
        raise NetnsError(f"reading {ifname}'s addresses in {path}: unexpected output {out[:200]!r}") from None


def routes(path: Path) -> list[dict[str, object]]:
    """The namespace's IPv4 and IPv6 routes (``ip -j route show``): [{"dst", "gateway", "dev"}, ...]."""
    found: list[dict[str, object]] = []
    for family in ("-4", "-6"):
        out = _run(["nsenter", f"--net={path}", "ip", "-j", family, "route", "show"], f"reading routes in {path}")
        try:
            for r in json.loads(out or "[]"):
                found.append({k: str(r.get(k, "")) for k in ("dst", "gateway", "dev")})
        except (ValueError, TypeError, AttributeError):
            raise NetnsError(f"reading routes in {path}: unexpected output {out[:200]!r}") from None
    return found


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


_libc = ctypes.CDLL(None, use_errno=True)
NSFS_MAGIC = 0x6E736673


def is_netns(path: Path) -> bool:
    """Whether ``path`` is a namespace's bind mount (a file on nsfs), not reached through a symlink."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    buf = _StatFs()
    if _libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        return False
    return bool(buf.f_type == NSFS_MAGIC)
