"""``vmsandbox ls`` / ``inspect``: the shim's sandboxes, read from its state database, read-only.

The database is opened with ``mode=ro`` (sqlite's WAL lets a reader run beside the shim), so the
commands work while the shim runs and can change nothing. Records are the JSON documents of
``shim.model.SandboxRecord``/``ContainerRecord``; they are read as plain mappings, so a record
written by another version of the shim still prints.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli import textout
from vmsandbox import states
from vmsandbox.adapters.ledger import SCHEMA_VERSION, read_claims
from vmsandbox.claims import Claim
from vmsandbox.errors import InfrastructureError, InvalidArgument, NotFound
from vmsandbox.host import format_cpulist

DB_NAME = "state.db"


@dataclass(frozen=True)
class SandboxView:
    """One sandbox as the state database holds it: its record, its claims and its containers."""

    id: str
    state: str
    created_ns: int
    record: Mapping[str, Any]
    claims: Claim = field(default_factory=Claim)
    containers: tuple[Mapping[str, Any], ...] = field(default=())


@contextmanager
def open_state(state_dir: str | Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection to ``state_dir/state.db``; errors say what is wrong with the path."""
    path = Path(state_dir) / DB_NAME
    if not path.is_file():
        raise NotFound(f"no state database at {path} (is the shim's state_dir {state_dir}? see --state-dir)")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10)
    except sqlite3.Error as exc:
        raise InfrastructureError(f"state database {path}: {exc}") from exc
    with closing(db):
        try:
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
        except sqlite3.Error as exc:
            raise InfrastructureError(f"state database {path}: {exc}") from exc
        if version > SCHEMA_VERSION:
            raise InfrastructureError(
                f"state database {path} has schema {version}, newer than this vmsandbox ({SCHEMA_VERSION})"
            )
        if version == 0:
            raise InfrastructureError(f"state database {path} is empty (the shim has not initialised it)")
        yield db


def claims(state_dir: str | Path) -> dict[str, Claim]:
    """What every sandbox holds right now, by sandbox id."""
    with open_state(state_dir) as db:
        try:
            return read_claims(db)
        except sqlite3.Error as exc:
            raise InfrastructureError(f"state database in {state_dir}: {exc}") from exc


def read_sandboxes(state_dir: str | Path) -> list[SandboxView]:
    """Every sandbox, oldest first, in one read transaction (a consistent snapshot)."""
    with open_state(state_dir) as db:
        try:
            db.execute("BEGIN")
            rows = db.execute("SELECT id, state, created_ns, record FROM sandboxes ORDER BY created_ns, id").fetchall()
            held = read_claims(db)
            kids: dict[str, list[Mapping[str, Any]]] = {}
            for owner, state, record in db.execute(
                "SELECT sandbox_id, state, record FROM containers ORDER BY created_ns, id"
            ):
                doc = json.loads(record)
                doc["state"] = state
                kids.setdefault(owner, []).append(doc)
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            raise InfrastructureError(f"state database in {state_dir}: {exc}") from exc
    return [
        SandboxView(
            id=sid,
            state=state,
            created_ns=created,
            record=json.loads(record),
            claims=held.get(sid, Claim()),
            containers=tuple(kids.get(sid, ())),
        )
        for sid, state, created, record in rows
    ]


def find(views: list[SandboxView], wanted: str) -> SandboxView:
    """The sandbox whose id is ``wanted`` or starts with it (as crictl accepts prefixes)."""
    if not wanted:
        raise InvalidArgument("sandbox id is empty")
    exact = [v for v in views if v.id == wanted]
    if exact:
        return exact[0]
    matches = [v for v in views if v.id.startswith(wanted)]
    if not matches:
        raise NotFound(f"no sandbox with id {wanted!r} (vmsandbox ls lists them)")
    if len(matches) > 1:
        ids = ", ".join(v.id[:16] for v in matches[:5])
        raise InvalidArgument(f"id prefix {wanted!r} is ambiguous: {len(matches)} sandboxes match ({ids})")
    return matches[0]


# -- rendering ------------------------------------------------------------------------------------
def _state_label(state: str) -> str:
    shown = {states.SANDBOX_READY: "READY", states.SANDBOX_NOTREADY: "NOTREADY", states.SANDBOX_CREATING: "CREATING"}
    return shown.get(state, state)


def _pod(record: Mapping[str, Any]) -> str:
    meta = record.get("meta") or {}
    return f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"


def _shape(record: Mapping[str, Any]) -> Mapping[str, Any]:
    shape = record.get("shape")
    return shape if isinstance(shape, Mapping) else {}


def _cpus(record: Mapping[str, Any]) -> str:
    cpus = record.get("cpus") or []
    if not cpus:
        return "-"
    text = format_cpulist(list(cpus))
    return f"shared:{text}" if _shape(record).get("cpu_policy") == "shared" else text


def _hugepages(record: Mapping[str, Any]) -> str:
    parts = [f"{count}x{textout.page_label(size)}@node{node}" for node, size, count in record.get("hugepages") or []]
    return ",".join(parts) or "-"


def _devices(record: Mapping[str, Any]) -> list[str]:
    devices = record.get("devices") or []
    return [
        f"group {d.get('iommu_group')} ({'+'.join(d.get('functions') or [])}, pool {d.get('pool')})"
        if isinstance(d, Mapping)
        else str(d)
        for d in devices
    ]


def view_doc(v: SandboxView, now_ns: int) -> dict[str, Any]:
    """The JSON of one sandbox for ``--format json``: the record plus what ``ls`` derives."""
    return {
        "id": v.id,
        "state": v.state,
        "created_ns": v.created_ns,
        "age_s": max(now_ns - v.created_ns, 0) // 1_000_000_000,
        "pod": _pod(v.record),
        "record": dict(v.record),
        "claims": claim_doc(v.claims),
        "containers": [dict(c) for c in v.containers],
    }


def claim_doc(claim: Claim) -> dict[str, Any]:
    """A claim as JSON: CPUs, PCI functions, hugepages and ordinary memory per node."""
    return {
        "cpus": list(claim.cpus),
        "pci": list(claim.pci),
        "hugepages": [{"node": n, "page_size": s, "pages": c} for n, s, c in claim.pages],
        "memory": [{"node": n, "bytes": b} for n, b in claim.memory],
    }


def render_ls(views: list[SandboxView], now_ns: int, *, full_ids: bool = False) -> str:
    if not views:
        return "no sandboxes"
    rows = []
    for v in views:
        r = v.record
        shape = _shape(r)
        rows.append(
            [
                v.id if full_ids else v.id[:13],
                _pod(r),
                _state_label(v.state),
                str(r.get("runtime_handler", "")),
                str(shape.get("vcpus", "-")),
                textout.size(int(shape["memory_bytes"])) if "memory_bytes" in shape else "-",
                _cpus(r),
                _hugepages(r),
                ",".join(_devices(r)) or "-",
                str(len(v.containers)),
                textout.age((now_ns - v.created_ns) / 1e9),
            ]
        )
    header = ["SANDBOX", "POD", "STATE", "HANDLER", "VCPUS", "MEMORY", "CPUS", "HUGEPAGES", "DEVICES", "CTRS", "AGE"]
    return textout.table(header, rows)


def _demand_text(demand: Mapping[str, Any]) -> str:
    parts = [f"cpu {demand.get('cpu_millis', 0)}m", f"memory {textout.size(int(demand.get('memory_bytes', 0)))}"]
    for page, amount in demand.get("hugepages") or []:
        parts.append(f"hugepages-{textout.page_label(page)} {textout.size(amount)}")
    for name, count in demand.get("extended") or []:
        parts.append(f"{name} {count}")
    return ", ".join(parts)


def shape_text(shape: Mapping[str, Any]) -> str:
    if not shape:
        return "-"
    page = int(shape.get("backing_page_size", 4096))
    backing = f"on {textout.page_label(page)} hugepages" if page > 4096 else "on ordinary 4Ki pages"
    memory = textout.size(int(shape["memory_bytes"]))
    text = f"{textout.plural(int(shape.get('vcpus', 0)), 'vCPU')} ({shape.get('cpu_policy')}), {memory} RAM {backing}"
    guest = [f"{count}x{textout.page_label(size)}" for size, count in shape.get("guest_hugepages") or []]
    if guest:
        text += f", guest hugepages {' '.join(guest)}"
    return text


def _guest_text(guest: Mapping[str, Any]) -> str:
    if not guest:
        return "no report (the guest has not said hello)"
    parts = [textout.plural(int(guest.get("vcpus", 0)), "vCPU"), f"MemTotal {guest.get('mem_total_kib')} KiB"]
    for size_kib, pool in sorted((guest.get("hugepages") or {}).items(), key=lambda kv: int(kv[0])):
        if isinstance(pool, Mapping) and pool.get("total"):
            parts.append(
                f"hugepages {pool.get('total')}x{textout.page_label(int(size_kib) * 1024)} ({pool.get('free')} free)"
            )
    parts.append(f"kernel {guest.get('kernel', '?')}")
    if guest.get("errors"):
        parts.append(f"errors: {'; '.join(map(str, guest['errors']))}")
    return ", ".join(parts)


def render_inspect(v: SandboxView, now_ns: int) -> str:
    r = v.record
    meta = r.get("meta") or {}
    shape = _shape(r)
    cpus = r.get("cpus") or []
    if shape.get("cpu_policy") == "exclusive" and cpus:
        pins = ", ".join(f"vCPU {i} -> CPU {c}" for i, c in enumerate(cpus))
    elif cpus:
        pins = f"vCPUs float over {format_cpulist(list(cpus))} (shared)"
    else:
        pins = "-"
    emulator = r.get("emulator_cpus") or []
    if emulator:
        pins += f"; emulator on {format_cpulist(list(emulator))}"
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(v.created_ns / 1e9))
    pairs = [
        ("sandbox", v.id),
        ("pod", f"{_pod(r)} (uid {meta.get('uid', '?')}, attempt {meta.get('attempt', 0)})"),
        ("state", f"{_state_label(v.state)}, created {created} ({textout.age((now_ns - v.created_ns) / 1e9)} ago)"),
        ("handler", f"{r.get('runtime_handler', '')} (profile {r.get('profile', '')}), accel {r.get('accel') or '?'}"),
        ("domain", str(r.get("domain", ""))),
        ("shape", shape_text(shape)),
        ("sized from", str((shape.get("demand") or {}).get("mode", "-"))),
        ("demand", _demand_text(shape.get("demand") or {}) if shape else "-"),
        ("cpus", pins),
        ("hugepages", _hugepages(r)),
        ("devices", ", ".join(_devices(r)) or "none"),
        ("guest", _guest_text(r.get("guest") or {})),
        ("boot", f"{r.get('boot_ms', 0)} ms" if r.get("boot_ms") else "-"),
        ("claims", v.claims.describe()),
    ]
    out = [textout.fields(pairs)]
    if v.containers:
        rows = [
            [
                str(c.get("name", "")),
                str(c.get("attempt", 0)),
                str(c.get("state", "")),
                str(c.get("id", ""))[:13],
                _resources_text(c.get("resources") or {}),
            ]
            for c in v.containers
        ]
        out.append("containers:")
        out.append(
            textout.table(["  NAME", "ATTEMPT", "STATE", "ID", "RESOURCES"], [["  " + r[0], *r[1:]] for r in rows])
        )
    else:
        out.append("containers: none")
    return "\n".join(out)


def _resources_text(res: Mapping[str, Any]) -> str:
    limits = res.get("limits") or {}
    requests = res.get("requests") or {}
    parts = [f"{k}={v}" for k, v in sorted(limits.items())]
    parts += [f"{k}={v} (request)" for k, v in sorted(requests.items()) if k not in limits]
    return " ".join(parts) or "-"
