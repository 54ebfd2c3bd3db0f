"""Whether QEMU, running as an unprivileged uid of ``qemu_uids``, can reach the files it opens
itself: the decision, over what ``vmsandbox.adapters.passable_walk`` reads.

Each sandbox's QEMU opens its kernel and initramfs (in the profile's ``guest.image_dir``) and its
directories below ``state_dir`` (its shared directory, the binds of its image disks, a snapshot
guest's shares) as a uid that owns none of the directories above them and is in none of their
groups: it passes a directory only by the directory's "others" execute bit, and reads a file only
by its "others" read bit. A directory above ``state_dir`` (or the image directory) without o+x makes
every RunPodSandbox fail in libvirt ("failed to open ...: Permission denied"), so the shim refuses
to start, and ``vmsandbox profile validate`` says so, naming each such directory and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

_OTHERS_X, _OTHERS_R = 0o001, 0o004


@dataclass(frozen=True)
class PathEntry:
    """A directory or file as ``stat`` shows it (permission bits only in ``mode``)."""

    path: str
    mode: int


@dataclass(frozen=True)
class Reach:
    """What QEMU must reach for one configured path: every directory it searches on the way (in
    the order path resolution searches them, symlinks followed) and the files it reads."""

    key: str  # the setting, as the admin wrote it: "state_dir", "profile 'small' guest.image_dir"
    path: str  # the configured path
    dirs: tuple[PathEntry, ...]
    files: tuple[PathEntry, ...] = ()


def reach_problems(reaches: list[Reach]) -> list[str]:
    """One sentence per directory (or file) QEMU cannot pass (or read), naming what needs it and
    the fix; empty when every path is reachable. A directory several settings need is named once."""
    blocked: dict[str, tuple[PathEntry, list[Reach], bool]] = {}
    for reach in reaches:
        for entry in reach.dirs:
            if not entry.mode & _OTHERS_X:
                blocked.setdefault(entry.path, (entry, [], True))[1].append(reach)
        for entry in reach.files:
            if not entry.mode & _OTHERS_R:
                blocked.setdefault(entry.path, (entry, [], False))[1].append(reach)
    out = []
    for path, (entry, needs, is_dir) in blocked.items():
        what = ", ".join(dict.fromkeys(f"{r.key} ({r.path})" for r in needs))
        keys = " and ".join(dict.fromkeys(r.key for r in needs))
        mode = f"mode {entry.mode & 0o7777:04o}"
        who = "each sandbox's QEMU, running as an unprivileged uid of qemu_uids,"
        if is_dir:
            out.append(
                f"directory {path} ({mode}) cannot be passed by other users, and {who} must pass it to reach "
                f"{what}: run 'chmod o+x {path}', or move {keys} below directories others can pass"
            )
        else:
            out.append(
                f"file {path} ({mode}) cannot be read by other users, and {who} opens it ({what}): "
                f"run 'chmod o+r {path}'"
            )
    return out
