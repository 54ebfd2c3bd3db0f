"""Mount points read from mountinfo (vmsandbox.mountinfo)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.mountinfo import mount_changes, mounts_below, options_at, points_under, unescape


def test_mountinfo_paths_are_unescaped() -> None:
    info = (
        "36 35 98:0 / /run/a\\040b rw,noatime master:1 - ext3 /dev/root rw\n"
        "37 35 98:0 / /run/a\\040b/c rw - ext3 /dev/root rw\n"
        "38 35 98:0 / /run/ab rw - ext3 /dev/root rw\n"
    )
    assert points_under(info, "/run/a b") == ["/run/a b/c", "/run/a b"]
    assert points_under(info, "/run/a") == []
    assert unescape("/x\\011y\\012z\\134") == "/x\ty\nz\\"


def _line(mount_id: int, point: str) -> str:
    return f"{mount_id} 1 0:{mount_id} / {point} rw,relatime shared:1 - tmpfs none rw"


def test_mounts_below_a_source_by_id_in_the_files_order() -> None:
    text = "\n".join(
        [
            _line(20, "/"),
            _line(31, "/vol"),
            _line(40, "/volume"),  # a sibling sharing the prefix, not below
            _line(35, "/vol/a\\040b"),
            _line(33, "/vol/x"),
            _line(34, "/vol/x"),  # stacked on the same point: a mount of its own
            "garbage",
        ]
    )
    got = mounts_below(text, "/vol")
    assert got == {31: "/vol", 35: "/vol/a b", 33: "/vol/x", 34: "/vol/x"}
    assert list(got) == [31, 35, 33, 34]


@pytest.mark.parametrize(
    ("known", "now", "added", "gone"),
    [
        ({1: "/v"}, {1: "/v"}, [], []),
        ({1: "/v"}, {1: "/v", 9: "/v/a/b", 5: "/v/a"}, [(5, "/v/a"), (9, "/v/a/b")], []),
        ({1: "/v", 5: "/v/a", 9: "/v/a/b"}, {1: "/v"}, [], [(9, "/v/a/b"), (5, "/v/a")]),
        # made again at the same place: a new id, the old one gone
        ({1: "/v", 5: "/v/a"}, {1: "/v", 6: "/v/a"}, [(6, "/v/a")], [(5, "/v/a")]),
        # stacked at one place: made in the file's order, undone last first
        ({1: "/v"}, {1: "/v", 8: "/v/a", 3: "/v/a"}, [(8, "/v/a"), (3, "/v/a")], []),
        ({1: "/v", 8: "/v/a", 3: "/v/a"}, {1: "/v"}, [], [(3, "/v/a"), (8, "/v/a")]),
        # moved (mount --move): the same id at another place
        ({1: "/v", 5: "/v/a"}, {1: "/v", 5: "/v/b/c"}, [(5, "/v/b/c")], [(5, "/v/a")]),
    ],
)
def test_mount_changes(
    known: dict[int, str], now: dict[int, str], added: list[tuple[int, str]], gone: list[tuple[int, str]]
) -> None:
    assert mount_changes(known, now) == (added, gone)


_tables = st.dictionaries(
    st.integers(1, 60), st.lists(st.sampled_from("ab"), max_size=3).map(lambda p: "/v/" + "/".join(p)), max_size=12
)


@given(_tables, _tables)
def test_following_the_changes_turns_known_into_now(known: dict[int, str], now: dict[int, str]) -> None:
    """Applying the changes gives ``now``; a mount comes before any made below it, and is undone
    after those below it."""
    added, gone = mount_changes(known, now)
    after = dict(known)
    for mount_id, _ in gone:
        del after[mount_id]
    after.update(added)
    assert after == now
    for seq, deeper_later in ((added, True), (gone, False)):
        depths = [p.count("/") for _, p in seq]
        assert depths == sorted(depths, reverse=not deeper_later)


_OPTIONS = (
    "30 1 0:26 / /v rw,relatime shared:1 - tmpfs none rw\n"
    "31 30 0:27 / /v/a\\040b ro,nosuid,nodev - tmpfs none rw\n"
    "32 30 0:28 / /v rw - tmpfs none rw\n"
)


@pytest.mark.parametrize(
    ("point", "want"),
    [
        ("/v", frozenset({"rw"})),  # the topmost mount there: the last attached
        ("/v/a b", frozenset({"ro", "nosuid", "nodev"})),
        ("/w", None),
    ],
)
def test_options_at(point: str, want: frozenset[str] | None) -> None:
    assert options_at(_OPTIONS, point) == want
