"""``vmsandbox ls`` / ``inspect`` on a state database written by the real ``Ledger`` with the shim's
record types, read through the real entry point: read-only, and while a writer holds the database."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import yaml

from shim.model import CONTAINER_CREATED, ContainerRecord, PodMeta, SandboxRecord
from tests.cli.vmsandbox_cmd import vmsandbox, vmsandbox_json
from vmsandbox import record_docs
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.claims import Claim
from vmsandbox.sizing import PodDemand, VmShape

MI = 1 << 20
READY_ID = "3f2a" + "1" * 60
STOPPED_ID = "3f2b" + "2" * 60
CREATING_ID = "9c00" + "3" * 60


@dataclass(frozen=True)
class State:
    dir: Path
    created_ns: int


def _shape(vcpus: int, memory: int, page: int, policy: Literal["exclusive", "shared"]) -> VmShape:
    return VmShape(
        vcpus=vcpus,
        memory_bytes=memory,
        backing_page_size=page,
        guest_hugepages=((2 * MI, 16),) if policy == "exclusive" else (),
        cpu_policy=policy,
        demand=PodDemand(cpu_millis=1500, memory_bytes=192 * MI, hugepages=((2 * MI, 32 * MI),)),
    )


@pytest.fixture
def state(tmp_path: Path) -> Iterator[State]:
    created = time.time_ns() - 300 * 10**9
    ledger = Ledger(tmp_path / "state.db")
    ready = SandboxRecord(
        id=READY_ID,
        meta=PodMeta(name="web", namespace="shop", uid="u-1"),
        state="SANDBOX_READY",
        created_ns=created,
        runtime_handler="vmsandbox",
        profile="vmsandbox",
        domain="vmsandbox-" + READY_ID[:32],
        shape=_shape(2, 288 * MI, 2 * MI, "exclusive"),
        cpus=(2, 3),
        emulator_cpus=(2, 3),
        hugepages=((0, 2 * MI, 144),),
        guest={
            "agent": "vmsandbox-init/1",
            "kernel": "6.1.0-18-amd64",
            "vcpus": 2,
            "mem_total_kib": 230000,
            "hugepages": {"2048": {"total": 16, "free": 16}},
            "cmdline": "console=ttyS0",
            "boot_ms": 900,
        },
        accel="tcg",
        boot_ms=3100,
    )
    stopped = SandboxRecord(
        id=STOPPED_ID,
        meta=PodMeta(name="batch", namespace="jobs", uid="u-2"),
        state="SANDBOX_NOTREADY",
        created_ns=created + 1,
        runtime_handler="shared",
        profile="shared",
        domain="vmsandbox-" + STOPPED_ID[:32],
        shape=_shape(1, 256 * MI, 4096, "shared"),
        cpus=(0, 1, 2, 3, 4, 5, 6, 7),
    )
    creating = SandboxRecord(
        id=CREATING_ID,
        meta=PodMeta(name="new", namespace="shop", uid="u-3"),
        state="creating",
        created_ns=created + 2,
        runtime_handler="vmsandbox",
        profile="vmsandbox",
        domain="vmsandbox-" + CREATING_ID[:32],
    )
    for r in (ready, stopped, creating):
        ledger.put_sandbox(r.id, r.state, r.created_ns, r.to_doc())
    ledger.claim(
        READY_ID, Claim(cpus=(2, 3), pages=((0, 2 * MI, 144),)), page_limits={(0, 2 * MI): 144}, memory_limits={}
    )
    for i, name in enumerate(("web", "cache")):
        c = ContainerRecord(
            id=f"c{i}" + "0" * 62,
            sandbox_id=READY_ID,
            name=name,
            attempt=0,
            state=CONTAINER_CREATED,
            created_ns=created + 10 + i,
            resources=record_docs.resources_from_doc(
                {"requests": {"cpu": "1"}, "limits": {"cpu": "1", "memory": "128Mi"}}, "test"
            ),
        )
        ledger.put_container(c.id, c.sandbox_id, c.name, c.attempt, c.state, c.created_ns, c.to_doc())
    ledger.close()
    yield State(tmp_path, created)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_ls_text(state: State) -> None:
    before = digest(state.dir / "state.db")
    done = vmsandbox("ls", "--state-dir", state.dir)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == [
        "SANDBOX", "POD", "STATE", "HANDLER", "VCPUS", "MEMORY", "CPUS", "HUGEPAGES", "DEVICES", "CTRS", "AGE",
    ]  # fmt: skip
    assert [r.split() for r in rows] == [
        [READY_ID[:13], "shop/web", "READY", "vmsandbox", "2", "288Mi", "2-3", "144x2Mi@node0", "-", "2", "5m"],
        [STOPPED_ID[:13], "jobs/batch", "NOTREADY", "shared", "1", "256Mi", "shared:0-7", "-", "-", "0", "5m"],
        [CREATING_ID[:13], "shop/new", "CREATING", "vmsandbox", "-", "-", "-", "-", "-", "0", "5m"],
    ]
    assert digest(state.dir / "state.db") == before  # read-only


def test_ls_json_and_full_ids(state: State) -> None:
    code, doc = vmsandbox_json("ls", "--state-dir", state.dir)
    assert code == 0
    assert [d["id"] for d in doc] == [READY_ID, STOPPED_ID, CREATING_ID]
    ready = doc[0]
    assert ready["pod"] == "shop/web" and ready["state"] == "SANDBOX_READY"
    assert ready["record"]["cpus"] == [2, 3] and ready["record"]["guest"]["vcpus"] == 2
    assert ready["claims"] == {
        "cpus": [2, 3],
        "pci": [],
        "hugepages": [{"node": 0, "page_size": 2 * MI, "pages": 144}],
        "memory": [],
    }
    assert [c["name"] for c in ready["containers"]] == ["web", "cache"]
    assert 299 <= ready["age_s"] < 400
    full = vmsandbox("ls", "--state-dir", state.dir, "--no-trunc")
    assert READY_ID in full.stdout


def test_inspect_text(state: State) -> None:
    done = vmsandbox("inspect", "3f2a", "--state-dir", state.dir)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    expected = [
        f"sandbox     {READY_ID}",
        "pod         shop/web (uid u-1, attempt 0)",
        "handler     vmsandbox (profile vmsandbox), accel tcg",
        "shape       2 vCPUs (exclusive), 288Mi RAM on 2Mi hugepages, guest hugepages 16x2Mi",
        "sized from  declared",
        "demand      cpu 1500m, memory 192Mi, hugepages-2Mi 32Mi",
        "cpus        vCPU 0 -> CPU 2, vCPU 1 -> CPU 3; emulator on 2-3",
        "hugepages   144x2Mi@node0",
        "devices     none",
        "guest       2 vCPUs, MemTotal 230000 KiB, hugepages 16x2Mi (16 free), kernel 6.1.0-18-amd64",
        "boot        3100 ms",
        "claims      2 CPUs, 144 hugepages",
        "containers:",
    ]
    for line in expected:
        assert line in lines, (line, lines)
    assert any(line.split()[:3] == ["web", "0", "CONTAINER_CREATED"] for line in lines)
    assert any("cpu=1 memory=128Mi" in line for line in lines)


def test_inspect_json(state: State) -> None:
    code, doc = vmsandbox_json("inspect", STOPPED_ID, "--state-dir", state.dir)
    assert code == 0
    assert (
        doc["id"] == STOPPED_ID
        and doc["claims"] == {"cpus": [], "pci": [], "hugepages": [], "memory": []}
        and doc["record"]["shape"]["cpu_policy"] == "shared"
    )


@pytest.mark.parametrize(
    "wanted,code,message",
    [
        pytest.param("3f2", 2, "id prefix '3f2' is ambiguous: 2 sandboxes match", id="ambiguous"),
        pytest.param("ffff", 1, "no sandbox with id 'ffff'", id="unknown"),
    ],
)
def test_inspect_errors(state: State, wanted: str, code: int, message: str) -> None:
    done = vmsandbox("inspect", wanted, "--state-dir", state.dir)
    assert done.returncode == code
    assert message in done.stderr


def test_reads_beside_a_writer(state: State) -> None:
    """The shim holds the database open and writes; ls still answers, with what is committed."""
    writer = sqlite3.connect(state.dir / "state.db", isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO claims(key, sandbox_id) VALUES ('cpu:9', ?)", (READY_ID,))
        started = time.monotonic()
        code, doc = vmsandbox_json("ls", "--state-dir", state.dir)
        assert code == 0 and time.monotonic() - started < 10
        assert 9 not in doc[0]["claims"]["cpus"]
        writer.execute("COMMIT")
        code, doc = vmsandbox_json("ls", "--state-dir", state.dir)
        assert 9 in doc[0]["claims"]["cpus"]
    finally:
        writer.close()


def test_state_dir_from_config_and_missing_database(tmp_path: Path, state: State) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(state.dir)}))
    assert vmsandbox("ls", "--config", config).stdout.count("shop/") == 2
    done = vmsandbox("ls", "--state-dir", tmp_path / "nowhere")
    assert done.returncode == 1
    assert f"no state database at {tmp_path / 'nowhere' / 'state.db'}" in done.stderr


def test_empty_state(tmp_path: Path) -> None:
    Ledger(tmp_path / "state.db").close()
    done = vmsandbox("ls", "--state-dir", tmp_path)
    assert (done.returncode, done.stdout) == (0, "no sandboxes\n")
    assert vmsandbox_json("ls", "--state-dir", tmp_path) == (0, [])
