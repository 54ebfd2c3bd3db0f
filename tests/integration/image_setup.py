"""Fixtures for the image tests: a real docker-registry on 127.0.0.1 and images pushed to it.

Every image is built here from local files (the host's busybox-static) into an OCI layout and
pushed with skopeo. Missing tools skip locally and fail under CI, like the other integration tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.registry_kit import (
    BUSYBOX,
    Entry,
    Layout,
    Registry,
    busybox_entries,
    directory,
    file,
    opaque,
    push,
    whiteout,
)


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
    missing = [t for t in ("skopeo", "docker-registry", "htpasswd") if shutil.which(t) is None]
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


def tree_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}
