"""Fixtures for the image tests: a real docker-registry on 127.0.0.1 and images pushed to it.

Every image is built here from local files (the host's busybox-static): OCI images into an OCI
layout pushed with skopeo; Docker-format images with buildah (an independent builder) and, for
what no builder here makes (Docker uncompressed and zstd layers, a foreign layer), pushed raw over
the registry API. Missing tools skip locally and fail under CI, like the other integration tests.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shim.image_store import ImageStore
from shim.model import PullImage, RemoveImage
from shim.rpc.pull_image import pull_image
from shim.rpc.remove_image import remove_image
from tests.registry_kit import (
    BUSYBOX,
    DOCKER_CONFIG,
    DOCKER_MANIFEST,
    Buildah,
    Entry,
    Layout,
    Registry,
    busybox_entries,
    digest_of,
    directory,
    file,
    opaque,
    push,
    put_blob,
    put_manifest,
    served_manifest,
    tar_bytes,
    whiteout,
)
from vmsandbox.image_ref import parse_reference
from vmsandbox.registries import Credentials


def pull(store: ImageStore, text: str, creds: Credentials | None = None) -> str:
    """PullImage of ``text`` into ``store``, as the ImageService runs it."""
    return pull_image(store, PullImage(parse_reference(text), creds))


def remove(store: ImageStore, query: str) -> str | None:
    """RemoveImage of ``query`` from ``store``, as the ImageService runs it; the id removed."""
    return remove_image(store, RemoveImage(query))


@contextlib.contextmanager
def one_image_registry(
    tmp: Path, entries: list[Entry], repo: str, cmd: tuple[str, ...] = ("/bin/sh",)
) -> Iterator[str]:
    """A registry in ``tmp`` serving one single-layer image of ``entries`` as ``repo``; yields its
    reference (host:port/repo) and stops the registry on the way out."""
    require_image_tools()
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        layout.tag("image", layout.image([layout.layer(entries)], cmd=cmd))
        ref = f"{registry.host}/{repo}"
        push(layout, "image", ref)
        yield ref
    finally:
        registry.stop()


def require_image_tools() -> None:
    missing = [t for t in ("skopeo", "docker-registry", "htpasswd", "buildah") if shutil.which(t) is None]
    if not BUSYBOX.is_file():
        missing.append(str(BUSYBOX))
    if missing:
        message = f"image tools missing (run scripts/setup-host.sh): {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@dataclass
class Pushed:
    """The registry and what was pushed: name -> (reference, config digest = image id, top digest)."""

    registry: Registry
    images: dict[str, tuple[str, str, str]] = field(default_factory=dict)

    def ref(self, name: str) -> str:
        return self.images[name][0]

    def id(self, name: str) -> str:
        return self.images[name][1]

    def top(self, name: str) -> str:
        return self.images[name][2]


def _config_digest(layout: Layout, manifest_digest: str) -> str:
    import json

    doc = json.loads((layout.path / "blobs" / "sha256" / manifest_digest[7:]).read_text())
    return str(doc["config"]["digest"])


def build_and_push(layout: Layout, registry: Registry) -> dict[str, tuple[str, str, str]]:
    out: dict[str, tuple[str, str, str]] = {}
    base = layout.layer(busybox_entries())

    def publish(name: str, repo: str, desc: dict[str, object], image_id: str) -> None:
        layout.tag(name, desc)
        push(layout, name, f"{registry.host}/{repo}")
        out[name] = (f"{registry.host}/{repo}", image_id, str(desc["digest"]))

    d = layout.image([base], user="1000")
    publish("uid", "test/busybox:uid", d, _config_digest(layout, str(d["digest"])))
    d = layout.image([base], user="nobody", salt="named")
    publish("named", "test/busybox:named", d, _config_digest(layout, str(d["digest"])))

    amd = layout.image([base, layout.layer([file("arch", b"amd64\n")])])
    arm = layout.image([base, layout.layer([file("arch", b"arm64\n")])], arch="arm64")
    index = layout.index([arm, amd])
    publish("multi", "test/multi:1", index, _config_digest(layout, str(amd["digest"])))

    lower = layout.layer(
        [file("a/gone", b""), file("a/stays", b""), directory("o"), file("o/old", b""), file("o/sub/x", b"")]
    )
    upper = layout.layer([whiteout("a/gone"), opaque("o"), file("o/new", b"")])
    d = layout.image([base, lower, upper])
    publish("whiteouts", "test/whiteouts:1", d, _config_digest(layout, str(d["digest"])))

    hostile = layout.layer([file("../../escaped-by-image", b"pwned")])
    d = layout.image([base, hostile])
    publish("hostile", "test/hostile:1", d, _config_digest(layout, str(d["digest"])))

    only_arm = layout.index([arm])
    publish("arm-only", "test/armonly:1", only_arm, "")

    big = layout.layer([file("random", os.urandom(12 << 20))], compress=False)
    d = layout.image([base, big])
    publish("big", "test/big:1", d, _config_digest(layout, str(d["digest"])))

    # cache poisoning: the attacker's config is the public image's, byte for byte; its layers differ
    public = layout.image([base, layout.layer([file("whoami", b"public\n")])], salt="public")
    public_id = _config_digest(layout, str(public["digest"]))
    publish("public", "test/public:1", public, public_id)
    evil = layout.layer([file("whoami", b"attacker\n")])
    attacker = layout.manifest(layout.config_of(public), [base[0], evil[0]])
    publish("attacker", "test/attacker:1", attacker, public_id)

    raw = tar_bytes([file("whoami", b"liar\n")])
    lying = layout.raw_layer(gzip.compress(raw, mtime=0), digest_of(tar_bytes([file("whoami", b"other\n")])))
    d = layout.image([base, lying])
    publish("lying", "test/lying:1", d, _config_digest(layout, str(d["digest"])))

    one = layout.image([base], salt="miscount")
    miscount = layout.manifest(layout.config_of(one), [base[0], evil[0]])
    publish("miscount", "test/miscount:1", miscount, _config_digest(layout, str(one["digest"])))

    d = layout.image([base, layout.zstd_layer([file("zstd", b"zstd\n")])])
    publish("zstd", "test/zstd:1", d, _config_digest(layout, str(d["digest"])))
    return out


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    require_image_tools()
    tmp = tmp_path_factory.mktemp("registry")
    registry = Registry(tmp / "registry").start()
    try:
        images = build_and_push(Layout(tmp / "layout"), registry)
        yield Pushed(registry, images)
    finally:
        registry.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class DockerImage:
    """A Docker-format image in the registry: ``host/repo:tag``."""

    host: str
    repo: str
    tag: str

    @property
    def ref(self) -> str:
        return f"{self.host}/{self.repo}:{self.tag}"

    def served(self) -> tuple[bytes, bytes]:
        """What the registry serves for the tag, and its linux/amd64 manifest (the same unless a list)."""
        top = served_manifest(self.host, self.repo, self.tag)
        doc = json.loads(top)
        if "manifests" not in doc:
            return top, top
        amd = next(m for m in doc["manifests"] if m["platform"]["architecture"] == "amd64")
        return top, served_manifest(self.host, self.repo, amd["digest"])


def push_docker_images(tmp: Path, registry: Registry) -> dict[str, DockerImage]:
    """Docker schema 2 images: ``docker`` (buildah, two gzip layers, user 1000), ``docker-list``
    (a buildah manifest list of it and an arm64 image), ``docker-raw`` (gzip, uncompressed and
    foreign layers, the foreign one naming a URL nothing answers; its blob is in the registry) and
    ``docker-zstd`` (containerd's Docker zstd layer type, which skopeo 1.9 cannot copy)."""
    buildah = Buildah(tmp / "buildah")
    busybox = BUSYBOX.read_bytes()
    passwd = b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/:/bin/sh\n"
    base = {"bin/busybox": busybox, "bin/sh": busybox, "etc/passwd": passwd}
    buildah.image(
        "docker-amd64",
        [base, {"etc/arch": b"amd64\n"}],
        cmd='["/bin/sh", "-c", "echo from-docker; id -u"]',
        user="1000",
    )
    buildah.image("docker-arm64", [base, {"etc/arch": b"arm64\n"}], arch="arm64")
    out = {
        "docker": DockerImage(registry.host, "docker/app", "1"),
        "docker-list": DockerImage(registry.host, "docker/multi", "1"),
        "docker-raw": DockerImage(registry.host, "docker/raw", "1"),
    }
    buildah.push("docker-amd64", out["docker"].ref)
    buildah.push_list("docker-multi", ["docker-amd64", "docker-arm64"], out["docker-list"].ref)

    out["docker-zstd"] = DockerImage(registry.host, "docker/zstd", "1")
    gz, plain, foreign = (
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.diff.tar",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    )
    layers = [
        (tar_bytes(busybox_entries()), gz),
        (tar_bytes([file("plain", b"plain\n")]), plain),
        (tar_bytes([file("foreign", b"foreign\n")]), foreign),
    ]
    push_raw_docker(registry.host, out["docker-raw"].repo, layers)
    zstd = [(tar_bytes([file("zstd", b"zstd\n")]), "application/vnd.docker.image.rootfs.diff.tar.zstd")]
    push_raw_docker(registry.host, out["docker-zstd"].repo, zstd)
    return out


def push_raw_docker(host: str, repo: str, layers: list[tuple[bytes, str]]) -> None:
    """A Docker schema 2 image ``repo:1`` of ``layers`` (uncompressed tar, media type), compressed as
    their media types say; a foreign layer names a URL nothing answers (its blob is in the registry)."""
    descriptors = []
    for raw, media_type in layers:
        if media_type.endswith("gzip"):
            data = gzip.compress(raw, mtime=0)
        elif media_type.endswith("zstd"):
            import zstandard

            data = zstandard.ZstdCompressor().compress(raw)
        else:
            data = raw
        desc: dict[str, object] = {"mediaType": media_type, "size": len(data), "digest": put_blob(host, repo, data)}
        if "foreign" in media_type:
            desc["urls"] = ["http://127.0.0.1:1/foreign-layer-nobody-serves"]
        descriptors.append(desc)
    config = {  # Docker's key order and Docker-only fields, as `docker build` writes them
        "architecture": "amd64",
        "config": {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"], "User": ""},
        "container": "3f2a0e1d",
        "container_config": {"Cmd": ["/bin/sh", "-c", "#(nop) ADD file"]},
        "created": "2024-01-01T00:00:00.000000001Z",
        "docker_version": "20.10.24",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [digest_of(raw) for raw, _ in layers]},
    }
    config_bytes = json.dumps(config, indent=1).encode()
    config_desc = {"mediaType": DOCKER_CONFIG, "size": len(config_bytes), "digest": put_blob(host, repo, config_bytes)}
    put_manifest(
        host,
        repo,
        "1",
        {"schemaVersion": 2, "mediaType": DOCKER_MANIFEST, "config": config_desc, "layers": descriptors},
    )


@pytest.fixture(scope="module")
def docker_images(pushed: Pushed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, DockerImage]:
    return push_docker_images(tmp_path_factory.mktemp("docker-images"), pushed.registry)


def tree_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}
