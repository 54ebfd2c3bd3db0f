"""``containerd-shim-vmsandbox-v1``: the runtime shim binary containerd runs for the runtime type
``io.containerd.vmsandbox.v1`` (shim mode).

containerd runs it as ``<binary> -namespace NS -address A -publish-binary B -id ID [-debug]
start|delete`` in the sandbox's bundle directory. For ``start`` it writes containerd's
``BootstrapParams`` (protobuf) on stdin, whose extensions carry the runtime's ``options`` from
containerd's configuration (``runtimeoptions.v1.Options``; the TOML of the options table in
``config_body``). The table's ``Handler`` names vmsandbox's runtime handler (a profile's; default
``vmsandbox``) and ``ShimDir`` vmsandbox's ``containerd_shim_dir`` (default
``/run/vmsandbox/containerd``), and the answer is a ``BootstrapResult`` (protobuf, version 3, ttrpc) whose address
is the ttrpc socket vmsandbox serves that handler on (``shim.containerd.front``): every pod and
container of the handler is served by the running vmsandbox, which must be up (else ``start``
fails, saying so, and containerd fails RunPodSandbox with it). Nothing is started here.

``-info`` answers containerd's introspection (``RuntimeInfo``: the runtime type and vmsandbox's
version). ``delete`` is what containerd runs when it lost a shim's connection: vmsandbox holds the task's
state, so this answers a ``DeleteResponse`` (exit status 255, now) for containerd's bookkeeping.

Only the answer goes to stdout (containerd reads stdout and stderr together as the answer);
errors go to stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import tomllib
from collections.abc import Sequence

from google.protobuf import any_pb2

from gen.containerd.runtime.bootstrap.v1 import bootstrap_pb2 as boot
from gen.containerd.runtime.task.v3 import shim_pb2 as task
from gen.containerd.types import introspection_pb2 as introspection
from gen.containerd.types.runtimeoptions.v1 import api_pb2 as runtimeoptions
from shim.containerd.wire import handler_socket, timestamp
from shim.translate import containerd_spec
from vmsandbox import __version__
from vmsandbox.containerd_config import RUNTIME_TYPE

DEFAULT_HANDLER = "vmsandbox"
DEFAULT_SHIM_DIR = "/run/vmsandbox/containerd"
SHIM_DIR_ENV = "VMSANDBOX_CONTAINERD_SHIM_DIR"
MAX_STDIN = 1 << 20
RUNTIME_OPTIONS = "runtimeoptions.v1.Options"


class LaunchError(Exception):
    pass


def runtime_handler(params: boot.BootstrapParams, default_dir: str) -> tuple[str, str]:
    """The vmsandbox runtime handler the runtime's options name (``Handler``, else the default)
    and the directory of vmsandbox's shim sockets (``ShimDir``, else ``default_dir``)."""
    for ext in params.extensions:
        if not ext.value.type_url.endswith(RUNTIME_OPTIONS):
            continue
        opts = runtimeoptions.Options()
        opts.ParseFromString(ext.value.value)
        if opts.config_path:
            raise LaunchError(
                f"runtime options: ConfigPath {opts.config_path!r} is not read; put Handler in the options table"
            )
        try:
            table = tomllib.loads(opts.config_body.decode())
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise LaunchError(f"runtime options: not TOML: {exc}") from None
        unknown = sorted(set(table) - {"Handler", "ShimDir", "TypeUrl", "ConfigPath", "ConfigBody"})
        if unknown:
            raise LaunchError(f"runtime options: unknown key {unknown[0]!r} (known: Handler, ShimDir)")
        handler = table.get("Handler", DEFAULT_HANDLER)
        shim_dir = table.get("ShimDir", default_dir)
        if not isinstance(handler, str) or not handler:
            raise LaunchError("runtime options: Handler must be a runtime handler's name")
        if not isinstance(shim_dir, str) or not shim_dir.startswith("/"):
            raise LaunchError("runtime options: ShimDir must be an absolute path (vmsandbox's containerd_shim_dir)")
        return handler, shim_dir
    return DEFAULT_HANDLER, default_dir


def start(stdin: bytes, shim_dir: str) -> bytes:
    params = boot.BootstrapParams()
    if stdin:
        params.ParseFromString(stdin)
    handler, shim_dir = runtime_handler(params, shim_dir)
    try:
        path = handler_socket(shim_dir, handler)
    except Exception as exc:
        raise LaunchError(f"runtime handler {handler!r}: {exc}") from None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(5.0)
    try:
        probe.connect(str(path))
    except OSError as exc:
        raise LaunchError(
            f"vmsandbox does not serve runtime handler {handler!r} at {path} ({exc.strerror}): is vmsandbox running "
            "with containerd_address set, and is the handler one of its profiles'?"
        ) from None
    finally:
        probe.close()
    return boot.BootstrapResult(version=3, address=f"unix://{path}", protocol="ttrpc").SerializeToString()


FEATURES_TYPE = "types.containerd.io/opencontainers/runtime-spec/1/features/Features"
"""The type URL containerd's typeurl registry gives runtime-spec's ``features.Features`` (JSON)."""


def info() -> bytes:
    """``-info``: what containerd's introspection reports of this runtime."""
    version = introspection.RuntimeVersion(version=__version__)
    features = any_pb2.Any(type_url=FEATURES_TYPE, value=json.dumps(containerd_spec.runtime_features()).encode())
    return introspection.RuntimeInfo(name=RUNTIME_TYPE, version=version, features=features).SerializeToString()


def delete() -> bytes:
    return task.DeleteResponse(exit_status=255, exited_at=timestamp(time.time_ns())).SerializeToString()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="containerd-shim-vmsandbox-v1", add_help=True)
    for flag in ("-namespace", "-address", "-publish-binary", "-id", "-bundle", "-socket"):
        parser.add_argument(flag, default="")
    parser.add_argument("-debug", action="store_true")
    parser.add_argument("-info", action="store_true")
    parser.add_argument("action", choices=("start", "delete"), nargs="?")
    args = parser.parse_args(argv)
    if args.info:
        sys.stdout.buffer.write(info())
        return 0
    if args.action is None:
        parser.error("an action is needed: start or delete")
    shim_dir = os.environ.get(SHIM_DIR_ENV, DEFAULT_SHIM_DIR)
    try:
        if args.action == "start":
            out = start(sys.stdin.buffer.read(MAX_STDIN) if not sys.stdin.isatty() else b"", shim_dir)
        else:
            out = delete()
    except LaunchError as exc:
        print(f"containerd-shim-vmsandbox-v1: {exc}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
