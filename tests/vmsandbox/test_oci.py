"""OCI and Docker image documents: parsing, refusals, platform choice, the image's user."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument, NotFound
from vmsandbox.oci import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_MANIFEST,
    Descriptor,
    Index,
    Manifest,
    Platform,
    chain_id,
    check_layers,
    check_media_types,
    image_user,
    layer_compression,
    parse_config,
    parse_document,
    select_platform,
    sha256_digest,
)

LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def d(n: int) -> str:
    return "sha256:" + f"{n:064x}"


def desc(n: int, media_type: str = OCI_MANIFEST, **platform: str) -> dict[str, object]:
    out: dict[str, object] = {"mediaType": media_type, "digest": d(n), "size": 10 + n}
    if platform:
        out["platform"] = platform
    return out


def doc(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_manifest() -> None:
    m = parse_document(
        doc({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": desc(1), "layers": [desc(2), desc(3)]}), "x"
    )
    assert isinstance(m, Manifest)
    assert m.config.digest == d(1)
    assert [layer.digest for layer in m.layers] == [d(2), d(3)]


@pytest.mark.parametrize("media_type", [OCI_INDEX, DOCKER_LIST, ""])
def test_index_kinds(media_type: str) -> None:
    body: dict[str, object] = {"schemaVersion": 2, "manifests": [desc(1, os="linux", architecture="amd64")]}
    if media_type:
        body["mediaType"] = media_type
    assert isinstance(parse_document(doc(body), "x"), Index)


def test_media_type_from_the_registry_header_is_used() -> None:
    body = {"schemaVersion": 2, "config": desc(1), "layers": []}
    assert isinstance(parse_document(doc(body), "x", DOCKER_MANIFEST), Manifest)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"not json", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (doc({"schemaVersion": 1, "fsLayers": []}), "schema 1"),
        (doc({"mediaType": "application/x-nope"}), "unsupported manifest media type"),
        (doc({"mediaType": OCI_MANIFEST, "config": desc(1)}), "no layers"),
        (doc({"mediaType": OCI_MANIFEST, "config": {"digest": "md5:1", "size": 1}, "layers": []}), "not a sha256"),
        (doc({"mediaType": OCI_MANIFEST, "config": {"digest": d(1), "size": -1}, "layers": []}), "no valid size"),
        (doc({"mediaType": OCI_INDEX, "manifests": "x"}), "no manifests list"),
        (b"{" + b" " * (5 << 20) + b"}", "larger than"),
    ],
)
def test_refusals(body: bytes, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        parse_document(body, "pulling x")


def index_of(*entries: dict[str, object]) -> Index:
    result = parse_document(doc({"mediaType": OCI_INDEX, "manifests": list(entries)}), "x")
    assert isinstance(result, Index)
    return result


@pytest.mark.parametrize(
    ("entries", "want", "pick"),
    [
        (
            [desc(1, os="linux", architecture="arm64"), desc(2, os="linux", architecture="amd64")],
            Platform("linux", "amd64"),
            2,
        ),
        (
            [desc(1, os="windows", architecture="amd64"), desc(2, os="linux", architecture="amd64")],
            Platform("linux", "amd64"),
            2,
        ),
        (
            [
                desc(1, os="linux", architecture="arm", variant="v6"),
                desc(2, os="linux", architecture="arm", variant="v7"),
            ],
            Platform("linux", "arm", "v7"),
            2,
        ),
        (
            [desc(1, os="linux", architecture="arm"), desc(2, os="linux", architecture="arm64")],
            Platform("linux", "arm", "v7"),
            1,
        ),
        (
            [
                desc(1, "application/vnd.in-toto+json", os="linux", architecture="amd64"),
                desc(2, os="linux", architecture="amd64"),
            ],
            Platform("linux", "amd64"),
            2,
        ),
    ],
)
def test_select_platform(entries: list[dict[str, object]], want: Platform, pick: int) -> None:
    assert select_platform(index_of(*entries), "x", want).digest == d(pick)


def test_no_matching_platform_names_what_there_is() -> None:
    with pytest.raises(NotFound, match=r"no linux/amd64 image in the index \(it has: linux/arm64, linux/s390x\)"):
        select_platform(
            index_of(desc(1, os="linux", architecture="arm64"), desc(2, os="linux", architecture="s390x")), "x"
        )


def test_config() -> None:
    body = {
        "os": "linux",
        "architecture": "amd64",
        "config": {"User": "1000:1000", "Env": ["A=1"], "Cmd": ["sh"], "Labels": {"k": "v"}, "WorkingDir": "/w"},
        "rootfs": {"type": "layers", "diff_ids": [d(5)]},
    }
    c = parse_config(doc(body), "x")
    assert (c.user, c.env, c.cmd, dict(c.labels), c.working_dir, c.diff_ids) == (
        "1000:1000",
        ("A=1",),
        ("sh",),
        {"k": "v"},
        "/w",
        (d(5),),
    )
    assert parse_config(doc({"os": "linux", "architecture": "amd64", "config": None}), "x").user == ""
    with pytest.raises(InvalidArgument, match=r"config\.Env"):
        parse_config(doc({"config": {"Env": "A=1"}}), "x")


@pytest.mark.parametrize(
    ("user", "want"),
    [
        ("", (None, "")),
        ("0", (0, "")),
        ("1000", (1000, "")),
        ("1000:50", (1000, "")),
        ("nobody", (None, "nobody")),
        ("www-data:www-data", (None, "www-data")),
        ("root:0", (None, "root")),
        ("١٢", (None, "١٢")),
    ],
)
def test_image_user(user: str, want: tuple[int | None, str]) -> None:
    assert image_user(user) == want


@pytest.mark.parametrize(
    ("media_type", "want"),
    [
        ("application/vnd.oci.image.layer.v1.tar+gzip", "gzip"),
        ("application/vnd.docker.image.rootfs.diff.tar.gzip", "gzip"),
        ("application/vnd.oci.image.layer.v1.tar", "tar"),
        ("application/vnd.oci.image.layer.v1.tar+zstd", "zstd"),
    ],
)
def test_layer_compression(media_type: str, want: str) -> None:
    assert layer_compression(media_type, "x") == want


def test_unknown_layer_type_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="unsupported layer media type"):
        layer_compression("application/x-squashfs", "x")


def test_digest() -> None:
    assert sha256_digest(b"") == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


# -- layers against the config: diff ids, their count, the ChainID ------------------------------------
def _config(diff_ids: list[object]) -> bytes:
    return doc({"os": "linux", "architecture": "amd64", "rootfs": {"type": "layers", "diff_ids": diff_ids}})


def test_chain_id_follows_the_image_spec() -> None:
    a, b, c = d(1), d(2), d(3)
    ab = sha256_digest(f"{a} {b}".encode())
    assert chain_id((a,)) == a
    assert chain_id((a, b)) == ab
    assert chain_id((a, b, c)) == sha256_digest(f"{ab} {c}".encode())
    assert chain_id(()) == sha256_digest(b"")


@given(st.lists(st.integers(0, 50), max_size=6), st.lists(st.integers(0, 50), max_size=6))
def test_chain_ids_differ_exactly_when_the_layer_lists_do(xs: list[int], ys: list[int]) -> None:
    one, two = tuple(d(x) for x in xs), tuple(d(y) for y in ys)
    assert (chain_id(one) == chain_id(two)) == (one == two)


@pytest.mark.parametrize(
    ("layers", "diff_ids", "says"),
    [
        (2, [d(7), d(8)], ""),
        (2, [d(7)], "the manifest has 2 layers but the config's rootfs.diff_ids has 1 entries"),
        (0, [d(7)], "the manifest has 0 layers but the config's rootfs.diff_ids has 1 entries"),
        (1, ["sha256:short"], "rootfs.diff_ids[0] 'sha256:short' is not a sha256 digest"),
        (1, [7], "rootfs.diff_ids must be a list of strings"),
    ],
)
def test_layers_pair_with_diff_ids(layers: int, diff_ids: list[object], says: str) -> None:
    manifest = Manifest(
        OCI_MANIFEST, Descriptor(OCI_CONFIG, d(1), 1), tuple(Descriptor(LAYER, d(10 + i), 1) for i in range(layers))
    )
    if says:
        with pytest.raises(InvalidArgument, match=re.escape(says)):
            check_layers(manifest, parse_config(_config(diff_ids), "cfg"), "cfg")
        return
    pairs = check_layers(manifest, parse_config(_config(diff_ids), "cfg"), "cfg")
    assert [(layer.digest, diff) for layer, diff in pairs] == [(d(10), d(7)), (d(11), d(8))]


@pytest.mark.parametrize(
    ("media_type", "ok"),
    [
        ("application/vnd.docker.image.rootfs.diff.tar.gzip", True),
        ("application/vnd.docker.image.rootfs.diff.tar", True),
        ("application/vnd.docker.image.rootfs.foreign.diff.tar.gzip", True),
        ("application/vnd.oci.image.layer.nondistributable.v1.tar+zstd", True),
        ("application/vnd.docker.image.rootfs.diff.tar.zstd", False),
        ("application/vnd.oci.image.layer.v1.tar+lz4", False),
    ],
)
def test_media_types_are_checked_before_download(media_type: str, ok: bool) -> None:
    manifest = Manifest(
        OCI_MANIFEST, Descriptor(OCI_CONFIG, d(1), 1), (Descriptor(LAYER, d(2), 1), Descriptor(media_type, d(3), 1))
    )
    if ok:
        check_media_types(manifest, "m")
    else:
        with pytest.raises(InvalidArgument, match=r"m: layer 2/2 sha256:0+3: unsupported layer media type"):
            check_media_types(manifest, "m")
