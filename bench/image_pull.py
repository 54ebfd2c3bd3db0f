"""Image pull + unpack through the production ImageStore vs ``skopeo copy`` + ``umoci unpack``.

A local docker-registry on 127.0.0.1 serves a ~50 MB image of 5 layers (incompressible file
data, so the transfer is the size), built here from random bytes and the host's busybox-static,
twice: in OCI format and in Docker schema 2 format (the same layers, copied with
``skopeo copy --format v2s2``). Each round pulls each of them into a fresh store through
``shim.rpc.pull_image`` (resolve, download with digest checks, unpack in-root with every layer checked
against the config's diff ids, catalogue) and, in the same process, runs the reference tools on
the same image: ``skopeo copy docker://… oci:DIR`` then ``umoci unpack``. Rounds interleave the
four; medians are compared per format. Then ten threads pull the same image into a fresh store at
once, and the registry's access log says how many times each blob was downloaded.

Usage: ``.venv/bin/python bench/image_pull.py [--rounds 5] [--layer-mb 12]`` (prints JSON).
``--smoke`` runs one small round and checks the JSON's shape and the single-download property
(not the ratio, which a small image on a shared machine cannot measure): exit status 1 if not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from shim.image_store import ImageStore
from shim.model import PullImage
from shim.rpc.pull_image import pull_image
from tests import interrupts
from tests.registry_kit import Layout, Registry, busybox_entries, file, push
from vmsandbox.image_ref import parse_reference

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
    pull_image(store, PullImage(parse_reference(ref)))
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
        ids.append(pull_image(store, PullImage(parse_reference(ref))))

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


def push_docker(layout: Layout, dest: str) -> None:
    """The layout's image in Docker schema 2 format (Docker media types and config) at ``dest``."""
    subprocess.run(
        [
            *("skopeo", "copy", "--quiet", "--insecure-policy", "--dest-tls-verify=false", "--format", "v2s2"),
            *(f"oci:{layout.path}:bench", f"docker://{dest}"),
        ],
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )


def measure(refs: dict[str, str], tmp: Path, rounds: int) -> dict[str, dict[str, object]]:
    """Per format: our pull and the reference tools, interleaved round by round."""
    times: dict[str, dict[str, list[float]]] = {f: {"ours": [], "ref": []} for f in refs}
    for r in range(rounds + 1):  # round 0 warms the registry's and the page cache
        for fmt, ref in refs.items():
            a = ours(ref, tmp / f"ours-{fmt}{r}")
            b = reference_tools(ref, tmp / f"ref-{fmt}{r}")
            if r:
                times[fmt]["ours"].append(a)
                times[fmt]["ref"].append(b)
            shutil.rmtree(tmp / f"ours-{fmt}{r}", ignore_errors=True)
            shutil.rmtree(tmp / f"ref-{fmt}{r}", ignore_errors=True)
    out: dict[str, dict[str, object]] = {}
    for fmt, t in times.items():
        ratio = statistics.median(t["ours"]) / statistics.median(t["ref"])
        out[fmt] = {
            "ours_median_s": round(statistics.median(t["ours"]), 3),
            "ours_s": [round(x, 3) for x in t["ours"]],
            "skopeo_umoci_median_s": round(statistics.median(t["ref"]), 3),
            "skopeo_umoci_s": [round(x, 3) for x in t["ref"]],
            "ratio": round(ratio, 3),
            "meets_target": ratio <= TARGET_RATIO,
        }
    return out


def _format_shape() -> dict[str, Any]:
    return {
        "ours_median_s": smoke.POSITIVE,
        "ours_s": smoke.Each(smoke.POSITIVE),
        "skopeo_umoci_median_s": smoke.POSITIVE,
        "skopeo_umoci_s": smoke.Each(smoke.POSITIVE),
        "ratio": smoke.POSITIVE,
        "meets_target": smoke.BOOL,
    }


SHAPE: dict[str, Any] = {
    "benchmark": "image_pull",
    "image": {"compressed_bytes": smoke.POSITIVE, "layers": smoke.COUNT, "unpacked_bytes": smoke.POSITIVE},
    "layers": smoke.COUNT,
    "rounds": smoke.COUNT,
    "formats": {"oci": _format_shape(), "docker": _format_shape()},
    "target_ratio": TARGET_RATIO,
    "meets_target": smoke.BOOL,
    "concurrent_same_image": {
        "pulls": smoke.COUNT,
        "seconds": smoke.POSITIVE,
        "blobs": smoke.COUNT,
        "downloads_per_blob_max": smoke.COUNT,
        "downloads_per_blob_min": smoke.COUNT,
        "each_blob_once": smoke.BOOL,
    },
}


def invariants(doc: dict[str, Any]) -> list[str]:
    """Beyond the shape: every blob downloaded once by concurrent pulls, the image as built (not the
    ratio, which a small image on a shared machine cannot measure)."""
    problems = []
    together = doc["concurrent_same_image"]
    if together["each_blob_once"] is not True:
        problems.append(f"concurrent_same_image: the pulls downloaded a blob more than once: {together}")
    if doc["image"]["layers"] != doc["layers"]:
        problems.append(f"image.layers: {doc['image']['layers']}, but {doc['layers']} were built")
    for fmt, entry in doc["formats"].items():
        if len(entry["ours_s"]) != doc["rounds"] or len(entry["skopeo_umoci_s"]) != doc["rounds"]:
            problems.append(f"formats.{fmt}: not one sample per round ({doc['rounds']})")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--layer-mb", type=int, default=12)
    parser.add_argument("--concurrent", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="one small round; check the JSON, exit 1 if wrong")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.layers, args.layer_mb, args.concurrent = 1, 2, 1, 3
    smoke.require(smoke.missing_image_tools(), smoke.missing_tools("umoci"))
    tmp = Path(tempfile.mkdtemp(prefix="vmsandbox-bench-image-"))
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        build(layout, args.layers, args.layer_mb)
        refs = {"oci": f"{registry.host}/bench/image:1", "docker": f"{registry.host}/bench/docker:1"}
        push(layout, "bench", refs["oci"])
        push_docker(layout, refs["docker"])
        formats = measure(refs, tmp, args.rounds)
        store = ImageStore(tmp / "size")
        pull_image(store, PullImage(parse_reference(refs["oci"])))
        record = store.get(refs["oci"])
        assert record is not None
        image = {"compressed_bytes": record.size, "layers": len(record.layers), "unpacked_bytes": record.unpacked_bytes}
        shutil.rmtree(tmp / "size", ignore_errors=True)
        together = concurrent(refs["docker"], registry, tmp / "concurrent", args.concurrent)
        doc = {
            "benchmark": "image_pull",
            "image": image,
            "layers": args.layers,
            "rounds": args.rounds,
            "formats": formats,
            "target_ratio": TARGET_RATIO,
            "meets_target": all(f["meets_target"] for f in formats.values()),
            "concurrent_same_image": together,
        }
        smoke.report(doc, SHAPE, smoke=args.smoke, invariants=invariants)
    finally:
        registry.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
