"""The drop-in of containerd's configuration (version 3) that makes vmsandbox its runtime shim for
each profile's handler (shim mode, docs/containerd-shim.md): one rule, which the CLI
(``vmsandbox profile containerd``), the cluster and critest scripts and the tests all print."""

from __future__ import annotations

from collections.abc import Iterable

from vmsandbox import validation

RUNTIME_TYPE = "io.containerd.vmsandbox.v1"
_TABLE = "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes"


def drop_in(handlers: Iterable[str], shim_dir: str) -> str:
    """The TOML: a runtime per handler, of vmsandbox's type, with the sandbox API (``sandboxer
    shim``), containerd's overlayfs snapshots (the layers vmsandbox makes the image's disk of), no
    pause image, and the options the launcher reads (``Handler``, ``ShimDir``)."""
    validation.absolute_path(shim_dir, "shim directory")
    lines = ["version = 3"]
    for handler in handlers:
        validation.dns1123_label(handler, "runtime handler")
        lines += [
            f"[{_TABLE}.{handler}]",
            f"  runtime_type = '{RUNTIME_TYPE}'",
            "  sandboxer = 'shim'",
            "  snapshotter = 'overlayfs'",
            "  disable_pause_image_pull = true",
            f"  [{_TABLE}.{handler}.options]",
            f"    Handler = '{handler}'",
            f"    ShimDir = '{shim_dir}'",
        ]
    return "\n".join(lines) + "\n"
