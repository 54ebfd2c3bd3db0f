"""The image catalogue: lookup by id, prefix, tag and digest; tag moves; removal; space accounting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.image_catalogue import (
    ImageRecord,
    lookup,
    matches_filter,
    record_doc,
    record_from_doc,
    referenced_blobs,
    referenced_trees,
    usage,
    visible,
    with_pulled,
    without,
)
from vmsandbox.image_ref import parse_reference


def h(n: int) -> str:
    return "sha256:" + f"{n:064x}"


A = "sha256:" + "a1" * 32
B = "sha256:" + "b2" * 32
C = "sha256:" + "c3" * 32


def rec(image_id: str, layers: tuple[str, ...] = (), **kw: object) -> ImageRecord:
    return ImageRecord(
        id=image_id,
        repo_tags=(),
        repo_digests=(),
        manifest=h(100 + int(image_id[7:9], 16)),
        config=image_id,
        layers=layers,
        size=10,
        **kw,  # type: ignore[arg-type]
    )


def pulled(images: dict[str, ImageRecord], r: ImageRecord, ref: str, top: str) -> dict[str, ImageRecord]:
    parsed = parse_reference(ref)
    return with_pulled(images, r, parsed, parsed.with_digest(top))


@pytest.fixture
def two() -> dict[str, ImageRecord]:
    images = pulled({}, rec(A, (h(1), h(2))), "busybox", h(50))
    images = pulled(images, rec(A), "busybox:1.36", h(50))
    return pulled(images, rec(B, (h(1), h(3))), "quay.io/x/y:v1", h(60))


@pytest.mark.parametrize(
    ("query", "want"),
    [
        (A, A),
        (A[7:], A),
        (A[7:19], A),
        ("sha256:" + A[7:19], A),
        ("busybox", A),
        ("docker.io/library/busybox:latest", A),
        ("busybox:1.36", A),
        (f"busybox@{h(50)}", A),
        (f"busybox:nope@{h(50)}", A),
        ("quay.io/x/y:v1", B),
        (f"quay.io/x/y@{h(60)}", B),
        ("quay.io/x/y", None),
        ("busybox:2", None),
        (f"busybox@{h(60)}", None),
        ("", None),
        ("a1a1", None),
        ("NOT A REF", None),
        (h(99), None),
    ],
)
def test_lookup(two: dict[str, ImageRecord], query: str, want: str | None) -> None:
    found = lookup(two, query)
    assert (found.id if found else None) == want


def test_ambiguous_prefix_names_nothing() -> None:
    images = {i: rec(i) for i in ("sha256:" + "ab" * 32, "sha256:" + "ab" * 31 + "cd")}
    assert lookup(images, "ababab") is None


def test_tags_and_digests_accumulate(two: dict[str, ImageRecord]) -> None:
    assert two[A].repo_tags == ("docker.io/library/busybox:1.36", "docker.io/library/busybox:latest")
    assert two[A].repo_digests == (f"docker.io/library/busybox@{h(50)}",)
    assert two[A].layers == (h(1), h(2))


def test_a_tag_moves_to_the_image_pulled_last(two: dict[str, ImageRecord]) -> None:
    moved = pulled(two, rec(B), "busybox", h(61))
    assert moved[A].repo_tags == ("docker.io/library/busybox:1.36",)
    assert "docker.io/library/busybox:latest" in moved[B].repo_tags
    assert lookup(moved, "busybox") == moved[B]


def test_pull_by_digest_adds_no_tag() -> None:
    images = pulled({}, rec(A), f"busybox:1@{h(50)}", h(50))
    assert images[A].repo_tags == ()
    assert images[A].repo_digests == (f"docker.io/library/busybox@{h(50)}",)


def test_without_and_removed_while_in_use(two: dict[str, ImageRecord]) -> None:
    assert set(without(two, A)) == {B}
    hidden = without(two, A, in_use=True)
    assert set(hidden) == {A, B} and set(visible(hidden)) == {B}
    again = pulled(hidden, rec(A), "busybox:2", h(70))
    assert not again[A].removed
    assert again[A].repo_tags == ("docker.io/library/busybox:2",)


def test_shared_blobs_are_counted_once(two: dict[str, ImageRecord]) -> None:
    sizes = {b: 1000 for b in referenced_blobs(two)} | {h(77): 5}  # h(77): a blob no image references
    u = usage(two, sizes)
    blobs = {two[A].manifest, two[B].manifest, A, B, h(1), h(2), h(3)}
    assert u.bytes == 1000 * len(blobs)
    assert u.inodes == len(blobs)


def test_shared_trees_are_counted_once() -> None:
    """Images with the same layers share one tree: its bytes count once."""
    images = {
        A: rec(A, (h(1),), tree=h(9), unpacked_bytes=500, unpacked_inodes=5),
        B: rec(B, (h(1),), tree=h(9), unpacked_bytes=500, unpacked_inodes=5),
    }
    sizes = dict.fromkeys(referenced_blobs(images), 1000)
    u = usage(images, sizes)
    assert (u.bytes, u.inodes) == (1000 * len(sizes) + 500, len(sizes) + 5)
    assert referenced_trees(images) == {h(9)}
    assert record_from_doc(record_doc(images[A])).tree == h(9)


@pytest.mark.parametrize(
    ("disks", "extra_bytes", "extra_inodes"),
    [
        pytest.param({}, 0, 0, id="no-disks-yet"),
        pytest.param({h(9): 4096}, 4096, 2, id="the-shared-trees-disk-once"),
        pytest.param({h(9): 4096, h(8): 8192}, 4096 + 8192, 4, id="each-trees-disk"),
        pytest.param({h(7): 1 << 20}, 0, 0, id="a-disk-of-no-image"),
    ],
)
def test_each_trees_disk_is_counted_once(disks: dict[str, int], extra_bytes: int, extra_inodes: int) -> None:
    images = {
        A: rec(A, (h(1),), tree=h(9), unpacked_bytes=500, unpacked_inodes=5),
        B: rec(B, (h(1),), tree=h(9), unpacked_bytes=500, unpacked_inodes=5),
        C: rec(C, (h(2),), tree=h(8), unpacked_bytes=300, unpacked_inodes=3),
    }
    sizes = dict.fromkeys(referenced_blobs(images), 1000)
    without_disks = usage(images, sizes)
    u = usage(images, sizes, disks)
    assert (u.bytes - without_disks.bytes, u.inodes - without_disks.inodes) == (extra_bytes, extra_inodes)


def test_filter(two: dict[str, ImageRecord]) -> None:
    assert matches_filter(two[A], "busybox") and not matches_filter(two[B], "busybox")


def test_documents_round_trip(two: dict[str, ImageRecord]) -> None:
    for r in two.values():
        assert record_from_doc(record_doc(r)) == r


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", "c", "d"])), max_size=30))
def test_a_tag_names_at_most_one_image(pulls: list[tuple[int, str]]) -> None:
    images: dict[str, ImageRecord] = {}
    for n, tag in pulls:
        image_id = "sha256:" + f"{n + 1:02x}" * 32
        images = pulled(images, rec(image_id), f"repo:{tag}", h(n))
    tags = [t for r in images.values() for t in r.repo_tags]
    assert len(tags) == len(set(tags))
    for _, tag in pulls:
        last = [n for n, t in pulls if t == tag][-1]
        assert lookup(images, f"repo:{tag}") == images["sha256:" + f"{last + 1:02x}" * 32]
