"""The directories resolving a path searches, read from the file system for
``vmsandbox.passable``: each component is looked up in the directory before it, and a symlink's
target is resolved in its place (from ``/`` when absolute), as the kernel does for QEMU's opens."""

from __future__ import annotations

import os
import stat

from vmsandbox.passable import PathEntry, Reach

_MAX_LINKS = 40  # the kernel's limit on symlinks followed in one lookup


def _entry(path: str) -> PathEntry:
    return PathEntry(path, stat.S_IMODE(os.stat(path).st_mode))


def searched_dirs(path: str) -> tuple[tuple[PathEntry, ...], str | None]:
    """Every directory resolving absolute ``path`` searches, in order, each once, and the real path
    it resolves to (None when a component does not exist yet: the directories up to there)."""
    parts = [p for p in path.split("/") if p and p != "."]
    current, out, seen, links = "/", [], set(), 0
    while parts:
        name = parts.pop(0)
        if current not in seen:
            seen.add(current)
            out.append(_entry(current))
        if name == "..":
            current = os.path.dirname(current) or "/"
            continue
        nxt = os.path.join(current, name)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return tuple(out), None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return tuple(out), None
            target = os.readlink(nxt)
            if target.startswith("/"):
                current = "/"
            parts = [p for p in target.split("/") if p and p != "."] + parts
            continue
        current = nxt
    return tuple(out), current


def state_reach(state_dir: str) -> Reach:
    """The directories above the state directory (its real path: the shim hands QEMU real paths
    below it); the state directory itself the shim makes passable."""
    dirs, _ = searched_dirs(os.path.realpath(state_dir))
    return Reach("state_dir", state_dir, dirs)


def image_reach(key: str, image_dir: str, files: tuple[str, ...]) -> Reach:
    """The directories QEMU searches to open each of ``files`` of ``image_dir`` (as the domain names
    them: the configured path, links and all), and those files."""
    dirs: dict[str, PathEntry] = {}
    found = []
    for name in files:
        searched, real = searched_dirs(os.path.join(os.path.abspath(image_dir), name))
        dirs.update((d.path, d) for d in searched)
        if real is not None:
            found.append(PathEntry(os.path.join(image_dir, name), _entry(real).mode))
    return Reach(key, image_dir, tuple(dirs.values()), tuple(found))
