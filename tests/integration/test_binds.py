"""The bind mounts that share container volumes live (vmsandbox/adapters/binds.py), with real mounts:
a process in a mount namespace of its own (made with unshare, as libvirt makes QEMU's) stands in
for QEMU. What matters most: the host's files are shared both ways, read-only holds there, nothing
is mounted in the host's namespace (so the host can delete its directories while they are bound),
and deleting a sandbox's tree never reaches the host's files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vmsandbox.adapters import binds
from vmsandbox.errors import InfrastructureError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root"),
]


def inside(pid: int, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nsenter", "-t", str(pid), "-m", "sh", "-c", script], capture_output=True, text=True)


def test_a_bind_shares_the_host_files_both_ways_in_qemus_namespace_only(tmp_path: Path, qemu: int) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "data").write_text("from the host\n")
    target = tmp_path / "sandbox" / "shared" / "containers" / "c1" / "mounts" / "0"
    target.mkdir(parents=True)
    binds.bind(qemu, volume, target, readonly=False, beneath=tmp_path)
    assert inside(qemu, f"cat {target}/data").stdout == "from the host\n"
    assert inside(qemu, f"echo from the guest > {target}/written").returncode == 0
    assert (volume / "written").read_text() == "from the guest\n"
    assert binds.mounts_under(tmp_path) == []  # nothing in the host's namespace
    assert not list(target.iterdir())

    binds.unbind_all(qemu, tmp_path / "sandbox")
    assert inside(qemu, f"cat {target}/data").returncode != 0
    binds.remove_tree(tmp_path, "sandbox")
    assert not (tmp_path / "sandbox").exists()
    assert sorted(p.name for p in volume.iterdir()) == ["data", "written"]


@pytest.mark.parametrize("recursive", [False, True])
def test_read_only_covers_the_mounts_below_only_when_recursive(tmp_path: Path, qemu: int, recursive: bool) -> None:
    source = tmp_path / "source"
    (source / "tmpfs").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(source / "tmpfs")], check=True)
    try:
        target = tmp_path / "target"
        target.mkdir()
        binds.bind(qemu, source, target, readonly=True, recursive=recursive, beneath=tmp_path)
        assert inside(qemu, f"echo x > {target}/top").returncode != 0
        assert (inside(qemu, f"echo x > {target}/tmpfs/below").returncode == 0) is not recursive
        assert not (source / "top").exists()
        # the host may take its own mount away and delete the directory while it is bound
        subprocess.run(["umount", str(source / "tmpfs")], check=True)
        (source / "tmpfs").rmdir()
    finally:
        subprocess.run(["umount", str(source / "tmpfs")], capture_output=True)


@pytest.mark.parametrize(
    ("propagation", "seen"), [("private", False), ("host-to-container", True), ("bidirectional", True)]
)
def test_host_mounts_made_later_reach_the_guest_as_propagation_says(
    tmp_path: Path, qemu: int, propagation: str, seen: bool
) -> None:
    source = tmp_path / "source"
    (source / "later").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(source), str(source)], check=True)
    subprocess.run(["mount", "--make-rshared", str(source)], check=True)
    try:
        target = tmp_path / "target"
        target.mkdir()
        binds.bind(qemu, source, target, readonly=False, propagation=propagation, beneath=tmp_path)
        subprocess.run(["mount", "-t", "tmpfs", "none", str(source / "later")], check=True)
        (source / "later" / "flag").write_text("mounted after the bind\n")
        assert (inside(qemu, f"cat {target}/later/flag").returncode == 0) is seen
    finally:
        subprocess.run(["umount", "-R", str(source)], capture_output=True)


def test_file_binds_and_a_gone_qemu(tmp_path: Path, qemu: int) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")
    target = tmp_path / "log"
    target.touch()
    binds.bind(qemu, log, target, readonly=False, beneath=tmp_path)
    assert inside(qemu, f"echo finished > {target}").returncode == 0
    assert log.read_text() == "finished\n"
    binds.unbind_all(2**22 + 1, tmp_path)  # no such process: nothing to do


def test_remove_tree_refuses_to_delete_through_a_host_mount(tmp_path: Path) -> None:
    (tmp_path / "tree" / "m").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(tmp_path / "tree" / "m")], check=True)
    try:
        (tmp_path / "tree" / "m" / "precious").write_text("x")
        with pytest.raises(InfrastructureError, match="is mounted in it"):
            binds.remove_tree(tmp_path, "tree")
        assert (tmp_path / "tree" / "m" / "precious").exists()
    finally:
        subprocess.run(["umount", str(tmp_path / "tree" / "m")], check=True)


def test_bind_errors_name_the_paths(tmp_path: Path, qemu: int) -> None:
    with pytest.raises(InfrastructureError, match=r"bind .*missing onto .*No such file"):
        binds.bind(qemu, tmp_path / "missing", tmp_path / "t", readonly=False, beneath=tmp_path)
    with pytest.raises(InfrastructureError, match=r"QEMU .* is gone"):
        binds.bind(2**22 + 1, tmp_path, tmp_path / "t", readonly=False, beneath=tmp_path)
    with pytest.raises(InfrastructureError, match="not below"):
        binds.bind(qemu, tmp_path, "/etc", readonly=False, beneath=tmp_path / "share")


@pytest.mark.parametrize("kind", ["symlink", "symlinked-parent", "fifo"])
def test_bind_never_mounts_onto_what_a_guest_put_in_place_of_the_target(tmp_path: Path, qemu: int, kind: str) -> None:
    """The guest sees the target's directory and can swap the target (or a directory above it)
    for a symlink to a host path, or for a FIFO, before the bind is attached: nothing is mounted."""
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "secret").write_text("volume\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    share = tmp_path / "share"
    mounts = share / "containers" / "c1" / "mounts"
    mounts.mkdir(parents=True)
    target = mounts / "0"
    if kind == "symlink":
        target.symlink_to(elsewhere)
    elif kind == "symlinked-parent":
        (share / "containers" / "c1").rename(share / "moved")
        (share / "containers" / "c1").symlink_to(tmp_path)
        (tmp_path / "mounts").mkdir()
        (tmp_path / "mounts" / "0").mkdir()
    else:
        os.mkfifo(target)
    with pytest.raises(InfrastructureError, match=r"guest may have changed|neither"):
        binds.bind(qemu, volume, target, readonly=False, beneath=share)
    for place in (elsewhere, tmp_path / "mounts" / "0"):
        assert inside(qemu, f"cat {place}/secret").returncode != 0
    assert binds.mounts_under(tmp_path, inside(qemu, "cat /proc/self/mountinfo").stdout) == []


def test_a_mount_copied_into_a_bind_never_lands_on_what_a_guest_put_there(tmp_path: Path, qemu: int) -> None:
    """``bind_below`` resolves its place inside the volume without a symlink or ``..``: a volume
    directory the guest swapped for a symlink to a host path gets nothing mounted, anywhere."""
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "evil").symlink_to("/etc")
    (tmp_path / "later").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "none", str(tmp_path / "later")], check=True)
    try:
        shared = tmp_path / "shared"
        target = shared / "mounts" / "0"
        target.mkdir(parents=True)
        binds.bind(qemu, volume, target, readonly=False, beneath=shared, root_as=2_000_000_321)
        before = Path(f"/proc/{qemu}/mountinfo").read_text().count("\n")
        for rel in ("evil", "../../..", "missing"):
            with pytest.raises(InfrastructureError, match=r"guest may have changed the target|neither a directory"):
                binds.bind_below(
                    qemu, tmp_path / "later", target, rel, beneath=shared, root_as=2_000_000_321, readonly=False
                )
        assert Path(f"/proc/{qemu}/mountinfo").read_text().count("\n") == before
        binds.bind_below(qemu, tmp_path / "later", target, ".", beneath=shared, root_as=2_000_000_321, readonly=False)
        assert inside(qemu, f"stat -c %u {target}").stdout.strip() == "2000000321"
        binds.unbind_below(qemu, target, ".", beneath=shared)
        assert Path(f"/proc/{qemu}/mountinfo").read_text().count("\n") == before
    finally:
        subprocess.run(["umount", str(tmp_path / "later")], check=True)


def mount_options(pid: int, point: Path) -> set[str]:
    """The per-mount options of the topmost mount at ``point`` in the namespace of ``pid``."""
    found: set[str] = set()
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if fields[4] == str(point):
            found = set(fields[5].split(","))
    assert found, f"nothing mounted at {point}"
    return found


def test_every_bind_is_nosuid_and_nodev_and_a_setuid_file_made_through_it_grants_nothing(
    tmp_path: Path, qemu: int
) -> None:
    """An escaped QEMU writes through its binds; what it writes there must never run setuid (nor
    open a device) through them, at any depth of the bind."""
    source = tmp_path / "volume"
    (source / "below").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(source / "below")], check=True)
    try:
        target = tmp_path / "target"
        target.mkdir()
        binds.bind(qemu, source, target, readonly=False, beneath=tmp_path)
        for point in (target, target / "below"):
            assert {"nosuid", "nodev"} <= mount_options(qemu, point), point
        made = inside(qemu, f"cp /usr/bin/id {target}/id && chmod 4755 {target}/id && ls -l {target}/id")
        assert made.returncode == 0 and made.stdout.startswith("-rwsr-xr-x"), made
        ran = inside(qemu, f"setpriv --reuid=65534 --regid=65534 --clear-groups {target}/id -u")
        assert ran.stdout.strip() == "65534", ran  # not 0: the setuid bit does nothing through the bind
    finally:
        subprocess.run(["umount", str(source / "below")], capture_output=True)


def test_a_resolved_source_binds_what_was_checked_whatever_the_path_names_later(tmp_path: Path, qemu: int) -> None:
    checked, other = tmp_path / "pod" / "volume", tmp_path / "other-pod" / "secret"
    checked.mkdir(parents=True)
    other.mkdir(parents=True)
    (checked / "mine").write_text("mine\n")
    (other / "theirs").write_text("theirs\n")
    fd = binds.resolve(str(checked))
    try:
        # the path is swapped for a symlink to another pod's volume after it was checked
        checked.rename(tmp_path / "pod" / "moved")
        (tmp_path / "pod" / "volume").symlink_to(other)
        target = tmp_path / "sandbox" / "target"
        target.mkdir(parents=True)
        binds.bind(qemu, fd, target, readonly=True, beneath=tmp_path)
    finally:
        os.close(fd)
    assert inside(qemu, f"ls {target}").stdout == "mine\n"
    binds.unbind_all(qemu, tmp_path / "sandbox")


def test_a_path_that_holds_a_symlink_is_not_resolved(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError, match="symbolic links"):
        binds.resolve(str(tmp_path / "link"))
    with pytest.raises(OSError, match="not an absolute path"):
        binds.resolve("relative")
    fd = binds.resolve(str(tmp_path / "real"))
    os.close(fd)
