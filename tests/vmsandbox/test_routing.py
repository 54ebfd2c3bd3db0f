"""Routing decisions of the CRI proxy (vmsandbox.routing) and the image list merge."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.proxy.split_images import merge_image_lists
from vmsandbox import routing
from vmsandbox.errors import InvalidArgument
from vmsandbox.routing import Side

A = "a" * 64
AB = "ab" + "0" * 62
B = "b" * 64


@pytest.mark.parametrize(
    ("handler", "side"),
    [
        ("vmsandbox", Side.LOCAL),
        ("small", Side.LOCAL),
        ("", Side.DOWNSTREAM),  # the default handler is the downstream's
        ("runc", Side.DOWNSTREAM),
        ("kata", Side.DOWNSTREAM),
    ],
)
def test_handler_decides_run_pod_sandbox(handler: str, side: Side) -> None:
    assert routing.side_for_handler(handler, {"vmsandbox", "small"}) == side


@pytest.mark.parametrize(
    ("prefix", "local", "downstream", "side"),
    [
        (A, [A], [], Side.LOCAL),
        (B, [], [B], Side.DOWNSTREAM),
        ("b", [A], [B], Side.DOWNSTREAM),
        ("a", [A], [B], Side.LOCAL),
        ("c", [A], [B], None),  # neither: the caller lists the downstream again, then asks vmsandbox
        ("a", [A, AB], [], Side.LOCAL),  # ambiguous on one side only: that side answers as it would
        (A, [A], ["a" * 63 + "b"], Side.LOCAL),  # an exact id wins
    ],
)
def test_route_id(prefix: str, local: list[str], downstream: list[str], side: Side | None) -> None:
    assert routing.route_id(prefix, local, downstream, "container").side == side


def test_a_prefix_matching_both_sides_is_invalid_argument_naming_both() -> None:
    with pytest.raises(InvalidArgument) as err:
        routing.route_id("a", [A], [AB], "pod sandbox")
    assert A[:16] in str(err.value) and AB[:16] in str(err.value)
    assert "vmsandbox" in str(err.value) and "downstream" in str(err.value)


@pytest.mark.parametrize(
    ("prefix", "local", "downstream", "side"),
    [
        ("", [A], [B], None),
        ("a", [A], [B], Side.LOCAL),
        ("b", [A], [B], Side.DOWNSTREAM),
        ("a", [A], [AB], None),  # both: each side filters
        ("c", [A], [B], None),
    ],
)
def test_list_filter_asks_the_one_side_it_can_match(
    prefix: str, local: list[str], downstream: list[str], side: Side | None
) -> None:
    assert routing.filter_side(prefix, local, downstream) == side


@given(
    st.lists(st.text("0123456789abcdef", min_size=64, max_size=64), max_size=5, unique=True),
    st.lists(st.text("0123456789abcdef", min_size=64, max_size=64), max_size=5, unique=True),
    st.text("0123456789abcdef", min_size=1, max_size=4),
)
def test_route_id_never_sends_an_id_to_a_side_without_it(local: list[str], downstream: list[str], prefix: str) -> None:
    try:
        side = routing.route_id(prefix, local, downstream, "container").side
    except InvalidArgument:
        assert any(i.startswith(prefix) for i in local) and any(i.startswith(prefix) for i in downstream)
        return
    if side == Side.LOCAL:
        assert any(i.startswith(prefix) for i in local)
    elif side == Side.DOWNSTREAM:
        assert any(i.startswith(prefix) for i in downstream)
    else:
        assert not any(i.startswith(prefix) for i in local + downstream)


ITEM = routing.ListedItem(id=A, pod_sandbox_id=B, state=1, labels=(("app", "web"), ("tier", "")))


@pytest.mark.parametrize(
    ("f", "matches"),
    [
        (routing.ListFilter(), True),  # no filter: everything
        (routing.ListFilter(id="aa"), True),  # ids by prefix
        (routing.ListFilter(id=A), True),
        (routing.ListFilter(id="ab"), False),
        (routing.ListFilter(pod_sandbox_id="bb"), True),
        (routing.ListFilter(pod_sandbox_id="a"), False),
        (routing.ListFilter(state=1), True),
        (routing.ListFilter(state=0), False),  # state 0 is a state (CREATED, SANDBOX_READY), not "any"
        (routing.ListFilter(labels=(("app", "web"),)), True),
        (routing.ListFilter(labels=(("tier", ""),)), True),  # an empty value is a value
        (routing.ListFilter(labels=(("app", "web"), ("tier", "x"))), False),  # every label must match
        (routing.ListFilter(labels=(("other", ""),)), False),  # a label it does not have
        (routing.ListFilter(id="a", state=1, labels=(("app", "web"),)), True),
        (routing.ListFilter(id="a", state=2), False),
    ],
)
def test_a_list_filter_matches_as_a_runtime_filters_its_own_list(f: routing.ListFilter, matches: bool) -> None:
    assert routing.list_matches(ITEM, f) == matches


@given(
    st.text("0123456789abcdef", max_size=4),
    st.one_of(st.none(), st.integers(0, 3)),
    st.dictionaries(st.sampled_from("abc"), st.sampled_from(["", "x"]), max_size=3),
    st.dictionaries(st.sampled_from("abc"), st.sampled_from(["", "x"]), max_size=3),
    st.integers(0, 3),
)
def test_a_narrower_filter_never_matches_more(
    prefix: str, state: int | None, selector: dict[str, str], labels: dict[str, str], item_state: int
) -> None:
    item = routing.ListedItem(id=A, pod_sandbox_id="", state=item_state, labels=tuple(labels.items()))
    narrow = routing.ListFilter(id=prefix, state=state, labels=tuple(selector.items()))
    if routing.list_matches(item, narrow):
        for wider in (
            routing.ListFilter(id=prefix, state=state),
            routing.ListFilter(id=prefix, labels=tuple(selector.items())),
            routing.ListFilter(state=state, labels=tuple(selector.items())),
        ):
            assert routing.list_matches(item, wider)


def test_every_cri_method_has_a_route() -> None:
    for service in ("RuntimeService",):
        for method in pb.DESCRIPTOR.services_by_name[service].methods:
            assert method.name in routing.METHODS, method.name


def test_image_lists_merge_by_id_keeping_unknown_fields() -> None:
    unknown = b"\xfa\x3e\x02hi"  # field 999: no CRI message has it
    shared = pb.Image(id="sha256:1", repo_tags=["busybox:latest"], size=10).SerializeToString() + unknown
    theirs = pb.ListImagesResponse.FromString(
        b"\x0a"
        + bytes([len(shared)])
        + shared
        + pb.ListImagesResponse(images=[pb.Image(id="sha256:2")]).SerializeToString()
    )
    mine = pb.ListImagesResponse(
        images=[
            pb.Image(id="sha256:1", repo_tags=["busybox:latest", "docker.io/library/busybox:latest"], pinned=True),
            pb.Image(id="sha256:3"),
        ]
    )
    merged = merge_image_lists(theirs, mine)
    assert [i.id for i in merged.images] == ["sha256:1", "sha256:2", "sha256:3"]
    first = merged.images[0]
    assert list(first.repo_tags) == ["busybox:latest", "docker.io/library/busybox:latest"]
    assert first.pinned and first.size == 10
    assert unknown in merged.SerializeToString()  # the downstream's unknown field survives the merge


def test_concatenated_list_replies_are_the_union() -> None:
    """The proxy merges list replies by concatenating their bytes: protobuf appends repeated fields."""
    theirs = pb.ListContainersResponse(containers=[pb.Container(id=B)]).SerializeToString() + b"\xfa\x3e\x00"
    mine = pb.ListContainersResponse(containers=[pb.Container(id=A)]).SerializeToString()
    merged = pb.ListContainersResponse.FromString(theirs + mine)
    assert [c.id for c in merged.containers] == [B, A]


@pytest.mark.parametrize(
    ("name", "repo"),
    [
        ("busybox", "busybox"),
        ("docker.io/library/busybox:1.36", "docker.io/library/busybox"),
        ("127.0.0.1:5000/a/b:1", "127.0.0.1:5000/a/b"),
        ("127.0.0.1:5000/a/b", "127.0.0.1:5000/a/b"),
        ("reg:5000/a/b@sha256:" + "0" * 64, "reg:5000/a/b"),
        ("reg/a:tag@sha256:" + "0" * 64, "reg/a"),
    ],
)
def test_repository_of_an_image_name(name: str, repo: str) -> None:
    assert routing.repository(name) == repo


@pytest.mark.parametrize(
    ("digests", "tags", "named", "source"),
    [
        (["r/a@sha256:1"], ["r/a:1"], "", "r/a@sha256:1"),  # the digest names exactly that manifest
        (["r/a@sha256:1"], ["r/a:1"], "sha256:c0ffee", "r/a@sha256:1"),  # the kubelet names the id
        ([], ["r/a:1", "r/a:2"], "", "r/a:1"),
        ([], [], "", None),
        ([""], [""], "", None),
        # a container naming one of its tags gets it by that tag, so the store knows that name
        (["reg.io/a@sha256:1"], ["reg.io/a:1", "reg.io/a:2"], "reg.io/a:2", "reg.io/a:2"),
        (["r/a@sha256:1"], ["r/a:1"], "r/a:3", "r/a@sha256:1"),  # not a tag of it: by digest
        # names compare normalised: no tag is `latest`, a short name is docker.io's
        (["reg.io/a@sha256:1"], ["reg.io/a:latest"], "reg.io/a", "reg.io/a:latest"),
        (
            ["docker.io/library/busybox@sha256:1"],
            ["docker.io/library/busybox:1"],
            "busybox:1",
            "docker.io/library/busybox:1",
        ),
        (["r/a@sha256:1"], ["r/a:1"], "r/a@sha256:1", "r/a@sha256:1"),
    ],
)
def test_an_image_is_copied_by_its_digest_before_its_tag(
    digests: list[str], tags: list[str], named: str, source: str | None
) -> None:
    assert routing.copy_source(digests, tags, named) == source


# ---- the front's table (front/route.go) and this one agree -------------------------------------

_GO_ENTRY = re.compile(r'^\s*(runtimeService|imageService) \+ "(\w+)":\s*\{(.*)\},\s*$', re.M)
_GO_PATHS = {"byID", "mergedList", "cachedAnswer", "viaShim"}


def go_methods(source: str) -> dict[str, dict[str, str]]:
    """The entries of the ``methods`` map in front/route.go: method name -> its fields as written."""
    table = source[source.index("var methods = map[string]method{") :]
    table = table[: table.index("\n}\n")]
    out = {}
    for service, name, body in _GO_ENTRY.findall(table):
        assert service == "runtimeService", f"{name}: the front routes only RuntimeService calls by table"
        fields = dict(part.split(":", 1) for part in re.split(r",\s*(?![^{]*\})", body.strip()) if part)
        out[name] = {k.strip(): v.strip() for k, v in fields.items()}
    return out


def disagreements(go: dict[str, dict[str, str]], methods: dict[str, routing.Kind]) -> list[str]:
    """What the front's table says of a method that the shim's does not."""
    wrong = []
    kinds = {"sandboxID": routing.Kind.SANDBOX, "containerID": routing.Kind.CONTAINER}
    for name, f in sorted(go.items()):
        path = f.get("path", "viaShim")
        kind = methods.get(name)
        if path not in _GO_PATHS or kind is None:
            wrong.append(f"{name}: path {path}, shim kind {kind}")
        elif path == "byID" and kind != kinds.get(f.get("kind", "sandboxID")):
            wrong.append(f"{name}: the front sends it by a {f.get('kind', 'sandboxID')}, the shim routes it {kind}")
        elif path == "mergedList" and kind != routing.Kind.MERGE:
            wrong.append(f"{name}: the front merges it, the shim routes it {kind}")
        elif path == "cachedAnswer" and kind != routing.Kind.LOCAL:
            wrong.append(f"{name}: the front keeps vmsandbox's answer, the shim routes it {kind}")
        elif f.get("forgets") == "true" and kind != kinds.get(f.get("kind", "sandboxID")):
            wrong.append(f"{name}: the front forgets a {f.get('kind', 'sandboxID')} on it, the shim routes it {kind}")
    return wrong


def test_the_fronts_route_table_agrees_with_the_shims() -> None:
    go = go_methods((Path(__file__).resolve().parents[2] / "front" / "route.go").read_text())
    assert {"ContainerStatus", "PodSandboxStatus", "ListContainers", "Version", "RemovePodSandbox"} <= set(go)
    assert disagreements(go, routing.METHODS) == []


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ContainerStatus", routing.Kind.SANDBOX),  # the front would route a container id as a sandbox's
        ("ListContainers", routing.Kind.CONTAINER),
        ("Version", routing.Kind.DOWNSTREAM),
        ("RemovePodSandbox", routing.Kind.CONTAINER),
    ],
)
def test_the_agreement_test_fails_when_the_tables_differ(name: str, kind: routing.Kind) -> None:
    go = go_methods((Path(__file__).resolve().parents[2] / "front" / "route.go").read_text())
    assert disagreements(go, {**routing.METHODS, name: kind})
