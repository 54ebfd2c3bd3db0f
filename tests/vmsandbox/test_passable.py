"""Tests of vmsandbox.passable (table-driven: which directories and files an unprivileged QEMU
cannot pass or read, and what the message says) and of vmsandbox.adapters.passable_walk on real
directories (the directories a lookup searches, symlinks followed as the kernel follows them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vmsandbox.adapters.passable_walk import image_reach, searched_dirs, state_reach
from vmsandbox.passable import PathEntry, Reach, reach_problems


def _dirs(*pairs: tuple[str, int]) -> tuple[PathEntry, ...]:
    return tuple(PathEntry(p, m) for p, m in pairs)


STATE = Reach("state_dir", "/srv/x/state", _dirs(("/", 0o755), ("/srv", 0o755), ("/srv/x", 0o755)))
IMAGE = Reach(
    "guest.image_dir of profile 'small'",
    "/img",
    _dirs(("/", 0o755), ("/img", 0o755)),
    (PathEntry("/img/vmlinux", 0o644), PathEntry("/img/initramfs.img", 0o644)),
)


@pytest.mark.parametrize(
    ("reaches", "expected"),
    [
        pytest.param([STATE, IMAGE], [], id="all-passable"),
        pytest.param([Reach("state_dir", "/s", _dirs(("/", 0o711)))], [], id="x-without-r-passes"),
        pytest.param(
            [Reach("state_dir", "/srv/x/state", _dirs(("/", 0o755), ("/srv", 0o700), ("/srv/x", 0o755)))],
            [
                "directory /srv (mode 0700) cannot be passed by other users",
                "reach state_dir (/srv/x/state)",
                "run 'chmod o+x /srv', or move state_dir below directories others can pass",
            ],
            id="state-below-0700",
        ),
        pytest.param(
            [Reach("state_dir", "/s", _dirs(("/", 0o754)))],
            ["directory / (mode 0754)"],
            id="r-without-x-blocks",
        ),
        pytest.param(
            [Reach("state_dir", "/s", _dirs(("/srv", 0o1770)))],
            ["directory /srv (mode 1770)", "chmod o+x /srv"],
            id="group-only-blocks",
        ),
        pytest.param(
            [Reach(IMAGE.key, IMAGE.path, IMAGE.dirs, (PathEntry("/img/vmlinux", 0o600),))],
            [
                "file /img/vmlinux (mode 0600) cannot be read by other users",
                "opens it (guest.image_dir of profile 'small' (/img))",
                "run 'chmod o+r /img/vmlinux'",
            ],
            id="kernel-unreadable",
        ),
    ],
)
def test_reach_problems(reaches: list[Reach], expected: list[str]) -> None:
    problems = reach_problems(reaches)
    if not expected:
        assert problems == []
        return
    assert len(problems) == 1, problems
    for part in expected:
        assert part in problems[0], problems[0]


def test_a_directory_several_settings_need_is_named_once_with_both() -> None:
    blocked = _dirs(("/", 0o755), ("/data", 0o700))
    problems = reach_problems(
        [Reach("state_dir", "/data/state", blocked), Reach("guest.image_dir", "/data/img", blocked)]
    )
    assert len(problems) == 1
    assert "reach state_dir (/data/state), guest.image_dir (/data/img)" in problems[0]
    assert "move state_dir and guest.image_dir below" in problems[0]


def test_each_blocking_directory_is_named() -> None:
    problems = reach_problems([Reach("state_dir", "/a/b/s", _dirs(("/", 0o755), ("/a", 0o700), ("/a/b", 0o750)))])
    assert [p.split(" (")[0] for p in problems] == ["directory /a", "directory /a/b"]


# -- the walk, on real directories ---------------------------------------------------------------
def test_the_walk_lists_each_directory_searched_in_order(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    dirs, real = searched_dirs(str(tmp_path / "a" / "b"))
    assert [d.path for d in dirs][-2:] == [str(tmp_path), str(tmp_path / "a")]
    assert dirs[0].path == "/" and real == str(tmp_path / "a" / "b")


def test_the_walk_follows_links_through_the_directories_of_both(tmp_path: Path) -> None:
    (tmp_path / "real" / "img").mkdir(parents=True)
    (tmp_path / "real" / "img" / "vmlinux").write_bytes(b"k")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "img").symlink_to("../real/img")  # relative
    (tmp_path / "abs").symlink_to(tmp_path / "links")  # absolute
    dirs, real = searched_dirs(str(tmp_path / "abs" / "img" / "vmlinux"))
    paths = [d.path for d in dirs]
    assert real == str(tmp_path / "real" / "img" / "vmlinux")
    for d in (tmp_path, tmp_path / "links", tmp_path / "real", tmp_path / "real" / "img"):
        assert str(d) in paths, (d, paths)
    assert len(paths) == len(set(paths))


def test_the_walk_stops_at_a_missing_component(tmp_path: Path) -> None:
    dirs, real = searched_dirs(str(tmp_path / "not-yet" / "state"))
    assert real is None and dirs[-1].path == str(tmp_path)


def test_a_state_dir_below_a_closed_directory_is_refused_and_its_own_mode_is_not_checked(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "state").mkdir(parents=True)
    closed.chmod(0o700)
    (closed / "state").chmod(0o700)  # the shim makes it 0711 itself
    tmp_path.chmod(0o755)
    reach = state_reach(str(closed / "state"))
    assert [d.path for d in reach.dirs][-1] == str(closed)
    problems = [p for p in reach_problems([reach]) if p.startswith(f"directory {closed} ")]
    assert problems and f"chmod o+x {closed}'" in problems[0]
    closed.chmod(0o711)
    assert not [p for p in reach_problems([state_reach(str(closed / "state"))]) if p.startswith(f"directory {closed} ")]


def test_an_image_reach_reads_the_files_modes(tmp_path: Path) -> None:
    img = tmp_path / "img"
    img.mkdir()
    for name, mode in (("vmlinux", 0o644), ("initramfs.img", 0o600)):
        (img / name).write_bytes(b"x")
        os.chmod(img / name, mode)
    reach = image_reach("guest.image_dir", str(img), ("vmlinux", "initramfs.img", "missing"))
    assert {(f.path, f.mode) for f in reach.files} == {(f"{img}/vmlinux", 0o644), (f"{img}/initramfs.img", 0o600)}
    assert str(img) in [d.path for d in reach.dirs]
