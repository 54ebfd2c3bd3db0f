"""The pure decisions of ``cli.teardown``: which sandbox goes first, which domain is an orphan,
which recorded pod network links and namespaces a stopped shim's state lets it delete."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli.teardown import Outcome, orphaned, owned_by, removal_order, remove_state_networks
from vmsandbox.adapters import netns
from vmsandbox.adapters.hypervisor import DomainInfo
from vmsandbox.domain import METADATA_NS


def test_the_states_own_sandboxes_go_first_and_unlisted_ones_are_not_forgotten() -> None:
    listed = [("plain1", "ns/plain1"), ("vm1", "ns/vm1"), ("plain2", "ns/plain2"), ("vm2", "ns/vm2")]
    order = removal_order(listed, {"vm1", "vm2", "vm3"})
    assert order == [
        ("vm1", "ns/vm1"),
        ("vm2", "ns/vm2"),
        ("vm3", "not listed"),
        ("plain1", "ns/plain1"),
        ("plain2", "ns/plain2"),
    ]


def test_a_failed_list_still_removes_the_states_sandboxes_by_id() -> None:
    assert removal_order([], {"b", "a"}) == [("a", "not listed"), ("b", "not listed")]


def _domain(name: str, shared: tuple[str, ...], owner: str = "o1", state: str = "") -> DomainInfo:
    sources = "".join(f"<filesystem><source dir='{d}'/></filesystem>" for d in shared)
    meta = (
        f"<metadata><v:sandbox xmlns:v='{METADATA_NS}' id='{name}'><v:owner>{owner}</v:owner>"
        + (f"<v:state>{state}</v:state>" if state else "")
        + "</v:sandbox></metadata>"
    )
    xml = f"<domain>{meta}<devices>{sources}</devices></domain>"
    return DomainInfo(name=name, sandbox_id=name, active=True, xml=xml, owner=owner)


def test_a_domain_is_an_orphan_when_the_state_its_metadata_names_is_gone() -> None:
    gone = _domain("vmsandbox-a", ("/live/sandboxes/a/shared",), state="/gone")
    alive = _domain("vmsandbox-b", ("/gone/sandboxes/b/shared",), state="/live")
    snapshot = _domain("vmsnapshot-c", (), state="/gone")
    found = orphaned([gone, alive, snapshot], exists=lambda p: p.startswith("/live/"))
    assert [d.name for d in found] == ["vmsandbox-a", "vmsnapshot-c"]


def test_without_a_state_in_its_metadata_a_domain_is_an_orphan_when_none_of_its_shares_exists() -> None:
    gone = _domain("vmsandbox-a", ("/gone/sandboxes/a/shared",))
    alive = _domain("vmsandbox-b", ("/live/sandboxes/b/shared",))
    half = _domain("vmsnapshot-c", ("/gone/x", "/live/y"))
    snapshot_gone = _domain("vmsnapshot-d", ("/gone/snapshots/making/d/share/0",))
    nothing_shared = _domain("vmsandbox-e", ())
    not_ours = _domain("other-f", ("/gone/f",))
    domains = [gone, alive, half, snapshot_gone, nothing_shared, not_ours]
    found = orphaned(domains, exists=lambda p: p.startswith("/live/"))
    assert [d.name for d in found] == ["vmsandbox-a", "vmsnapshot-d"]


def test_owned_by_takes_the_states_domains_only() -> None:
    mine, theirs, old = (
        _domain("vmsandbox-a", (), "o1"),
        _domain("vmsandbox-b", (), "o2"),
        _domain("vmsandbox-c", (), ""),
    )
    assert owned_by([mine, theirs, old], "o1") == [mine]
    assert owned_by([mine, theirs, old], "") == []


def test_outcomes_add_up() -> None:
    assert Outcome(("a",), ("x",)) + Outcome(("b",), ()) == Outcome(("a", "b"), ("x",))


SID = "ab" * 32


def _networks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: dict[str, str]) -> tuple[Path, list[str]]:
    state = tmp_path / "state"
    (state / "network").mkdir(parents=True)
    for name, text in records.items():
        (state / "network" / name).write_text(text)
    calls: list[str] = []
    monkeypatch.setattr(netns, "delete_link", lambda name: calls.append(f"link {name}"))
    monkeypatch.setattr(netns, "delete", lambda path: calls.append(f"netns {path}"))
    return state, calls


@pytest.mark.parametrize(
    ("doc", "deleted"),
    [
        # the shim's own namespace: its macvtap, then the namespace
        ({"macvtap": f"vmt{SID[:12]}", "netns": f"/run/netns/vmsandbox-{SID}"},
         [f"link vmt{SID[:12]}", f"netns /run/netns/vmsandbox-{SID}"]),
        # a namespace its caller gave stays: only the macvtap goes
        ({"macvtap": f"vmt{SID[:12]}", "netns": "/var/run/netns/cni-1", "owner": "caller"}, [f"link vmt{SID[:12]}"]),
        # a namespace that is not the sandbox's own name is never deleted
        ({"macvtap": f"vmt{SID[:12]}", "netns": "/etc/passwd"}, [f"link vmt{SID[:12]}"]),
        # a record written before the macvtap was named
        ({"netns": f"/run/netns/vmsandbox-{SID}"}, [f"netns /run/netns/vmsandbox-{SID}"]),
    ],
)  # fmt: skip
def test_a_stopped_shims_pod_networks_go_with_their_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, doc: dict[str, str], deleted: list[str]
) -> None:
    state, calls = _networks(tmp_path, monkeypatch, {f"{SID}.json": json.dumps(doc)})
    outcome = remove_state_networks(state)
    assert calls == deleted
    assert outcome.problems == ()
    assert outcome.done == (f"removed the pod network of {SID[:12]} (state {state})",)
    assert not (state / "network" / f"{SID}.json").exists()


@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        (f"{SID}.json", json.dumps({"macvtap": "eth0", "netns": f"/run/netns/x-{SID}"}), "names the link 'eth0'"),
        (f"{SID}.json", "{not json", "Expecting property name"),
        (f"{SID}.json", "[]", "not a JSON object"),
        ("not-a-sandbox.json", json.dumps({"macvtap": "vmtnot-a-sandb"}), "not a pod network record"),
    ],
)  # fmt: skip
def test_a_damaged_record_removes_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str, why: str
) -> None:
    state, calls = _networks(tmp_path, monkeypatch, {name: text})
    outcome = remove_state_networks(state)
    assert calls == []
    (problem,) = outcome.problems
    assert why in problem
    assert (state / "network" / name).exists()


def test_a_record_that_is_not_a_regular_file_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state, calls = _networks(tmp_path, monkeypatch, {})
    os.mkfifo(state / "network" / f"{SID}.json")  # reading it would wait for a writer
    assert "not a pod network record" in remove_state_networks(state).problems[0]
    assert calls == []


def test_a_linked_record_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state, calls = _networks(tmp_path, monkeypatch, {})
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"macvtap": f"vmt{SID[:12]}"}))
    (state / "network" / f"{SID}.json").symlink_to(target)
    assert "not a pod network record" in remove_state_networks(state).problems[0]
    assert calls == []


def test_a_state_without_network_records_has_nothing_to_remove(tmp_path: Path) -> None:
    assert remove_state_networks(tmp_path) == Outcome()
