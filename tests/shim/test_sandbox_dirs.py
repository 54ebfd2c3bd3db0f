"""``shim.sandbox_dirs``: each sandbox's directory is its QEMU's alone, and forgotten ones are swept."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shim.sandbox_dirs import SandboxDirs
from tests.cri_server import SEED_SANDBOXES, cri_server

KNOWN = "a" * 64
FORGOTTEN = "b" * 64


def test_make_gives_the_directory_to_qemus_uid_alone(tmp_path: Path) -> None:
    dirs = SandboxDirs(str(tmp_path))
    (share,) = dirs.make(KNOWN, 4242, None)
    assert share.source == str(dirs.shared(KNOWN)) and share.accessmode == "mapped"
    for d in (dirs.root / KNOWN, dirs.shared(KNOWN)):
        st = d.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4242, 4242, 0o700), d
    assert stat.S_IMODE(dirs.root.stat().st_mode) == 0o711
    assert (dirs.shared(KNOWN) / "containers").is_dir()


def test_sweep_removes_only_forgotten_sandboxes(tmp_path: Path) -> None:
    dirs = SandboxDirs(str(tmp_path))
    for sid in (KNOWN, FORGOTTEN):
        dirs.make(sid, os.getuid(), None)
        (dirs.shared(sid) / "containers" / "f").write_text("x")
    (dirs.root / "not-an-id").mkdir()
    dirs.sweep({KNOWN})
    assert sorted(p.name for p in dirs.root.iterdir()) == sorted([KNOWN, "not-an-id"])


def test_the_reconcile_sweeps_the_directories_of_forgotten_sandboxes() -> None:
    """The sandboxes' owner holds the directories, so its first reconcile sweeps them whatever
    else start-up has built by then."""
    with cri_server() as server:
        sb = server.sandboxes
        sb.dirs.make(FORGOTTEN, os.getuid(), None)
        sb.dirs.make(SEED_SANDBOXES[0], os.getuid(), None)
        sb.reconciler.reconcile()
        assert not (sb.dirs.root / FORGOTTEN).exists()
