"""No QEMU of this runtime runs as root, snapshot guests included, through the real socket with
real guests: while a shape's snapshot is made (in the background after the shape's first pod, and by
``vmsandbox snapshot make``), every QEMU of the shim's runs as a uid of ``qemu_uids`` with no
effective capability, the snapshot's guest under a uid of its own. The stored save image stays
root's (0600, in a directory no QEMU uid can list or enter), so the restoring pod's QEMU cannot
open it: libvirt reads it as root and hands QEMU the open file, and the restored pod works."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import libvirt
import pytest

from tests.integration.state_check import read_ledger
from tests.integration.test_qemu_user import _probe, _status
from tests.integration.test_snapshot_restore import (
    MANIFEST,
    probe,
    remove,
    run,
    snap_pod,
    started_by,
    wait_for_snapshot,
)
from tests.shim_kit import (
    LIBVIRT_URI,
    SNAPSHOT_HANDLER,
    Shim,
    remove_all,
    require_host,
    start_shim,
    stop_shim,
)
from vmsandbox.domain import domain_name
from vmsandbox.domain_xml import read_identity

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]

FIRST, LAST = 2_100_000_200, 2_100_000_299
UIDS: dict[str, object] = {"qemu_uids": f"{FIRST}-{LAST}"}


@dataclass
class Seen:
    """What a watcher saw of the QEMUs of one state database's domains: name -> {(uid, CapEff)}."""

    qemus: dict[str, set[tuple[int, str]]] = field(default_factory=dict)

    def snapshot_uids(self) -> set[int]:
        return {uid for name, seen in self.qemus.items() if name.startswith("vmsnapshot-") for uid, _ in seen}


@contextmanager
def watch_qemus(state_dir: Path) -> Iterator[Seen]:
    """Samples, every 20 ms while the block runs, the uid and CapEff of the QEMU of every domain
    whose metadata names this state database (other runs' guests share the host)."""
    owner = read_ledger(state_dir).instance
    seen = Seen()
    done = threading.Event()
    conn = libvirt.open(LIBVIRT_URI)
    owners: dict[str, str] = {}

    def sample() -> None:
        while not done.is_set():
            for dom in conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE):
                name = dom.name()
                if not name.startswith(("vmsandbox-", "vmsnapshot-")):
                    continue
                if name not in owners:
                    try:
                        ident = read_identity(dom.XMLDesc(0))
                    except libvirt.libvirtError:
                        continue  # gone while we looked
                    owners[name] = ident.owner if ident else ""
                if owners[name] != owner:
                    continue
                try:
                    pid = int(Path(f"/run/libvirt/qemu/{name}.pid").read_text())
                    st = _status(pid)
                except (OSError, ValueError):
                    continue  # starting or gone
                seen.qemus.setdefault(name, set()).add((int(st["Uid"].split()[1]), st["CapEff"]))
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join(timeout=10)
        conn.close()


def assert_unprivileged(seen: Seen) -> None:
    assert seen.snapshot_uids(), f"no snapshot guest's QEMU was seen: {seen.qemus}"
    for name, samples in seen.qemus.items():
        for uid, cap_eff in samples:
            assert FIRST <= uid <= LAST, (name, uid)
            assert cap_eff == "0000000000000000", (name, cap_eff)


def assert_image_is_roots(made: Path, restoring_uid: int) -> None:
    image = made / "image.save"
    st = image.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600), st
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert {p.stat().st_uid for p in made.rglob("*")} == {0}  # nothing stays the snapshot QEMU's uid's
    opened = _probe(restoring_uid, [str(image.resolve()), str(made.resolve())])
    assert set(opened.values()) == {"Permission denied"}, opened


def restored_pod_works(shim: Shim, tmp_path: Path, key: str) -> None:
    config = snap_pod("restored", hostname="restored-host", log_directory=tmp_path / "logs-restored")
    sid = run(shim, config)
    assert started_by(shim, sid) == {"by": "restore", "snapshot": key}, shim.log_text()[-3000:]
    uid = int(read_ledger(shim.state_dir).rows[sid][1]["qemu_uid"])
    assert FIRST <= uid <= LAST
    st = _status(int(Path(f"/run/libvirt/qemu/{domain_name(sid)}.pid").read_text()))
    assert st["Uid"].split() == [str(uid)] * 4 and st["CapEff"] == "0000000000000000", st  # the restored QEMU
    assert_image_is_roots(shim.state_dir / "snapshots" / key, uid)
    lines = probe(shim, sid, config)
    assert lines[2] == "restored-host", lines
    remove(shim, sid)


def test_a_snapshot_made_after_a_first_pod_runs_qemu_unprivileged(tmp_path: Path) -> None:
    require_host()
    shim = start_shim(tmp_path, extra_config=UIDS)
    try:
        with watch_qemus(shim.state_dir) as seen:
            first = run(shim, snap_pod("first"))
            first_uid = int(read_ledger(shim.state_dir).rows[first][1]["qemu_uid"])
            made = wait_for_snapshot(shim)
        assert_unprivileged(seen)
        assert first_uid not in seen.snapshot_uids()  # the snapshot's guest has a uid of its own
        remove(shim, first)
        restored_pod_works(shim, tmp_path, made.name)
        assert read_ledger(shim.state_dir).claims == {}
    finally:
        remove_all(shim)
        stop_shim(shim)


def test_snapshot_make_runs_qemu_unprivileged(tmp_path: Path) -> None:
    require_host()
    shim = start_shim(tmp_path, extra_config=UIDS)  # writes the configuration the command reads
    stop_shim(shim)
    (tmp_path / "pod.yaml").write_text(MANIFEST)
    with watch_qemus(tmp_path / "state") as seen:
        made = subprocess.run(
            [sys.executable, "-m", "cli.main", "snapshot", "make", str(tmp_path / "pod.yaml"),
             "--config", str(tmp_path / "config.yaml"), "--handler", SNAPSHOT_HANDLER, "--format", "json"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert_unprivileged(seen)
    shim = start_shim(tmp_path, extra_config=UIDS)
    try:
        restored_pod_works(shim, tmp_path, json.loads(made.stdout)["key"])
    finally:
        remove_all(shim)
        stop_shim(shim)
