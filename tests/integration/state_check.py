"""Read a shim's state database (read-only) and libvirt from outside the shim, and check they agree.

Other vmsandbox state databases may have guests on the same libvirt (another test run): domains
are told apart by the owner id in their metadata (``ledger.instance_id``), and their hugepages
are accounted from their XML, so the checks stay exact on a shared host.
"""

from __future__ import annotations

import json
import sqlite3
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libvirt

from tests.shim_kit import LIBVIRT_URI, hugepages_free
from vmsandbox.adapters.ledger import read_claims
from vmsandbox.claims import Claim
from vmsandbox.domain_xml import read_identity


@dataclass(frozen=True)
class LedgerView:
    instance: str
    rows: dict[str, tuple[str, dict[str, Any]]]  # sandbox id -> (state, record)
    claims: dict[str, Claim]  # sandbox id -> what it holds
    containers: dict[str, list[tuple[str, str]]]  # sandbox id -> [(container id, state)]


@dataclass(frozen=True)
class Dom:
    name: str
    sandbox_id: str
    owner: str
    active: bool
    pages: int  # 2 MiB pages the running guest holds


def read_ledger(state_dir: Path) -> LedgerView:
    db = sqlite3.connect(f"{(state_dir / 'state.db').resolve().as_uri()}?mode=ro", uri=True, timeout=10)
    try:
        instance = db.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()[0]
        rows = {r[0]: (r[1], json.loads(r[2])) for r in db.execute("SELECT id, state, record FROM sandboxes")}
        claims = read_claims(db)
        kids: dict[str, list[tuple[str, str]]] = {}
        for cid, sid, state in db.execute("SELECT id, sandbox_id, state FROM containers ORDER BY created_ns"):
            kids.setdefault(sid, []).append((cid, state))
        return LedgerView(instance=str(instance), rows=rows, claims=claims, containers=kids)
    finally:
        db.close()


def _pages(xml: str) -> int:
    root = ET.fromstring(xml)
    if root.find("memoryBacking/hugepages") is None:
        return 0
    memory = root.find("memory")
    assert memory is not None and memory.get("unit") == "KiB"
    return int(memory.text or "0") // 2048


def read_domains() -> list[Dom]:
    conn = libvirt.open(LIBVIRT_URI)
    try:
        out = []
        for d in conn.listAllDomains(0):
            if not d.name().startswith("vmsandbox-"):
                continue
            try:
                xml, active = d.XMLDesc(0), bool(d.isActive())
            except libvirt.libvirtError:
                continue  # vanished while we looked (another test run tearing down)
            ident = read_identity(xml)
            sid, owner = (ident.sandbox_id, ident.owner) if ident else ("", "")
            out.append(Dom(d.name(), sid, owner, active, _pages(xml) if active else 0))
        return out
    finally:
        conn.close()


def vmsandbox_free_baseline() -> int:
    """HugePages_Free as it would be with no vmsandbox guest running at all."""
    return hugepages_free() + sum(d.pages for d in read_domains())


def record_pages(record: dict[str, Any]) -> int:
    return sum(int(h[2]) for h in record.get("hugepages", []) if int(h[1]) == 2 << 20)


def assert_consistent(state_dir: Path, baseline: int) -> LedgerView:
    """The ledger and libvirt agree; nothing leaked, nothing held twice; the host's pages add up."""
    led = read_ledger(state_dir)
    doms = read_domains()
    mine = {d.sandbox_id: d for d in doms if d.owner == led.instance or (not d.owner and d.sandbox_id in led.rows)}
    ready = {sid for sid, (state, _) in led.rows.items() if state == "SANDBOX_READY"}
    assert not [sid for sid, (state, _) in led.rows.items() if state not in ("SANDBOX_READY", "SANDBOX_NOTREADY")]
    # every domain of ours has a READY row and runs; every READY row has its running domain
    assert set(mine) == ready, (sorted(mine), sorted(ready))
    assert all(d.active for d in mine.values())
    for sid in ready:
        assert mine[sid].name == led.rows[sid][1]["domain"]
    # no CPU held twice (the PRIMARY KEY says so; check anyway), and only by READY sandboxes
    cpus = [c for claim in led.claims.values() for c in claim.cpus]
    assert len(cpus) == len(set(cpus))
    assert set(led.claims) <= ready
    for sid in ready:
        record = led.rows[sid][1]
        held = led.claims.get(sid, Claim())
        if record["shape"]["cpu_policy"] == "exclusive":
            assert set(held.cpus) == set(record["cpus"])
        assert sum(c for _, size, c in held.pages if size == 2 << 20) == record_pages(record)
        assert mine[sid].pages == record_pages(record)
    # the host's free pages: the baseline minus the adopted sandboxes' pages (and other runs' guests)
    expected = 0
    deadline = time.monotonic() + 15
    while True:
        foreign = sum(d.pages for d in read_domains() if d.sandbox_id not in mine)
        expected = baseline - sum(record_pages(led.rows[sid][1]) for sid in ready) - foreign
        if hugepages_free() == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert hugepages_free() == expected
    return led
