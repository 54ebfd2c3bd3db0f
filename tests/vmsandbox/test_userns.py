"""A pod's user namespace (vmsandbox.userns): the checks of its mappings, the ids it shifts, the
record document, and the agreement of a container's namespace with its pod's."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vmsandbox import userns
from vmsandbox.errors import InvalidArgument
from vmsandbox.kubelet_volumes import Entry, Meta, VolumeTree, shifted
from vmsandbox.userns import IdMapping, UserNamespace


@dataclass
class Wire:
    """An IDMapping as the CRI's message has it."""

    container_id: int
    host_id: int
    length: int


KUBELET = UserNamespace((IdMapping(0, 65536, 65536),), (IdMapping(0, 65536, 65536),))


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([Wire(0, 65536, 65536)], (IdMapping(0, 65536, 65536),)),  # what a kubelet sends
        (
            [Wire(1000, 300000, 10), Wire(0, 200000, 1000)],  # adjacent container ranges do not overlap
            (IdMapping(1000, 300000, 10), IdMapping(0, 200000, 1000)),
        ),
        ([Wire(0, 0, (1 << 32) - 1)], (IdMapping(0, 0, (1 << 32) - 1),)),  # the whole id space but 2^32-1
    ],
)
def test_valid_mappings(items: list[Wire], expected: tuple[IdMapping, ...]) -> None:
    assert userns.mappings(items, "uids") == expected


@pytest.mark.parametrize(
    ("items", "problem"),
    [
        ([], r"uids is empty"),
        ([Wire(0, 65536, 0)], r"uids\[0\]\.length is 0"),
        ([Wire(0, (1 << 32) - 10, 10)], r"uids\[0\]: host_id .* passes the last id"),
        ([Wire((1 << 32) - 1, 0, 1)], r"uids\[0\]: container_id .* passes the last id"),
        ([Wire(0, 65536, 100), Wire(50, 300000, 10)], r"uids\[0\] and \[1\]: their container_id ranges overlap"),
        ([Wire(0, 65536, 100), Wire(100, 65600, 10)], r"uids\[0\] and \[1\]: their host_id ranges overlap"),
        ([Wire(i, 100000 + i, 1) for i in range(userns.MAX_MAPPINGS + 1)], r"33 mappings, more than 32"),
    ],
)
def test_invalid_mappings_are_refused_by_name(items: list[Wire], problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        userns.mappings(items, "uids")


@pytest.mark.parametrize(
    ("ident", "host"),
    [(0, 65536), (1000, 66536), (65535, 131071), (65536, userns.OVERFLOW_ID), (4294967294, userns.OVERFLOW_ID)],
)
def test_ids_shift_through_the_mapping_and_unmapped_ones_overflow(ident: int, host: int) -> None:
    assert KUBELET.host_uid(ident) == host
    assert KUBELET.host_gid(ident) == host
    assert KUBELET.maps_uid(ident) == (host != userns.OVERFLOW_ID)


def test_record_document_and_oci_mappings() -> None:
    ns = UserNamespace((IdMapping(0, 65536, 65536),), (IdMapping(0, 131072, 1000), IdMapping(1000, 200000, 5)))
    assert UserNamespace.from_doc(ns.to_doc()) == ns
    assert ns.oci() == {
        "uidMappings": [{"containerID": 0, "hostID": 65536, "size": 65536}],
        "gidMappings": [
            {"containerID": 0, "hostID": 131072, "size": 1000},
            {"containerID": 1000, "hostID": 200000, "size": 5},
        ],
    }


@pytest.mark.parametrize(
    ("pod", "container", "problem"),
    [
        (None, None, None),
        (KUBELET, KUBELET, None),
        (KUBELET, None, r"the container's user namespace \(the node's .*\) is not its pod's \(uids \[0 65536 65536\]"),
        (None, KUBELET, r"the container's user namespace \(uids \[0 65536 65536\].*is not its pod's \(the node's"),
        (
            KUBELET,
            UserNamespace((IdMapping(0, 131072, 65536),), KUBELET.gids),
            r"\(uids \[0 131072 65536\].* is not its pod's \(uids \[0 65536 65536\]",
        ),
    ],
)
def test_a_container_runs_in_its_pods_namespace(
    pod: UserNamespace | None, container: UserNamespace | None, problem: str | None
) -> None:
    if problem is None:
        userns.check_same(pod, container, 'container "app"')
    else:
        with pytest.raises(InvalidArgument, match=problem):
            userns.check_same(pod, container, 'container "app"')


def test_a_volume_copy_stores_the_kubelets_owners_shifted() -> None:
    tree = VolumeTree(
        version="..2026_01_01_00_00_00.1",
        root=Meta(0o1777, 0, 0),
        top=Meta(0o755, 0, 2000),
        entries=(
            Entry("dir", "dir", Meta(0o2755, 0, 2000)),
            Entry("dir/token", "file", Meta(0o600, 1000, 2000), b"t"),
            Entry("ca.crt", "file", Meta(0o644, 70000, 70000), b"c"),  # an id the namespace does not map
        ),
    )
    assert shifted(tree, None) is tree
    got = shifted(tree, KUBELET)
    assert (got.root, got.top) == (Meta(0o1777, 65536, 65536), Meta(0o755, 65536, 67536))
    assert [e.meta for e in got.entries] == [
        Meta(0o2755, 65536, 67536),
        Meta(0o600, 66536, 67536),
        Meta(0o644, userns.OVERFLOW_ID, userns.OVERFLOW_ID),
    ]
    assert [(e.path, e.kind, e.data) for e in got.entries] == [(e.path, e.kind, e.data) for e in tree.entries]
