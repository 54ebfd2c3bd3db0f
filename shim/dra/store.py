"""The prepared claims of the DRA driver, one owner: a JSON file per claim uid under
``<state_dir>/dra/claims`` (directory 0700, files 0600), written atomically (temporary file, fsync,
rename, fsync of the directory) so that a claim is either prepared with all of its record or not at
all, and read back at start with the core's checks. RunPodSandbox looks a pod's claims up here
(``for_pod``)."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from shim.dra.record_files import fsync_dir, read_bounded, write_atomically
from vmsandbox.dra import PreparedClaim, claim_from_record, claim_record, claim_uid
from vmsandbox.errors import InvalidArgument

log = logging.getLogger(__name__)

MAX_CLAIMS = 4096


class ClaimStore:
    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._lock = threading.Lock()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self._claims: dict[str, PreparedClaim] = {}
        self._load()

    def _load(self) -> None:
        for entry in sorted(self._dir.iterdir()):
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                entry.unlink(missing_ok=True)  # a write cut short by a crash: that claim was not prepared
                continue
            if not entry.name.endswith(".json"):
                continue
            try:
                claim = claim_from_record(json.loads(read_bounded(entry)))
            except (OSError, ValueError, InvalidArgument) as exc:
                log.warning("prepared claim %s unreadable, left out: %s", entry.name, exc)
                continue
            if entry.name != f"{claim.uid}.json":
                log.warning("prepared claim %s names claim %s, left out", entry.name, claim.uid)
                continue
            self._claims[claim.uid] = claim

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get(uid)

    def all(self) -> list[PreparedClaim]:
        with self._lock:
            return sorted(self._claims.values(), key=lambda c: c.uid)

    def for_pod(self, pod_uid: str) -> list[PreparedClaim]:
        with self._lock:
            return sorted((c for c in self._claims.values() if pod_uid in c.pod_uids), key=lambda c: c.uid)

    def put(self, claim: PreparedClaim) -> None:
        claim_uid(claim.uid)
        data = json.dumps(claim_record(claim), sort_keys=True).encode()
        with self._lock:
            if claim.uid not in self._claims and len(self._claims) >= MAX_CLAIMS:
                raise InvalidArgument(f"more than {MAX_CLAIMS} prepared claims on this node")
            write_atomically(self._dir, f"{claim.uid}.json", data)
            self._claims[claim.uid] = claim

    def remove(self, uid: str) -> bool:
        """Forget a claim; False when it was not prepared (unprepare is idempotent)."""
        claim_uid(uid)
        with self._lock:
            try:
                (self._dir / f"{uid}.json").unlink()
            except FileNotFoundError:
                pass
            else:
                fsync_dir(self._dir)
            return self._claims.pop(uid, None) is not None
