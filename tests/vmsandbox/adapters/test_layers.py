"""Layer unpacking against hostile layers built here: nothing may be written, linked or deleted
outside the tree; device nodes are not created; setuid and owners are kept; limits hold."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import stat
import struct
import tempfile
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.registry_kit import (
    Entry,
    device,
    directory,
    fifo,
    file,
    hardlink,
    opaque,
    symlink,
    tar_bytes,
    whiteout,
)
from vmsandbox.adapters.layers import Limits, Tree, clean_name
from vmsandbox.errors import CannotFit, InvalidArgument

# vfs_cap_data revision 2, effective, permitted = CAP_NET_RAW (13): what `setcap cap_net_raw+ep` writes
CAP_NET_RAW = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)


@pytest.fixture
def place(tmp_path: Path) -> tuple[Path, Path]:
    """(tree root, a sibling directory standing for the host) with a file the host cares about."""
    root, host = tmp_path / "tree", tmp_path / "host"
    root.mkdir()
    host.mkdir()
    (host / "victim").write_text("keep me")
    return root, host


def apply(root: Path, *layers: list[Entry], limits: Limits | None = None, gz: bool = True) -> Tree:
    tree = Tree(str(root), limits or Limits())
    try:
        for n, entries in enumerate(layers):
            blob = root.parent / f"layer{n}.tar{'.gz' if gz else ''}"
            raw = tar_bytes(entries)
            blob.write_bytes(gzip.compress(raw) if gz else raw)
            tree.apply(str(blob), "gzip" if gz else "tar", f"layer {n}")
    finally:
        tree.close()
    return tree


def host_untouched(host: Path) -> None:
    assert sorted(p.name for p in host.iterdir()) == ["victim"]
    assert (host / "victim").read_text() == "keep me"


def test_ordinary_layers(place: tuple[Path, Path]) -> None:
    root, _ = place
    apply(
        root,
        [
            directory("bin"),
            file("bin/busybox", b"ELF", 0o755),
            symlink("bin/sh", "/bin/busybox"),
            file("etc/motd", b"1"),
        ],
        [file("etc/motd", b"2"), hardlink("bin/sh2", "bin/busybox"), fifo("run/fifo")],
    )
    assert (root / "bin/busybox").read_bytes() == b"ELF"
    assert os.readlink(root / "bin/sh") == "/bin/busybox"
    assert (root / "etc/motd").read_bytes() == b"2"
    assert os.stat(root / "bin/sh2").st_ino == os.stat(root / "bin/busybox").st_ino
    assert stat.S_ISFIFO(os.lstat(root / "run/fifo").st_mode)


@pytest.mark.parametrize("name", ["../escape", "a/../../escape", "./../escape"])
def test_names_climbing_out_refuse_the_layer(place: tuple[Path, Path], name: str) -> None:
    root, host = place
    with pytest.raises(InvalidArgument, match="climbs out"):
        apply(root, [file(name, b"x")])
    assert not (root.parent / "escape").exists()
    host_untouched(host)


def test_absolute_names_stay_inside(place: tuple[Path, Path]) -> None:
    root, host = place
    apply(root, [file(str(host / "victim"), b"pwned"), file("/etc/abs", b"x")])
    host_untouched(host)
    assert (root / str(host / "victim").lstrip("/")).read_bytes() == b"pwned"
    assert (root / "etc/abs").exists()


@pytest.mark.parametrize("target", ["HOST", "../../..HOST", "../HOSTREL"])
def test_writes_through_symlinked_directories_stay_inside(place: tuple[Path, Path], target: str) -> None:
    root, host = place
    link = target.replace("HOSTREL", "host").replace("HOST", str(host))
    apply(root, [symlink("evil", link)], [file("evil/victim", b"pwned"), file("evil/new", b"x")])
    host_untouched(host)
    assert (root / "evil").is_symlink()
    made = [p for p in root.rglob("victim") if p.is_file()]
    assert [p.read_bytes() for p in made] == [b"pwned"]  # written once, inside, where the link points in-root


def test_symlink_then_file_in_one_layer_stays_inside(place: tuple[Path, Path]) -> None:
    root, host = place
    apply(root, [symlink("evil", str(host)), file("evil/victim", b"pwned"), directory("evil/sub")])
    host_untouched(host)


def test_symlink_replacing_a_file_then_written_through_does_not_follow(place: tuple[Path, Path]) -> None:
    root, host = place
    apply(root, [symlink("f", str(host / "victim"))], [file("f", b"pwned")])
    host_untouched(host)
    assert (root / "f").read_bytes() == b"pwned" and not (root / "f").is_symlink()


@pytest.mark.parametrize("target", ["HOST/victim", "../host/victim", "evil/victim"])
def test_hard_links_cannot_reach_outside(place: tuple[Path, Path], target: str) -> None:
    root, host = place
    t = target.replace("HOST", str(host))
    with pytest.raises(InvalidArgument, match=r"missing target|climbs out"):
        apply(root, [symlink("evil", str(host)), hardlink("stolen", t)])
    host_untouched(host)
    assert os.stat(host / "victim").st_nlink == 1


def test_hard_link_to_a_directory_is_refused(place: tuple[Path, Path]) -> None:
    root, _ = place
    with pytest.raises(InvalidArgument, match=r"directory|missing"):
        apply(root, [directory("d"), hardlink("l", "d")])


@pytest.mark.parametrize("name", ["evil/.wh.victim", "evil/.wh..wh..opq"])
def test_whiteouts_through_symlinks_stay_inside(place: tuple[Path, Path], name: str) -> None:
    root, host = place
    apply(root, [symlink("evil", str(host))], [file(name, b"")])
    host_untouched(host)


@pytest.mark.parametrize("name", [".wh..", ".wh.", "d/.wh.."])
def test_whiteouts_naming_no_entry_refuse_the_layer(place: tuple[Path, Path], name: str) -> None:
    root, host = place
    with pytest.raises(InvalidArgument, match="names no entry"):
        apply(root, [directory("d"), file("d/x", b"")], [file(name, b"")])
    host_untouched(host)


def test_whiteouts_and_opaque_directories(place: tuple[Path, Path]) -> None:
    root, _ = place
    apply(
        root,
        [
            file("a/gone", b""),
            file("a/stays", b""),
            file("o/old1", b""),
            directory("o/olddir"),
            file("o/olddir/x", b""),
        ],
        [
            whiteout("a/gone"),
            file("o/new-before", b""),
            opaque("o"),
            file("o/new-after", b""),
            file("a/.wh.never", b""),
        ],
    )
    assert sorted(os.listdir(root / "a")) == ["stays"]
    assert sorted(os.listdir(root / "o")) == ["new-after", "new-before"]


def test_whiteout_does_not_hide_its_own_layer(place: tuple[Path, Path]) -> None:
    root, _ = place
    apply(root, [file("x", b"1"), whiteout("x")])
    assert (root / "x").exists()


def test_device_nodes_are_not_created_and_setuid_is_kept(place: tuple[Path, Path]) -> None:
    root, _ = place
    apply(
        root,
        [
            device("dev/null"),
            device("dev/sda", tarfile_blk()),
            device("etc/backdoor-mem", major=1, minor=1),
            file("bin/su", b"ELF", 0o4755, uid=0),
            file("bin/wall", b"ELF", 0o2755, gid=5),
            file("bin/ping", b"ELF", 0o755, pax={"SCHILY.xattr.security.capability": CAP_NET_RAW.decode()}),
            file("data", b"x", 0o644, uid=1000, gid=1000),
        ],
    )
    assert not (root / "dev/null").exists() and not (root / "dev/sda").exists()
    assert not (root / "etc/backdoor-mem").exists()
    assert stat.S_IMODE(os.stat(root / "bin/su").st_mode) == 0o4755
    assert stat.S_IMODE(os.stat(root / "bin/wall").st_mode) == 0o2755
    if os.geteuid() == 0:
        assert (os.stat(root / "data").st_uid, os.stat(root / "data").st_gid) == (1000, 1000)
        assert os.getxattr(root / "bin/ping", "security.capability") == CAP_NET_RAW


def tarfile_blk() -> bytes:
    import tarfile

    return tarfile.BLKTYPE


def test_gzip_bomb_stops_at_the_byte_limit(place: tuple[Path, Path]) -> None:
    root, _ = place
    with pytest.raises(CannotFit, match="more than the limit"):
        apply(root, [file("zeros", b"\0" * (4 << 20))], limits=Limits(max_bytes=1 << 20))


def test_entry_limit(place: tuple[Path, Path]) -> None:
    root, _ = place
    with pytest.raises(CannotFit, match="more than 10 entries"):
        apply(root, [file(f"f{i}", b"") for i in range(20)], limits=Limits(max_entries=10))


def test_plain_tar_layers_and_garbage(place: tuple[Path, Path]) -> None:
    root, _ = place
    apply(root, [file("plain", b"p")], gz=False)
    assert (root / "plain").read_bytes() == b"p"
    blob = root.parent / "garbage"
    blob.write_bytes(b"\x1f\x8bnot gzip at all")
    tree = Tree(str(root), Limits())
    with pytest.raises(InvalidArgument, match="not a valid layer"):
        tree.apply(str(blob), "gzip", "layer g")
    tree.close()


def test_a_file_where_a_parent_directory_should_be(place: tuple[Path, Path]) -> None:
    root, _ = place
    with pytest.raises(InvalidArgument, match="not a directory"):
        apply(root, [file("a", b"")], [file("a/b", b"")])


@pytest.mark.parametrize(
    ("name", "want"),
    [("a/b", ("a", "b")), ("./a//b/", ("a", "b")), ("/abs/x", ("abs", "x")), ("a/../b", ("b",)), (".", ())],
)
def test_clean_name(name: str, want: tuple[str, ...]) -> None:
    assert clean_name(name, "x") == want


def test_symlink_loops_refuse_the_layer(place: tuple[Path, Path]) -> None:
    root, host = place
    with pytest.raises(InvalidArgument):
        apply(root, [symlink("a", "b"), symlink("b", "a"), file("a/x", b"")])
    host_untouched(host)


def test_dangling_symlinked_directory_is_made_inside(place: tuple[Path, Path]) -> None:
    root, _ = place
    apply(root, [directory("var"), symlink("var/run", "../run")], [file("var/run/pid", b"1")])
    assert (root / "run/pid").read_bytes() == b"1"


_COMPONENTS = st.sampled_from(["a", "b", "..", ".", "host", "victim", ".wh.a", ".wh.victim", ".wh..wh..opq"])
_NAMES = st.builds(
    lambda lead, parts: lead + "/".join(parts),
    st.sampled_from(["", "/", "./"]),
    st.lists(_COMPONENTS, min_size=1, max_size=4),
)


@st.composite
def _entries(draw: st.DrawFn, host: str) -> Entry:
    kind = draw(st.sampled_from(["file", "dir", "symlink", "hardlink", "fifo", "device"]))
    name = draw(_NAMES)
    if kind == "file":
        return file(name, b"pwned", draw(st.sampled_from([0o644, 0o4755])))
    if kind == "dir":
        return directory(name)
    if kind == "symlink":
        return symlink(name, draw(st.one_of(_NAMES, st.sampled_from([host, f"{host}/victim", "../host", "/"]))))
    if kind == "hardlink":
        return hardlink(name, draw(st.one_of(_NAMES, st.just(f"{host}/victim"))))
    if kind == "fifo":
        return fifo(name)
    return device(name)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_layer_reaches_outside_the_tree(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root, host = Path(tmp) / "tree", Path(tmp) / "host"
        root.mkdir()
        host.mkdir()
        (host / "victim").write_text("keep me")
        layers = data.draw(st.lists(st.lists(_entries(str(host)), min_size=1, max_size=8), min_size=1, max_size=3))
        with contextlib.suppress(InvalidArgument, CannotFit):  # refusing a layer is fine; reaching outside is not
            apply(root, *layers)
        host_untouched(host)
        assert os.stat(host / "victim").st_nlink == 1
        outside = {p.name for p in Path(tmp).iterdir()} - {"tree", "host"}
        assert all(n.startswith("layer") for n in outside), outside
        assert not any(stat.S_ISCHR(p.lstat().st_mode) or stat.S_ISBLK(p.lstat().st_mode) for p in root.rglob("*"))


# -- verification: the blob's digest and the uncompressed digest (diff id), in the unpacking pass ----
def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _compressed(raw: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(raw, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor().compress(raw)
    return raw


@pytest.mark.parametrize("compression", ["tar", "gzip", "zstd"])
def test_layers_verified_against_digest_and_diff_id(place: tuple[Path, Path], compression: str) -> None:
    root, _ = place
    raw = tar_bytes([directory("etc"), file("etc/hello", b"hello\n")])
    blob = root.parent / "layer"
    blob.write_bytes(_compressed(raw, compression))
    tree = Tree(str(root), Limits())
    try:
        stats = tree.apply(str(blob), compression, "layer 1/1", digest=_digest(blob.read_bytes()), diff_id=_digest(raw))
    finally:
        tree.close()
    assert (stats.digest, stats.diff_id) == (_digest(blob.read_bytes()), _digest(raw))
    assert (root / "etc/hello").read_text() == "hello\n"


def _lie(raw: bytes) -> bytes:
    return raw + b"\0" * 512  # one more zero block: the same entries, another uncompressed digest


@pytest.mark.parametrize(
    ("compression", "what", "message"),
    [
        ("gzip", "diff_id", "config's rootfs.diff_ids says"),
        ("zstd", "diff_id", "config's rootfs.diff_ids says"),
        ("tar", "diff_id", "config's rootfs.diff_ids says"),
        ("gzip", "digest", "the blob's content has digest"),
    ],
)
def test_a_layer_whose_digests_lie_is_refused(
    place: tuple[Path, Path], compression: str, what: str, message: str
) -> None:
    """A diff id that names other content (trailing zero blocks included: the whole stream counts)."""
    root, _ = place
    raw = tar_bytes([file("x", b"x")])
    blob = root.parent / "layer"
    blob.write_bytes(_compressed(_lie(raw), compression))
    digest, diff_id = _digest(blob.read_bytes()), _digest(_lie(raw))
    if what == "diff_id":
        diff_id = _digest(raw)
    else:
        digest = _digest(b"another blob")
    tree = Tree(str(root), Limits())
    try:
        with pytest.raises(InvalidArgument, match=message) as err:
            tree.apply(str(blob), compression, "layer 2/3 sha256:abc", digest=digest, diff_id=diff_id)
    finally:
        tree.close()
    assert "layer 2/3" in str(err.value) and len(str(err.value)) < 400


def test_zstd_bomb_stops_at_the_byte_limit(place: tuple[Path, Path]) -> None:
    root, _ = place
    blob = root.parent / "bomb.zst"
    blob.write_bytes(zstandard.ZstdCompressor().compress(tar_bytes([file("big", b"\0" * (4 << 20))])))
    tree = Tree(str(root), Limits(max_bytes=1 << 20))
    try:
        with pytest.raises(CannotFit):
            tree.apply(str(blob), "zstd", "bomb")
    finally:
        tree.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tail=st.binary(max_size=2048),
    claim_tail=st.binary(max_size=2048),
    compression=st.sampled_from(["tar", "gzip", "zstd"]),
)
def test_a_layer_is_accepted_exactly_when_its_diff_id_is_its_content(
    tail: bytes, claim_tail: bytes, compression: str
) -> None:
    """Whatever follows the tar's end (padding, garbage) is part of what the diff id names."""
    raw = tar_bytes([file("f", b"data")])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tree"
        root.mkdir()
        blob = Path(tmp) / "layer"
        blob.write_bytes(_compressed(raw + tail, compression))
        tree = Tree(str(root), Limits())
        try:
            claimed = _digest(raw + claim_tail)
            if claim_tail == tail:
                tree.apply(str(blob), compression, "l", diff_id=claimed)
            else:
                with pytest.raises(InvalidArgument, match=r"rootfs\.diff_ids says"):
                    tree.apply(str(blob), compression, "l", diff_id=claimed)
        finally:
            tree.close()
