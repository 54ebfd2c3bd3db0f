"""shim.dra.ipam, and NodePrepareResources / NodeUnprepareResources with it: CNI host-local (the
host's own plugin when it is installed, else a fake of its allocation files) gives a claimed device
without static addresses its address at prepare, kept in the claim's record; unprepare DELs it
once; a prepare cut short (its record ``adding``) and allocations no prepared claim holds are
DELeted at start; a failed ADD or DEL leaves nothing, or keeps the record for the next try."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gen.kubelet.dra.v1 import api_pb2 as dra_pb
from shim.dra.ipam import HostLocal
from shim.dra.plugin import DraService
from shim.dra.store import ClaimStore
from tests.shim.dra.test_plugin import NODE, POD, FakeApi, claim_json
from vmsandbox import dra_ipam
from vmsandbox.adapters import cni_exec
from vmsandbox.cni import CniError
from vmsandbox.dra import IPAM_ADDED, IPAM_ADDING, DraConfig, NetworkAttachment, PreparedClaim

LAN = NetworkAttachment("lan", "bridge", "br-lan", "192.168.50.0/24", range_start="192.168.50.100")
REAL = Path("/usr/lib/cni/host-local")


class FakeHostLocal:
    """host-local's ADD and DEL on its files: the next free address of the range, one file each."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.fail: set[str] = set()

    def __call__(
        self, kind: str, stdin: bytes, env: Mapping[str, str], bin_dirs: Sequence[str], *, want_result: bool
    ) -> dict[str, Any] | None:
        command, container, ifname = env["CNI_COMMAND"], env["CNI_CONTAINERID"], env["CNI_IFNAME"]
        self.calls.append((command, container, ifname))
        if command in self.fail:
            raise CniError(f"CNI plugin host-local {command} failed: injected")
        conf = json.loads(stdin)
        directory = Path(conf["ipam"]["dataDir"]) / conf["name"]
        directory.mkdir(parents=True, exist_ok=True)
        mine = f"{container}\r\n{ifname}".encode()
        if command == "DEL":
            for f in directory.iterdir():
                if f.read_bytes() == mine:
                    f.unlink()
            return None
        start = int(conf["ipam"]["ranges"][0][0]["rangeStart"].rsplit(".", 1)[1])
        n = next(i for i in range(start, 255) if not (directory / f"192.168.50.{i}").exists())
        (directory / f"192.168.50.{n}").write_bytes(mine)
        return {"cniVersion": "1.0.0", "ips": [{"address": f"192.168.50.{n}/24"}]}


@pytest.fixture(params=["fake", "host-local"])
def runner(request: pytest.FixtureRequest) -> Any:
    if request.param == "fake":
        return FakeHostLocal()
    if not REAL.is_file():
        pytest.skip("no CNI host-local plugin on this host")
    return cni_exec.run_plugin


def service(tmp: Path, run: Any) -> tuple[FakeApi, ClaimStore, HostLocal, DraService]:
    config = DraConfig(kubeconfig="/unused", networks=(LAN,))
    api = FakeApi()
    store = ClaimStore(tmp / "claims")
    ipam = HostLocal(config.networks, tmp / "ipam", [str(REAL.parent)], run)
    return api, store, ipam, DraService(config, NODE, store, api, ipam=ipam)


def prepare(svc: DraService, *uids: str) -> dra_pb.NodePrepareResourcesResponse:
    claims = [dra_pb.Claim(namespace="ns", name=f"c-{u}", uid=u) for u in uids]
    return svc.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(claims=claims), None)  # type: ignore[arg-type]


def unprepare(svc: DraService, *uids: str) -> dra_pb.NodeUnprepareResourcesResponse:
    claims = [dra_pb.Claim(namespace="ns", name=f"c-{u}", uid=u) for u in uids]
    return svc.NodeUnprepareResources(dra_pb.NodeUnprepareResourcesRequest(claims=claims), None)  # type: ignore[arg-type]


def stored(store: ClaimStore, uid: str) -> PreparedClaim:
    got = store.get(uid)
    assert got is not None
    return got


def files(ipam: HostLocal) -> list[str]:
    return sorted(a.address for a in ipam.allocations())


def with_config(uid: str, parameters: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(claim_json(uid, f"c-{uid}"))
    doc["status"]["allocation"]["devices"]["config"] = [
        {"source": "FromClaim", "opaque": {"driver": "vmsandbox.dev", "parameters": parameters}}
    ]
    return doc


def test_prepare_allocates_unprepare_releases(tmp_path: Path, runner: Any) -> None:
    api, store, ipam, svc = service(tmp_path, runner)
    api.claims[("ns", "c-u1")] = with_config("u1", {"interfaceName": "net1"})
    api.claims[("ns", "c-u2")] = claim_json("u2", "c-u2")  # no name: CNI_IFNAME dra0
    api.claims[("ns", "c-u3")] = with_config("u3", {"addresses": ["192.168.50.7/24"]})  # static: no host-local
    reply = prepare(svc, "u1", "u2", "u3")
    assert {u: c.error for u, c in reply.claims.items()} == {"u1": "", "u2": "", "u3": ""}
    got = {c.uid: (c.ipam, c.devices[0].allocated) for c in store.all()}
    assert got == {
        "u1": (IPAM_ADDED, ("192.168.50.100/24",)),
        "u2": (IPAM_ADDED, ("192.168.50.101/24",)),
        "u3": ("", ()),
    }
    assert files(ipam) == ["192.168.50.100", "192.168.50.101"]
    owners = {(a.container_id, a.ifname) for a in ipam.allocations()}
    assert owners == {("dra-u1-0", "net1"), ("dra-u2-0", "dra0")}
    # the record on disk says so too, and a restart reads it back
    assert ClaimStore(tmp_path / "claims").get("u1") == store.get("u1")
    assert prepare(svc, "u1").claims["u1"].error == ""  # prepared already: from the store, no ADD again
    assert files(ipam) == ["192.168.50.100", "192.168.50.101"]

    assert {u: c.error for u, c in unprepare(svc, "u1", "u3").claims.items()} == {"u1": "", "u3": ""}
    assert files(ipam) == ["192.168.50.101"] and [c.uid for c in store.all()] == ["u2"]
    assert unprepare(svc, "u1").claims["u1"].error == ""  # not prepared: nothing to DEL
    if isinstance(runner, FakeHostLocal):
        assert [c for c in runner.calls if c[1] == "dra-u1-0"] == [
            ("ADD", "dra-u1-0", "net1"),
            ("DEL", "dra-u1-0", "net1"),
        ]
    unprepare(svc, "u2")
    assert files(ipam) == [] and store.all() == []


def test_a_failed_add_leaves_nothing(tmp_path: Path) -> None:
    run = FakeHostLocal()
    run.fail.add("ADD")
    api, store, ipam, svc = service(tmp_path, run)
    api.claims[("ns", "c-u1")] = claim_json("u1", "c-u1")
    assert "host-local ADD failed: injected" in prepare(svc, "u1").claims["u1"].error
    assert store.all() == [] and files(ipam) == []
    assert run.calls[-1] == ("DEL", "dra-u1-0", "dra0")


def test_a_failed_del_keeps_the_record_for_the_next_unprepare(tmp_path: Path) -> None:
    run = FakeHostLocal()
    api, store, ipam, svc = service(tmp_path, run)
    api.claims[("ns", "c-u1")] = claim_json("u1", "c-u1")
    prepare(svc, "u1")
    run.fail.add("DEL")
    assert "host-local DEL" in unprepare(svc, "u1").claims["u1"].error
    assert [c.uid for c in store.all()] == ["u1"] and files(ipam) == ["192.168.50.100"]
    run.fail.clear()
    assert unprepare(svc, "u1").claims["u1"].error == ""
    assert store.all() == [] and files(ipam) == []


def test_start_deletes_a_cut_short_prepare_and_stray_allocations(tmp_path: Path, runner: Any) -> None:
    api, store, ipam, svc = service(tmp_path, runner)
    for uid in ("kept", "cut", "gone"):
        api.claims[("ns", f"c-{uid}")] = claim_json(uid, f"c-{uid}")
    prepare(svc, "kept", "cut", "gone")
    assert len(files(ipam)) == 3
    store.put(replace(stored(store, "cut"), ipam=IPAM_ADDING))  # a prepare killed after its ADD
    (tmp_path / "claims" / "gone.json").unlink()  # a claim forgotten, its DEL never run
    # someone else's allocation in the same directory is not ours to release
    (tmp_path / "ipam" / "lan" / "192.168.50.200").write_bytes(b"other-container\r\neth0")
    os.symlink("/etc/passwd", tmp_path / "ipam" / "lan" / "192.168.50.201")  # never followed

    store = ClaimStore(tmp_path / "claims")
    ipam.reconcile(store)
    assert [c.uid for c in store.all()] == ["kept"]
    assert files(ipam) == ["192.168.50.100", "192.168.50.200"]
    assert ClaimStore(tmp_path / "claims").all() == store.all()


def test_a_prepare_retried_after_a_cut_short_one_adds_afresh(tmp_path: Path, runner: Any) -> None:
    api, store, ipam, svc = service(tmp_path, runner)
    api.claims[("ns", "c-u1")] = claim_json("u1", "c-u1")
    prepare(svc, "u1")
    store.put(replace(stored(store, "u1"), ipam=IPAM_ADDING))
    assert prepare(svc, "u1").claims["u1"].error == ""  # host-local refuses a second ADD: DEL came first
    again = stored(store, "u1")
    assert again.ipam == IPAM_ADDED and files(ipam) == [again.devices[0].allocated[0].split("/")[0]]


def test_container_ids_are_the_claims() -> None:
    assert dra_ipam.claim_of(dra_ipam.container_id("9d7c0a4e-0000-4000-8000-000000000001", 3)) == (
        "9d7c0a4e-0000-4000-8000-000000000001"
    )
    assert dra_ipam.claim_of("k8s-pod-sandbox") is None
    assert POD  # the claims are reserved for this pod


def test_a_network_no_longer_configured_has_its_files_removed(tmp_path: Path) -> None:
    """host-local needs the network's config to DEL: the driver's own files go instead (others' stay)."""
    run = FakeHostLocal()
    api, store, ipam, svc = service(tmp_path, run)
    api.claims[("ns", "c-u1")] = claim_json("u1", "c-u1")
    prepare(svc, "u1")
    (tmp_path / "ipam" / "lan" / "192.168.50.200").write_bytes(b"other-container\r\neth0")
    (tmp_path / "claims" / "u1.json").unlink()
    store = ClaimStore(tmp_path / "claims")
    calls = len(run.calls)
    HostLocal((), tmp_path / "ipam", [str(REAL.parent)], run).reconcile(store)
    assert len(run.calls) == calls  # no plugin run
    assert files(ipam) == ["192.168.50.200"]
