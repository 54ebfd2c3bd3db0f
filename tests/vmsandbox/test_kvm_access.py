"""Whether libvirt's QEMU user can open /dev/kvm (vmsandbox.kvm_access), and the adapter that reads
the device and the account (vmsandbox.adapters.host_checks) on real files this test creates."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.adapters.host_checks import host_warnings, qemu_user, read_account, read_device
from vmsandbox.kvm_access import (
    DEFAULT_QEMU_USER,
    Account,
    DeviceNode,
    can_read_write,
    checks_local_daemon,
    kvm_access_problem,
    qemu_conf_user,
)

QEMU = Account(name="libvirt-qemu", uid=999, gid=995)
QEMU_IN_KVM = Account(name="libvirt-qemu", uid=999, gid=995, groups=frozenset({995, 994}))


@pytest.mark.parametrize(
    ("device", "account", "ok"),
    [
        # the measured bad host: no udev, root:root 0600, no kvm group
        (DeviceNode(0, 0, 0o600), QEMU, False),
        (DeviceNode(0, 0, 0o600), QEMU_IN_KVM, False),
        # the fix: root:kvm 0660 with the user in kvm
        (DeviceNode(0, 994, 0o660), QEMU_IN_KVM, True),
        (DeviceNode(0, 994, 0o660), QEMU, False),  # group right, membership missing
        (DeviceNode(0, 994, 0o600), QEMU_IN_KVM, False),  # membership right, mode missing
        (DeviceNode(0, 994, 0o640), QEMU_IN_KVM, False),  # read is not enough
        (DeviceNode(0, 995, 0o660), QEMU, True),  # the user's primary group
        (DeviceNode(0, 0, 0o666), QEMU, True),  # world read-write (some distributions)
        (DeviceNode(999, 0, 0o600), QEMU, True),  # owned by the user
        (DeviceNode(999, 994, 0o066), QEMU_IN_KVM, False),  # owner bits win even when the group's allow
        (DeviceNode(0, 0, 0o600), Account("root", 0, 0), True),  # qemu.conf user = "root"
    ],
)
def test_can_read_write(device: DeviceNode, account: Account, ok: bool) -> None:
    assert can_read_write(device, account) is ok
    problem = kvm_access_problem(device, account)
    assert (problem is None) is ok


def test_problem_names_cause_cost_and_fix() -> None:
    problem = kvm_access_problem(DeviceNode(0, 0, 0o600, owner="root", group="root"), QEMU)
    assert problem is not None
    assert "'libvirt-qemu' cannot open /dev/kvm (root:root 0600)" in problem
    assert "probes QEMU again on every domain definition" in problem
    assert "scripts/setup-host.sh" in problem
    assert "usermod -aG kvm libvirt-qemu" in problem and "chmod 0660 /dev/kvm" in problem


@pytest.mark.parametrize("device", [None, DeviceNode(0, 0, 0o600)])
def test_no_device_or_no_account_is_not_this_problem(device: DeviceNode | None) -> None:
    assert kvm_access_problem(None, QEMU) is None
    assert kvm_access_problem(device, None) is None


@given(
    mode=st.integers(0, 0o777),
    dev_uid=st.sampled_from([0, 999, 1000]),
    dev_gid=st.sampled_from([0, 994, 995]),
    groups=st.frozensets(st.sampled_from([0, 994, 995, 1000])),
)
def test_more_permission_never_hurts(mode: int, dev_uid: int, dev_gid: int, groups: frozenset[int]) -> None:
    account = Account("u", 999, 995, groups)
    if can_read_write(DeviceNode(dev_uid, dev_gid, mode), account):
        for extra in (0o006, 0o060, 0o600):
            assert can_read_write(DeviceNode(dev_uid, dev_gid, mode | extra), account)


@pytest.mark.parametrize(
    ("uri", "local"),
    [
        ("qemu:///system", True),
        ("qemu+unix:///system", True),
        ("qemu:///system?socket=/run/libvirt/libvirt-sock", True),
        ("qemu:///session", False),
        ("qemu:///embed?root=/tmp/x", False),
        ("qemu+ssh://node2/system", False),
        ("test:///default", False),
    ],
)
def test_checks_local_daemon(uri: str, local: bool) -> None:
    assert checks_local_daemon(uri) is local


@pytest.mark.parametrize(
    ("conf", "user"),
    [
        ("", DEFAULT_QEMU_USER),
        ('#user = "root"\n', DEFAULT_QEMU_USER),
        ('user = "root"\n', "root"),
        ('user = "qemu"\nuser = "+107"  # last wins\n', "+107"),
        ('  user="nobody"\ngroup = "kvm"\n', "nobody"),
    ],
)
def test_qemu_conf_user(conf: str, user: str) -> None:
    assert qemu_conf_user(conf) == user


# -- the adapter, on real files -----------------------------------------------------------------


def test_read_device_of_a_real_file(tmp_path: Path) -> None:
    node = tmp_path / "kvm"
    node.write_text("")
    os.chmod(node, 0o640)
    st = node.stat()
    dev = read_device(str(node))
    assert dev is not None
    assert (dev.uid, dev.gid, dev.mode) == (st.st_uid, st.st_gid, 0o640)
    assert dev.owner == pwd.getpwuid(st.st_uid).pw_name
    assert read_device(str(tmp_path / "absent")) is None


def test_read_account_matches_the_account_database() -> None:
    me = pwd.getpwuid(os.getuid())
    account = read_account(me.pw_name)
    assert account is not None
    assert (account.uid, account.gid) == (me.pw_uid, me.pw_gid)
    assert me.pw_gid in account.groups
    assert {g.gr_gid for g in grp.getgrall() if me.pw_name in g.gr_mem} <= account.groups
    assert read_account(f"+{me.pw_uid}") == account
    assert read_account("no-such-user-vmsandbox") is None


def test_qemu_user_from_a_conf_file(tmp_path: Path) -> None:
    conf = tmp_path / "qemu.conf"
    conf.write_text('user = "root"\n')
    assert qemu_user(str(conf)) == "root"
    assert qemu_user(str(tmp_path / "absent.conf")) == DEFAULT_QEMU_USER


def test_host_warnings_on_a_device_the_user_cannot_open(tmp_path: Path) -> None:
    """A nobody-like user and a 0600 file owned by someone else: the warning; 0666: none."""
    me = pwd.getpwuid(os.getuid())
    other = next((p for p in pwd.getpwall() if p.pw_uid not in (0, me.pw_uid)), None)
    if other is None:
        pytest.skip("needs a second account in /etc/passwd")
    node = tmp_path / "kvm"
    node.write_text("")
    os.chmod(node, 0o600)
    conf = tmp_path / "qemu.conf"
    conf.write_text(f'user = "{other.pw_name}"\n')
    if node.stat().st_gid in os.getgrouplist(other.pw_name, other.pw_gid) or node.stat().st_uid == other.pw_uid:
        pytest.skip("the second account owns the test file")
    warnings = host_warnings("qemu:///system", device=str(node), conf_path=str(conf))
    assert len(warnings) == 1 and f"{other.pw_name!r} cannot open /dev/kvm" in warnings[0]
    assert host_warnings("qemu:///session", device=str(node), conf_path=str(conf)) == []
    os.chmod(node, 0o666)
    assert host_warnings("qemu:///system", device=str(node), conf_path=str(conf)) == []
