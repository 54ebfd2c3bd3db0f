"""How containerd reaches vmsandbox as its runtime shim (shim mode, docs/containerd-shim.md): the
drop-in of containerd's configuration (version 3) with a runtime per profile's handler, the
runtime type of each handler, the name of its launcher on containerd's ``PATH`` and how the
launcher reads its handler back from that name, and the file beside the launchers that names
vmsandbox's shim directory. One rule, which the CLI (``vmsandbox profile containerd``), the
installer, the cluster and critest scripts, the tests and the launcher itself all use.

The runtimes have no ``options`` table: containerd 2.4's CRI gives the task of a container with a
user namespace runc's options (its fifos' owner), which it cannot add to options of another type.
So the handler is told by the runtime type instead, as Kata Containers' runtimes are: handler
``vmsandbox`` is ``io.containerd.vmsandbox.v1``, whose binary containerd looks for as
``containerd-shim-vmsandbox-v1``; any other handler ``H`` is ``io.containerd.vmsandbox-H.v1``,
binary ``containerd-shim-vmsandbox-H-v1``: a link to the same launcher, which reads ``H`` from
the name it was run by."""

from __future__ import annotations

from collections.abc import Iterable

from vmsandbox import validation
from vmsandbox.errors import InvalidArgument

DEFAULT_HANDLER = "vmsandbox"
DEFAULT_SHIM_DIR = "/run/vmsandbox/containerd"
"""vmsandbox's ``containerd_shim_dir`` when its configuration names none."""
LAUNCHER = "containerd-shim-vmsandbox-v1"
"""The launcher as the project installs it (its console script): the default handler's name."""
SHIM_DIR_FILE = "containerd-shim-vmsandbox.shim-dir"
"""Beside the launchers' links: vmsandbox's shim directory, one absolute path (without it the
launcher takes ``DEFAULT_SHIM_DIR``)."""
SHIM_DIR_FILE_LIMIT = 4096
_NAME = "vmsandbox"
_TABLE = "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes"


def _runtime_name(handler: str) -> str:
    validation.dns1123_label(handler, "runtime handler")
    return _NAME if handler == DEFAULT_HANDLER else f"{_NAME}-{handler}"


def runtime_type(handler: str) -> str:
    """containerd's runtime type of ``handler``: ``io.containerd.<name>.v1``."""
    return f"io.containerd.{_runtime_name(handler)}.v1"


def launcher_name(handler: str) -> str:
    """The binary containerd runs for ``runtime_type(handler)`` (its shim binary's name rule:
    ``containerd-shim-<name>-<version>``), looked for on its ``PATH``."""
    return f"containerd-shim-{_runtime_name(handler)}-v1"


def handler_of_launcher(name: str) -> str:
    """The handler whose launcher is called ``name`` (a file's name, ``launcher_name``'s inverse)."""
    stem = name.removeprefix("containerd-shim-").removesuffix("-v1")
    if f"containerd-shim-{stem}-v1" != name or not (stem == _NAME or stem.startswith(f"{_NAME}-")):
        raise InvalidArgument(
            f"launcher {validation.quote(name[:128])}: not containerd-shim-vmsandbox-v1 or "
            "containerd-shim-vmsandbox-HANDLER-v1, so no runtime handler is named"
        )
    handler = stem.removeprefix(f"{_NAME}-") if stem != _NAME else DEFAULT_HANDLER
    validation.dns1123_label(handler, f"launcher {name}: runtime handler")
    return handler


def shim_dir_text(shim_dir: str) -> str:
    """``SHIM_DIR_FILE``'s content for vmsandbox's ``containerd_shim_dir``."""
    _check_shim_dir(shim_dir)
    return shim_dir + "\n"


def shim_dir_of(text: str) -> str:
    """The shim directory ``SHIM_DIR_FILE`` names (``shim_dir_text``'s inverse)."""
    shim_dir = text.removesuffix("\n")
    _check_shim_dir(shim_dir)
    return shim_dir


def _check_shim_dir(shim_dir: str) -> None:
    validation.absolute_path(shim_dir, "shim directory")
    if not shim_dir or "\n" in shim_dir or len(shim_dir) > 1024:
        raise InvalidArgument(f"shim directory {validation.quote(shim_dir[:128])}: not one absolute path")


def drop_in(handlers: Iterable[str]) -> str:
    """The TOML: a runtime per handler, of its own runtime type, with the sandbox API (``sandboxer
    shim``), containerd's overlayfs snapshots (the layers vmsandbox makes the image's disk of), no
    pause image, and no options (see the module's docstring)."""
    lines = ["version = 3"]
    for handler in handlers:
        lines += [
            f"[{_TABLE}.{handler}]",
            f"  runtime_type = '{runtime_type(handler)}'",
            "  sandboxer = 'shim'",
            "  snapshotter = 'overlayfs'",
            "  disable_pause_image_pull = true",
        ]
    return "\n".join(lines) + "\n"
