"""The ``vmsandbox`` command: ``serve`` runs the CRI server; ``version`` prints versions."""

from __future__ import annotations

import argparse
import logging
import sys

from vmsandbox import __version__
from vmsandbox.errors import VmSandboxError
from vmsandbox.host import parse_cpulist

EXAMPLES = """examples:
  vmsandbox serve --config /etc/vmsandbox/config.yaml
  vmsandbox serve --socket /run/vmsandbox/vmsandbox.sock --cpu-pool 2-7 --profile /etc/vmsandbox/profiles.yaml
"""


def _serve(args: argparse.Namespace) -> int:
    from shim.config import load_config
    from shim.server import serve

    config = load_config(args.config).with_overrides(
        socket_path=args.socket,
        state_dir=args.state_dir,
        libvirt_uri=args.libvirt_uri,
        cpu_pool=parse_cpulist(args.cpu_pool) if args.cpu_pool else None,
        profile_files=tuple(args.profile) if args.profile else None,
        console_dir=args.console_dir,
    )
    serve(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vmsandbox",
        description="A CRI runtime that runs each pod in its own pinned QEMU guest.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the CRI server on a unix socket",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", help="YAML configuration file")
    serve.add_argument("--socket", help="unix socket path (default /run/vmsandbox/vmsandbox.sock)")
    serve.add_argument("--state-dir", help="state directory (default /var/lib/vmsandbox/state)")
    serve.add_argument("--console-dir", help="where guest console logs go")
    serve.add_argument("--libvirt-uri", help="libvirt connection URI (default qemu:///system)")
    serve.add_argument("--cpu-pool", help="host CPUs the shim owns, cpulist syntax (default: all online)")
    serve.add_argument("--profile", action="append", help="profile YAML file (repeatable)")
    serve.set_defaults(func=_serve)
    version = sub.add_parser("version", help="print the version")
    version.set_defaults(func=lambda _a: print(f"vmsandbox {__version__}") or 0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except VmSandboxError as exc:
        print(f"vmsandbox: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
