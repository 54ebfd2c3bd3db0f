"""Mount points read from mountinfo (vmsandbox.mountinfo)."""

from __future__ import annotations

from vmsandbox.mountinfo import points_under, unescape


def test_mountinfo_paths_are_unescaped() -> None:
    info = (
        "36 35 98:0 / /run/a\\040b rw,noatime master:1 - ext3 /dev/root rw\n"
        "37 35 98:0 / /run/a\\040b/c rw - ext3 /dev/root rw\n"
        "38 35 98:0 / /run/ab rw - ext3 /dev/root rw\n"
    )
    assert points_under(info, "/run/a b") == ["/run/a b/c", "/run/a b"]
    assert points_under(info, "/run/a") == []
    assert unescape("/x\\011y\\012z\\134") == "/x\ty\nz\\"
