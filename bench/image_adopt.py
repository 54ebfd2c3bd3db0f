"""Shim mode's image path (containerd pulled; vmsandbox makes the image's disk from its layers)
against vmsandbox's own pull of the same image, in the same process.

A local docker-registry on 127.0.0.1 serves an image of busybox-static and incompressible data
layers (as ``bench/image_pull.py`` builds it). Each round, interleaved:

- **adopt**: what a VM pod's first container costs in shim mode once containerd has the image:
  ``ImageStore.adopt`` over ``vmsandbox.adapters.layer_view.merged`` of the image's layers, each
  unpacked in a directory of its own as containerd's overlayfs snapshotter keeps them (done before
  the clock starts, as containerd did it at its pull): the read-only overlay, the EROFS disk of it,
  its check, the catalogue.
- **pull**: vmsandbox's own pull of the same image into an empty store (``shim.rpc.pull_image``:
  download, digest checks, unpack, the EROFS disk, the catalogue), what the CRI proxy mode pays.

The ratio adopt/pull says what taking containerd's layers saves over pulling again (nothing is
pulled twice, and the disk is made once per image). The design of the guest's root file system
(an EROFS disk against a 9p share of the host tree) is measured in ``bench/container_start.py``.

Usage: ``.venv/bin/python bench/image_adopt.py [--rounds 5] [--layers 5] [--layer-mb 12]`` (prints
JSON). ``--smoke`` runs one small round and checks the JSON's shape.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.image_pull import build
from shim.image_store import ImageStore
from shim.model import PullImage
from shim.rpc.pull_image import pull_image
from tests import interrupts
from tests.registry_kit import Layout, Registry, push
from vmsandbox.adapters.layer_view import merged
from vmsandbox.adapters.layers import Limits, unpack
from vmsandbox.containerd_rootfs import ImageLayers
from vmsandbox.image_ref import parse_reference
from vmsandbox.oci import Manifest, layer_compression, parse_document

TARGET_RATIO = 1.0  # adopting containerd's layers is to cost no more than pulling the image again


def snapshot_layers(layout: Layout, tmp: Path) -> tuple[str, bytes, ImageLayers]:
    """The image's config digest and document, and its layers unpacked one directory each (top
    first, as overlayfs' lowerdir lists them)."""
    blobs = layout.path / "blobs" / "sha256"
    desc = layout.refs["bench"]
    manifest = parse_document((blobs / desc["digest"][7:]).read_bytes(), "bench manifest")
    assert isinstance(manifest, Manifest)
    dirs = []
    for i, layer in enumerate(manifest.layers):
        d = tmp / "snapshots" / str(i) / "fs"
        d.mkdir(parents=True)
        blob = str(blobs / layer.digest[7:])
        unpack(str(d), [(blob, layer_compression(layer.media_type, "bench"), f"layer {i}")], Limits())
        dirs.append(str(d))
    config = (blobs / manifest.config.digest[7:]).read_bytes()
    return manifest.config.digest, config, ImageLayers(tuple(reversed(dirs)))


def adopt(image_id: str, config: bytes, layers: ImageLayers, root: Path) -> float:
    store = ImageStore(root)
    work = store.disk.work
    t0 = time.perf_counter()
    store.adopt(image_id, config, (["bench/image:1"], []), lambda: merged(layers, work))
    return time.perf_counter() - t0


def pull(ref: str, root: Path) -> float:
    store = ImageStore(root)
    t0 = time.perf_counter()
    pull_image(store, PullImage(parse_reference(ref)))
    return time.perf_counter() - t0


SHAPE: dict[str, Any] = {
    "benchmark": "image_adopt",
    "layers": smoke.COUNT,
    "layer_mb": smoke.COUNT,
    "rounds": smoke.COUNT,
    "adopt_median_s": smoke.POSITIVE,
    "adopt_s": smoke.Each(smoke.POSITIVE),
    "pull_median_s": smoke.POSITIVE,
    "pull_s": smoke.Each(smoke.POSITIVE),
    "ratio": smoke.POSITIVE,
    "target_ratio": TARGET_RATIO,
    "meets_target": smoke.BOOL,
}


def invariants(doc: dict[str, Any]) -> list[str]:
    if len(doc["adopt_s"]) != doc["rounds"] or len(doc["pull_s"]) != doc["rounds"]:
        return [f"adopt_s, pull_s: not one sample per round ({doc['rounds']})"]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--layer-mb", type=int, default=12)
    parser.add_argument("--smoke", action="store_true", help="one small round; check the JSON, exit 1 if wrong")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.layers, args.layer_mb = 1, 2, 1
    smoke.require(smoke.missing_image_tools())
    tmp = Path(tempfile.mkdtemp(prefix="vmsandbox-bench-adopt-"))
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        build(layout, args.layers, args.layer_mb)
        ref = f"{registry.host}/bench/image:1"
        push(layout, "bench", ref)
        image_id, config, layers = snapshot_layers(layout, tmp)
        times: dict[str, list[float]] = {"adopt": [], "pull": []}
        for r in range(args.rounds + 1):  # round 0 warms the registry's and the page cache
            order = (("adopt", lambda p: adopt(image_id, config, layers, p)), ("pull", lambda p: pull(ref, p)))
            for name, run in order if r % 2 else tuple(reversed(order)):
                root = tmp / f"{name}{r}"
                seconds = run(root)
                shutil.rmtree(root, ignore_errors=True)
                if r:
                    times[name].append(seconds)
        ratio = statistics.median(times["adopt"]) / statistics.median(times["pull"])
        doc = {
            "benchmark": "image_adopt",
            "layers": args.layers,
            "layer_mb": args.layer_mb,
            "rounds": args.rounds,
            "adopt_median_s": round(statistics.median(times["adopt"]), 3),
            "adopt_s": [round(x, 3) for x in times["adopt"]],
            "pull_median_s": round(statistics.median(times["pull"]), 3),
            "pull_s": [round(x, 3) for x in times["pull"]],
            "ratio": round(ratio, 3),
            "target_ratio": TARGET_RATIO,
            "meets_target": ratio <= TARGET_RATIO,
        }
        smoke.report(doc, SHAPE, smoke=args.smoke, invariants=invariants)
    finally:
        registry.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
