"""Image references: normalisation as the kubelet and crictl expect it, and refusals with reasons."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.image_ref import ImageReference, parse_image_id, parse_reference

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("busybox:1.36", "docker.io/library/busybox:1.36"),
        ("library/busybox", "docker.io/library/busybox:latest"),
        ("docker.io/busybox", "docker.io/library/busybox:latest"),
        ("index.docker.io/library/busybox:1", "docker.io/library/busybox:1"),
        ("user/app", "docker.io/user/app:latest"),
        ("quay.io/org/app:v1.2-rc_3", "quay.io/org/app:v1.2-rc_3"),
        ("localhost/app", "localhost/app:latest"),
        ("localhost:5000/a/b/c:t", "localhost:5000/a/b/c:t"),
        ("127.0.0.1:5000/e2e-test-images/busybox:1.29-2", "127.0.0.1:5000/e2e-test-images/busybox:1.29-2"),
        (f"busybox@{D}", f"docker.io/library/busybox@{D}"),
        (f"busybox:1@{D}", f"docker.io/library/busybox:1@{D}"),
        ("registry.k8s.io/pause:3.9", "registry.k8s.io/pause:3.9"),
        ("a__b/c-d--e/f.g:x", "docker.io/a__b/c-d--e/f.g:x"),
    ],
)
def test_normalises(text: str, want: str) -> None:
    assert str(parse_reference(text)) == want


def test_digest_reference_fetches_by_digest_and_tag_reference_by_tag() -> None:
    pinned = parse_reference(f"busybox:1@{D}")
    assert (pinned.fetch_by, pinned.tag, pinned.digest) == (D, "1", D)
    assert parse_reference("busybox").fetch_by == "latest"
    assert parse_reference("busybox").tagged == "docker.io/library/busybox:latest"
    assert pinned.with_digest(D) == f"docker.io/library/busybox@{D}"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("Busybox", "path component"),
        ("UPPER/case", "lower case"),
        ("busybox:", "not a valid tag"),
        ("busybox:-x", "not a valid tag"),
        ("busy box", "white space"),
        ("busybox@sha256:abc", "only sha256"),
        ("busybox@md5:" + "a" * 32, "only sha256"),
        ("busybox@", "not a digest"),
        ("a//b", "is empty"),
        ("a/b/", "is empty"),
        ("-bad/x", "path component"),
        (":tag", "no repository"),
        ("x" * 2000, "longer than"),
        ("host.io/" + "a" * 300, "longer than 255"),
        (D, "image id"),
        ("ab" * 32, "image id"),
        ("exa mple.com:99999999/x", "white space"),
        ("bad_host.io:5000/x", "not a registry"),
    ],
)
def test_refuses_with_reason(text: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        parse_reference(text)


def test_error_messages_are_bounded() -> None:
    with pytest.raises(InvalidArgument) as exc:
        parse_reference("busybox:" + "x" * 5000)
    assert len(str(exc.value)) < 400


@pytest.mark.parametrize(
    ("text", "want"),
    [(D, D), ("ab" * 32, D), ("sha256:" + "AB" * 32, None), ("busybox", None), ("ab" * 31, None)],
)
def test_image_ids(text: str, want: str | None) -> None:
    assert parse_image_id(text) == want


_component = st.from_regex(r"[a-z0-9]{1,8}(?:[._-][a-z0-9]{1,8}){0,2}", fullmatch=True)
_tag = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
_digest = st.from_regex(r"sha256:[a-f0-9]{64}", fullmatch=True)
_domain = st.sampled_from(["", "docker.io/", "quay.io/", "localhost:5000/", "127.0.0.1:5000/", "reg.example.com/"])


@given(_domain, st.lists(_component, min_size=1, max_size=4), st.one_of(st.none(), _tag), st.one_of(st.none(), _digest))
def test_normal_form_is_a_fixed_point(domain: str, path: list[str], tag: str | None, digest: str | None) -> None:
    assume(domain or "." not in path[0])  # a first component with a dot names a registry host
    text = domain + "/".join(path) + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    ref = parse_reference(text)
    again = parse_reference(str(ref))
    assert again == ref
    assert ref.tag or ref.digest
    assert ref.domain and "/" not in ref.domain
    if digest:
        assert ref.digest == digest and ref.fetch_by == digest


@given(st.text(max_size=300))
def test_any_text_parses_or_is_refused_cleanly(text: str) -> None:
    try:
        ref = parse_reference(text)
    except InvalidArgument as exc:
        assert len(str(exc)) < 600
    else:
        assert isinstance(ref, ImageReference)
        assert parse_reference(str(ref)) == ref
