"""Host set-up checks the shim reports at start and in CRI Status: reads /dev/kvm's owner and mode,
libvirt's qemu.conf and the account database; the decisions are in ``vmsandbox.kvm_access``."""

from __future__ import annotations

import grp
import os
import pwd

from vmsandbox.kvm_access import (
    KVM_DEVICE,
    Account,
    DeviceNode,
    checks_local_daemon,
    kvm_access_problem,
    qemu_conf_user,
)

QEMU_CONF = "/etc/libvirt/qemu.conf"


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return ""


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def read_device(path: str = KVM_DEVICE) -> DeviceNode | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    owner, group = _user_name(st.st_uid), _group_name(st.st_gid)
    return DeviceNode(uid=st.st_uid, gid=st.st_gid, mode=st.st_mode & 0o7777, owner=owner, group=group)


def read_account(name: str) -> Account | None:
    """The account as the kernel would see it after a fresh login (``initgroups``)."""
    try:
        by_uid = name.startswith("+") and name[1:].isdigit()  # qemu.conf allows "+UID"
        pw = pwd.getpwuid(int(name[1:])) if by_uid else pwd.getpwnam(name)
    except KeyError:
        return None
    groups = frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
    return Account(name=pw.pw_name, uid=pw.pw_uid, gid=pw.pw_gid, groups=groups)


def qemu_user(conf_path: str = QEMU_CONF) -> str:
    try:
        with open(conf_path, encoding="utf-8", errors="replace") as f:
            return qemu_conf_user(f.read())
    except FileNotFoundError:
        return qemu_conf_user("")


def host_warnings(libvirt_uri: str, *, device: str = KVM_DEVICE, conf_path: str = QEMU_CONF) -> list[str]:
    """Problems in this host's set-up that cost every pod, one sentence each (empty when none)."""
    if not checks_local_daemon(libvirt_uri):
        return []
    problem = kvm_access_problem(read_device(device), read_account(qemu_user(conf_path)))
    return [problem] if problem else []
