"""``containerd-shim-vmsandbox-v1``: the runtime shim binary containerd runs for vmsandbox's
runtime types (shim mode), under the name of each handler's runtime (``containerd-shim-vmsandbox-v1``
for handler ``vmsandbox``, a link ``containerd-shim-vmsandbox-H-v1`` to it for handler ``H``:
``vmsandbox.containerd_config``, the one rule).

containerd runs it as ``<binary> -namespace NS -address A -publish-binary B -id ID [-debug]
start|delete`` in the sandbox's bundle directory. The handler is read from the name it was run by
(``argv[0]``'s file name, not the file a link leads to); vmsandbox's ``containerd_shim_dir`` from
the file ``containerd-shim-vmsandbox.shim-dir`` beside that name, else from
``$VMSANDBOX_CONTAINERD_SHIM_DIR``, else ``/run/vmsandbox/containerd``. The runtime has no options
in containerd's configuration: ``BootstrapParams`` (protobuf, on stdin for ``start``) carrying
runtime options (a drop-in of an older vmsandbox, with ``Handler`` and ``ShimDir``) is refused,
naming the fix. The answer is a ``BootstrapResult`` (protobuf, version 3, ttrpc) whose address is
the ttrpc socket vmsandbox serves that handler on (``shim.containerd.front``): every pod and
container of the handler is served by the running vmsandbox, which must be up (else ``start``
fails, saying so, and containerd fails RunPodSandbox with it). Nothing is started here.

``-info`` answers containerd's introspection (``RuntimeInfo``: the handler's runtime type,
vmsandbox's version and the runtime's OCI features). ``delete`` is what containerd runs when it
lost a shim's connection: vmsandbox holds the task's state, so this answers a ``DeleteResponse``
(exit status 255, now) for containerd's bookkeeping.

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
from collections.abc import Sequence

from google.protobuf import any_pb2

from gen.containerd.runtime.bootstrap.v1 import bootstrap_pb2 as boot
from gen.containerd.runtime.task.v3 import shim_pb2 as task
from gen.containerd.types import introspection_pb2 as introspection
from shim.containerd.wire import handler_socket, timestamp
from shim.translate import containerd_spec
from vmsandbox import __version__
from vmsandbox.containerd_config import (
    DEFAULT_SHIM_DIR,
    SHIM_DIR_FILE,
    SHIM_DIR_FILE_LIMIT,
    handler_of_launcher,
    runtime_type,
    shim_dir_of,
)
from vmsandbox.errors import InvalidArgument

SHIM_DIR_ENV = "VMSANDBOX_CONTAINERD_SHIM_DIR"
MAX_STDIN = 1 << 20
RUNTIME_OPTIONS = "runtimeoptions.v1.Options"


class LaunchError(Exception):
    pass


def launched_as(argv0: str) -> tuple[str, str]:
    """The runtime handler the launcher's name (``argv0``, the path containerd ran) names, and
    vmsandbox's shim directory: from the file beside that path, else the environment, else the
    default."""
    try:
        handler = handler_of_launcher(os.path.basename(argv0))
    except InvalidArgument as exc:
        raise LaunchError(str(exc)) from None
    beside = os.path.join(os.path.dirname(os.path.abspath(argv0)), SHIM_DIR_FILE)
    try:
        fd = os.open(beside, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return handler, os.environ.get(SHIM_DIR_ENV) or DEFAULT_SHIM_DIR
    except OSError as exc:
        raise LaunchError(f"{beside}: {exc.strerror}") from None
    try:
        data = os.read(fd, SHIM_DIR_FILE_LIMIT + 1)
    finally:
        os.close(fd)
    try:
        if len(data) > SHIM_DIR_FILE_LIMIT:
            raise InvalidArgument(f"more than {SHIM_DIR_FILE_LIMIT} bytes")
        return handler, shim_dir_of(data.decode())
    except (UnicodeDecodeError, InvalidArgument) as exc:
        raise LaunchError(f"{beside}: {exc}") from None


def check_params(params: boot.BootstrapParams) -> None:
    """Refuse runtime options: the handler is the launcher's name, and a runtime with options
    cannot take the runc options containerd gives a user-namespaced container's task."""
    for ext in params.extensions:
        if ext.value.type_url.endswith(RUNTIME_OPTIONS):
            raise LaunchError(
                "the runtime has options in containerd's configuration (an older vmsandbox's drop-in, with Handler "
                "and ShimDir): vmsandbox's runtimes have none; write the drop-in again with `vmsandbox profile "
                "containerd`, and its launchers' links with its --launchers"
            )


def start(stdin: bytes, handler: str, shim_dir: str) -> bytes:
    params = boot.BootstrapParams()
    if stdin:
        params.ParseFromString(stdin)
    check_params(params)
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


def info(handler: str) -> bytes:
    """``-info``: what containerd's introspection reports of this handler's runtime."""
    version = introspection.RuntimeVersion(version=__version__)
    features = any_pb2.Any(type_url=FEATURES_TYPE, value=json.dumps(containerd_spec.runtime_features()).encode())
    return introspection.RuntimeInfo(name=runtime_type(handler), version=version, features=features).SerializeToString()


def delete() -> bytes:
    return task.DeleteResponse(exit_status=255, exited_at=timestamp(time.time_ns())).SerializeToString()


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """The launcher; ``prog`` is the path it was run by (``sys.argv[0]`` when not given)."""
    prog = sys.argv[0] if prog is None else prog
    parser = argparse.ArgumentParser(prog=os.path.basename(prog), add_help=True)
    for flag in ("-namespace", "-address", "-publish-binary", "-id", "-bundle", "-socket"):
        parser.add_argument(flag, default="")
    parser.add_argument("-debug", action="store_true")
    parser.add_argument("-info", action="store_true")
    parser.add_argument("action", choices=("start", "delete"), nargs="?")
    args = parser.parse_args(argv)
    if not args.info and args.action is None:
        parser.error("an action is needed: start or delete")
    try:
        handler, shim_dir = launched_as(prog)
        if args.info:
            out = info(handler)
        elif args.action == "start":
            out = start(sys.stdin.buffer.read(MAX_STDIN) if not sys.stdin.isatty() else b"", handler, shim_dir)
        else:
            out = delete()
    except LaunchError as exc:
        print(f"{os.path.basename(prog)}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
