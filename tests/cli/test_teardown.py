"""The pure decisions of ``cli.teardown``: which sandbox goes first, which domain is an orphan."""

from __future__ import annotations

from cli.teardown import Outcome, orphaned, owned_by, removal_order
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
