"""Image pull + unpack through the production ImageStore vs ``skopeo copy`` + ``umoci unpack``.

A local docker-registry on 127.0.0.1 serves a ~50 MB image of 5 layers (incompressible file
data, so the transfer is the size), built here from random bytes and the host's busybox-static.
Each round pulls it into a fresh store through ``ImageStore.pull`` (resolve, download with digest
checks, unpack in-root, catalogue) and, in the same process, runs the reference tools on the same
image: ``skopeo copy docker://… oci:DIR`` then ``umoci unpack``. Rounds alternate; medians are
compared. Then ten threads pull the same image into a fresh store at once, and the registry's
access log says how many times each blob was downloaded.

Usage: ``.venv/bin/python bench/image_pull.py [--rounds 5] [--layer-mb 10]`` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shim.images import ImageStore
from tests.registry_kit import Layout, Registry, busybox_entries, file, push

TARGET_RATIO = 1.2


def build(layout: Layout, layers: int, layer_mb: int) -> None:
    descs = [layout.layer(busybox_entries())]
    for n in range(layers - 1):
        chunk = (layer_mb << 20) // 4
        descs.append(layout.layer([file(f"data/l{n}/f{i}", os.urandom(chunk)) for i in range(4)], compress=True))
    layout.tag("bench", layout.image(descs))


def ours(ref: str, root: Path) -> float:
    store = ImageStore(root)
    t0 = time.perf_counter()
    store.pull(ref)
    return time.perf_counter() - t0


def reference_tools(ref: str, root: Path) -> float:
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    subprocess.run(
        [
            "skopeo",
            "--insecure-policy",
            "copy",
            "--quiet",
            "--src-tls-verify=false",
            f"docker://{ref}",
            f"oci:{root}/oci:bench",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["umoci", "unpack", "--image", f"{root}/oci:bench", str(root / "bundle")], check=True, capture_output=True
    )
    return time.perf_counter() - t0


def concurrent(ref: str, registry: Registry, root: Path, n: int) -> dict[str, object]:
    store = ImageStore(root)
    before = registry.blob_gets()
    barrier = threading.Barrier(n)
    ids: list[str] = []

    def one() -> None:
        barrier.wait()
        ids.append(store.pull(ref))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    record = store.get(ref)
    assert record is not None and len(set(ids)) == 1 and len(ids) == n
    after = registry.blob_gets()
    per_blob = {d: after.get(d, 0) - before.get(d, 0) for d in (record.config, *record.layers)}
    return {
        "pulls": n,
        "seconds": round(seconds, 3),
        "blobs": len(per_blob),
        "downloads_per_blob_max": max(per_blob.values()),
        "downloads_per_blob_min": min(per_blob.values()),
        "each_blob_once": all(v == 1 for v in per_blob.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--layer-mb", type=int, default=12)
    parser.add_argument("--concurrent", type=int, default=10)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vmsandbox-bench-image-"))
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        build(layout, args.layers, args.layer_mb)
        ref = f"{registry.host}/bench/image:1"
        push(layout, "bench", ref)
        ours_s: list[float] = []
        ref_s: list[float] = []
        for r in range(args.rounds + 1):  # round 0 warms the registry's and the page cache
            a = ours(ref, tmp / f"ours{r}")
            b = reference_tools(ref, tmp / f"ref{r}")
            if r:
                ours_s.append(a)
                ref_s.append(b)
            shutil.rmtree(tmp / f"ours{r}", ignore_errors=True)
            shutil.rmtree(tmp / f"ref{r}", ignore_errors=True)
        store = ImageStore(tmp / "size")
        store.pull(ref)
        record = store.get(ref)
        assert record is not None
        image = {"compressed_bytes": record.size, "layers": len(record.layers), "unpacked_bytes": record.unpacked_bytes}
        shutil.rmtree(tmp / "size", ignore_errors=True)
        together = concurrent(ref, registry, tmp / "concurrent", args.concurrent)
        ratio = statistics.median(ours_s) / statistics.median(ref_s)
        print(
            json.dumps(
                {
                    "benchmark": "image_pull",
                    "image": image,
                    "rounds": args.rounds,
                    "ours_median_s": round(statistics.median(ours_s), 3),
                    "ours_s": [round(x, 3) for x in ours_s],
                    "skopeo_umoci_median_s": round(statistics.median(ref_s), 3),
                    "skopeo_umoci_s": [round(x, 3) for x in ref_s],
                    "ratio": round(ratio, 3),
                    "target_ratio": TARGET_RATIO,
                    "meets_target": ratio <= TARGET_RATIO,
                    "concurrent_same_image": together,
                },
                indent=2,
            )
        )
    finally:
        registry.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
