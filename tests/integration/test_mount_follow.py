"""Host mounts made below a followed volume's source after its bind reach QEMU's namespace
idmapped (shim/mount_follow.py), with real mounts: a process in a mount namespace of its own
stands in for QEMU, as in test_binds.py. Through the copy, host root's files are QEMU's uid's;
a mount the kernel propagated would show them as root's (0700: closed to QEMU's uid)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.mount_follow import MountFollower
from vmsandbox.adapters import binds

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root"),
]

QEMU_UID = 2_000_000_321


@pytest.fixture
def source(tmp_path: Path) -> Iterator[Path]:
    """A volume source that is an rshared mount of its own (as critest makes it), with a
    directory for a later mount; everything mounted below it is taken away at the end."""
    src = tmp_path / "volume"
    (src / "later").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(src), str(src)], check=True)
    subprocess.run(["mount", "--make-rshared", str(src)], check=True)
    try:
        yield src
    finally:
        subprocess.run(["umount", "-R", str(src)], capture_output=True)


@pytest.fixture
def follower() -> Iterator[MountFollower]:
    f = MountFollower()
    try:
        yield f
    finally:
        f.close()


def owner_inside(pid: int, path: Path) -> str:
    out = subprocess.run(
        ["nsenter", "-t", str(pid), "-m", "stat", "-c", "%u", str(path)], capture_output=True, text=True
    )
    return out.stdout.strip() or out.stderr.strip()


def mount_private_tmpfs(at: Path) -> None:
    """A tmpfs of root's, 0700, with a file in it: what QEMU's uid cannot enter unmapped."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "none", str(at)], check=True)
    (at / "flag").write_text("mounted after the bind\n")
    (at / "flag").chmod(0o600)


def bind_followed(follower: MountFollower, qemu: int, src: Path, tmp_path: Path) -> Path:
    shared = tmp_path / "shared"
    target = shared / "containers" / "c1" / "mounts" / "0"
    target.mkdir(parents=True)
    known = follower.snapshot(str(src))
    binds.bind(qemu, src, target, readonly=False, propagation="private", beneath=shared, root_as=QEMU_UID)
    follower.watch(
        "s1", "c1", 0, qemu_pid=qemu, source=str(src), bound=target, beneath=shared, root_as=QEMU_UID, known=known
    )
    return target


def test_a_later_host_mount_arrives_idmapped_and_goes_when_the_host_takes_it_away(
    tmp_path: Path, qemu: int, source: Path, follower: MountFollower
) -> None:
    target = bind_followed(follower, qemu, source, tmp_path)
    assert owner_inside(qemu, target / "later") == str(QEMU_UID)  # the bind's own directory
    mount_private_tmpfs(source / "later")
    follower.catch_up("s1")
    assert owner_inside(qemu, target / "later" / "flag") == str(QEMU_UID)
    assert binds.mounts_under(tmp_path / "shared") == []  # nothing in the host's namespace

    subprocess.run(["umount", str(source / "later")], check=True)
    follower.catch_up("s1")
    assert "No such file" in owner_inside(qemu, target / "later" / "flag")
    assert owner_inside(qemu, target) == str(QEMU_UID)  # the volume's own bind stays


def test_the_watch_thread_follows_without_being_asked(
    tmp_path: Path, qemu: int, source: Path, follower: MountFollower
) -> None:
    target = bind_followed(follower, qemu, source, tmp_path)
    mount_private_tmpfs(source / "later")
    deadline = time.monotonic() + 5
    while owner_inside(qemu, target / "later" / "flag") != str(QEMU_UID):
        assert time.monotonic() < deadline, owner_inside(qemu, target / "later" / "flag")
        time.sleep(0.02)


def test_nested_mounts_and_mounts_made_in_one_go(
    tmp_path: Path, qemu: int, source: Path, follower: MountFollower
) -> None:
    target = bind_followed(follower, qemu, source, tmp_path)
    follower.forget("s1", "c1")  # both mounts below are made before the follower looks
    mount_private_tmpfs(source / "later")
    (source / "later" / "inner").mkdir()
    mount_private_tmpfs(source / "later" / "inner")
    follower.watch(
        "s1",
        "c1",
        0,
        qemu_pid=qemu,
        source=str(source),
        bound=target,
        beneath=tmp_path / "shared",
        root_as=QEMU_UID,
        known=binds_known(follower, source),
    )
    assert owner_inside(qemu, target / "later" / "inner" / "flag") == str(QEMU_UID)


def binds_known(follower: MountFollower, source: Path) -> dict[int, str]:
    """What the bind cloned: the source's own mount only."""
    return {i: p for i, p in follower.snapshot(str(source)).items() if p == str(source)}


def test_a_forgotten_volume_is_not_followed(tmp_path: Path, qemu: int, source: Path, follower: MountFollower) -> None:
    target = bind_followed(follower, qemu, source, tmp_path)
    follower.forget("s1")
    assert follower.watched("s1") == 0
    mount_private_tmpfs(source / "later")
    follower.catch_up()
    assert "No such file" in owner_inside(qemu, target / "later" / "flag")


def test_a_mount_made_over_the_source_itself_comes_and_goes(
    tmp_path: Path, qemu: int, source: Path, follower: MountFollower
) -> None:
    target = bind_followed(follower, qemu, source, tmp_path)
    mount_private_tmpfs(source)
    try:
        follower.catch_up("s1")
        assert owner_inside(qemu, target / "flag") == str(QEMU_UID)
    finally:
        subprocess.run(["umount", str(source)], check=True)
    follower.catch_up("s1")
    assert "No such file" in owner_inside(qemu, target / "flag")
    assert owner_inside(qemu, target / "later") == str(QEMU_UID)  # the volume's own bind stays
    subprocess.run(["umount", str(source)], check=True)  # the source's own mount, which the bind cloned
    follower.catch_up("s1")
    assert owner_inside(qemu, target / "later") == str(QEMU_UID)


def test_a_mount_that_could_not_be_copied_detaches_nothing_when_it_goes(
    tmp_path: Path, qemu: int, source: Path, follower: MountFollower
) -> None:
    """proc cannot be idmapped, so a proc the host mounts over the source is not copied; when the
    host takes it away, the volume's own bind (the topmost mount there) stays."""
    target = bind_followed(follower, qemu, source, tmp_path)
    subprocess.run(["mount", "-t", "proc", "proc", str(source)], check=True)
    try:
        follower.catch_up("s1")
        assert "No such file" in owner_inside(qemu, target / "self")
    finally:
        subprocess.run(["umount", str(source)], check=True)
    follower.catch_up("s1")
    assert owner_inside(qemu, target / "later") == str(QEMU_UID)


def bind_read_only(follower: MountFollower, qemu: int, src: Path, tmp_path: Path, *, say: bool) -> Path:
    shared = tmp_path / "shared"
    target = shared / "containers" / "c1" / "mounts" / "0"
    target.mkdir(parents=True)
    known = follower.snapshot(str(src))
    binds.bind(qemu, src, target, readonly=True, propagation="private", beneath=shared, root_as=QEMU_UID)
    if say:
        follower.watch("s1", "c1", 0, qemu_pid=qemu, source=str(src), bound=target, beneath=shared,
                       root_as=QEMU_UID, known=known, readonly=True)  # fmt: skip
    else:  # as a caller that does not say: the bind's own read-only flag is followed
        follower.watch("s1", "c1", 0, qemu_pid=qemu, source=str(src), bound=target, beneath=shared,
                       root_as=QEMU_UID, known=known)  # fmt: skip
    return target


@pytest.mark.parametrize("say", [True, False])
def test_a_later_mount_below_a_read_only_volume_is_read_only_nosuid_and_nodev(
    tmp_path: Path, qemu: int, source: Path, follower: MountFollower, say: bool
) -> None:
    target = bind_read_only(follower, qemu, source, tmp_path, say=say)
    mount_private_tmpfs(source / "later")
    follower.catch_up("s1")
    assert owner_inside(qemu, target / "later" / "flag") == str(QEMU_UID)  # it arrived
    wrote = subprocess.run(
        ["nsenter", "-t", str(qemu), "-m", "sh", "-c", f"echo x >> {target}/later/flag"],
        capture_output=True,
        text=True,
    )
    assert wrote.returncode != 0 and "Read-only" in wrote.stderr, wrote
    assert (source / "later" / "flag").read_text() == "mounted after the bind\n"
    options: set[str] = set()
    for line in Path(f"/proc/{qemu}/mountinfo").read_text().splitlines():
        if line.split(" ")[4] == str(target / "later"):
            options = set(line.split(" ")[5].split(","))
    assert {"ro", "nosuid", "nodev"} <= options, options
