"""Whether libvirt's QEMU user can open ``/dev/kvm``: the decision, over values read elsewhere.

libvirt (9.0) probes QEMU's capabilities as root, so KVM looks available to the probe, but it keeps
the cached capabilities only while the user QEMU runs as (``user`` in qemu.conf) can open
``/dev/kvm`` for reading and writing itself. When that user cannot, every capabilities lookup
discards the cache and probes QEMU again, about 10 s per domain definition, even for guests that
run under TCG. ``kvm_access_problem`` says so, with the fix, from the device's owner and mode and
the user's groups; ``vmsandbox.adapters.host_checks`` reads those values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KVM_DEVICE = "/dev/kvm"
# Debian builds libvirt with qemu_user=libvirt-qemu; qemu.conf's ``user`` overrides it.
DEFAULT_QEMU_USER = "libvirt-qemu"
KVM_GROUP = "kvm"

_R, _W = 0o4, 0o2


@dataclass(frozen=True)
class DeviceNode:
    """Owner, group and permission bits of a device file, with names for messages."""

    uid: int
    gid: int
    mode: int  # permission bits only (st_mode & 0o7777)
    owner: str = ""
    group: str = ""

    def describe(self) -> str:
        return f"{self.owner or self.uid}:{self.group or self.gid} {self.mode & 0o777:04o}"


@dataclass(frozen=True)
class Account:
    """A user as the kernel checks it: uid, primary gid and supplementary groups."""

    name: str
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()


def can_read_write(device: DeviceNode, account: Account) -> bool:
    """The kernel's owner/group/other permission check for read+write (ACLs aside); root always can."""
    if account.uid == 0:
        return True
    if account.uid == device.uid:
        bits = device.mode >> 6
    elif device.gid == account.gid or device.gid in account.groups:
        bits = device.mode >> 3
    else:
        bits = device.mode
    return bits & (_R | _W) == _R | _W


def checks_local_daemon(uri: str) -> bool:
    """True for URIs of the local system QEMU daemon (``qemu:///system``, ``qemu+unix:///system``):
    only there do this host's /dev/kvm and qemu.conf decide; session, embedded, test and remote
    connections are someone else's set-up."""
    m = re.fullmatch(r"qemu(\+unix)?://(/system)(\?.*)?", uri.strip())
    return m is not None


def qemu_conf_user(text: str) -> str:
    """The ``user = "..."`` setting of a qemu.conf (the last uncommented one), else the default."""
    user = DEFAULT_QEMU_USER
    for line in text.splitlines():
        m = re.fullmatch(r'\s*user\s*=\s*"([^"]*)"\s*(#.*)?', line)
        if m and m[1]:
            user = m[1]
    return user


def kvm_access_problem(device: DeviceNode | None, account: Account | None) -> str | None:
    """None when there is nothing to fix; else one sentence naming the cause, the cost and the fix.

    No device (no KVM at all) or no such account (libvirtd could not start QEMU anyway, and says
    so itself) are not this problem.
    """
    if device is None or account is None or can_read_write(device, account):
        return None
    return (
        f"libvirt's QEMU user {account.name!r} cannot open {KVM_DEVICE} ({device.describe()}), so libvirt "
        "distrusts its QEMU capabilities cache and probes QEMU again on every domain definition "
        f"(about 10 s per pod); fix: run scripts/setup-host.sh, or groupadd -r {KVM_GROUP}; "
        f"usermod -aG {KVM_GROUP} {account.name}; chgrp {KVM_GROUP} {KVM_DEVICE}; chmod 0660 {KVM_DEVICE}"
    )
