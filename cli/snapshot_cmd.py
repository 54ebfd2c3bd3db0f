"""``vmsandbox snapshot make|list|remove``: the snapshots pods are restored from, ahead of time.

``make`` boots a guest of the shape a pod manifest would get (as ``plan`` computes it), with no pod
identity, and saves it into the state directory, printing its progress; it claims the CPUs and
pages it boots on through the state database as a pod would. It refuses while a shim serves the
configured socket: that shim makes snapshots itself, on first use, and its reconcile owns the
claims. ``list`` and ``remove`` read and change the store only.
"""

from __future__ import annotations

import datetime
import socket
import sys
from pathlib import Path
from typing import Any

from shim.config import ShimConfig
from vmsandbox.adapters.snapshot_store import SnapshotStore, StoredSnapshot
from vmsandbox.errors import InvalidArgument, NotFound


def _serving(path: str) -> bool:
    if not Path(path).exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def make(config: ShimConfig, manifest_path: str, handler: str | None, document: int | None, force: bool) -> Any:
    from cli.plan import load_manifest, sandbox_request
    from shim.containers import Containers
    from shim.sandboxes import Sandboxes
    from shim.server import _open_ledger, image_store
    from vmsandbox.adapters.hypervisor import Hypervisor
    from vmsandbox.adapters.profile_loader import default_profiles, load_profiles

    if _serving(config.socket_path):
        raise InvalidArgument(
            f"a shim serves {config.socket_path}: it makes snapshots itself when the first pod of a shape starts; "
            "run 'snapshot make' while it is stopped (e.g. before it starts)"
        )
    profiles = load_profiles(config.profile_files) if config.profile_files else default_profiles()
    manifest = load_manifest(manifest_path, document)
    spec = sandbox_request(manifest, handler or config.default_handler)
    Path(config.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    ledger = _open_ledger(Path(config.state_dir))
    hypervisor = Hypervisor(config.libvirt_uri)
    try:
        sandboxes = Sandboxes(config, ledger, hypervisor, profiles)
        Containers(config.state_dir, sandboxes, image_store(config), hypervisor)  # the guest's shared directories

        def progress(line: str) -> None:
            print(f"snapshot: {line}", file=sys.stderr, flush=True)

        return sandboxes.boot.make_snapshot(spec, sandboxes.plan(spec), progress, force=force)
    finally:
        hypervisor.close()
        ledger.close()


def snapshot_doc(s: StoredSnapshot) -> dict[str, Any]:
    return {
        "key": s.key,
        "size_bytes": s.size_bytes,
        "created": datetime.datetime.fromtimestamp(s.created_ns / 1e9, datetime.UTC).isoformat(timespec="seconds"),
        "make_ms": s.make_ms,
        "inputs": s.inputs.to_doc(),
    }


def render_list(snapshots: list[StoredSnapshot]) -> str:
    if not snapshots:
        return "no snapshots"
    lines = [f"{'KEY':<14}{'SIZE':>8}  {'MADE IN':>8}  {'CREATED':<26}SHAPE"]
    for s in snapshots:
        created, size, took = snapshot_doc(s)["created"], s.size_bytes >> 20, s.make_ms / 1000
        lines.append(f"{s.key[:12]:<14}{size:>5} MiB  {took:>6.1f} s  {created:<26}{s.inputs.describe()}")
    return "\n".join(lines)


def listing(state_dir: str) -> list[StoredSnapshot]:
    return SnapshotStore(state_dir).all()


def remove(state_dir: str, keys: list[str], every: bool) -> list[str]:
    store = SnapshotStore(state_dir)
    known = store.all()
    if every:
        chosen = [s.key for s in known]
    else:
        chosen = []
        for given in keys:
            matches = [s.key for s in known if s.key.startswith(given.lower())]
            if len(matches) != 1:
                raise (NotFound if not matches else InvalidArgument)(
                    f"snapshot {given[:70]!r}: {'no' if not matches else len(matches)} snapshots match"
                )
            chosen.append(matches[0])
    return [k for k in chosen if store.remove(k)]
