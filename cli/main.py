"""The ``vmsandbox`` command: run the CRI server, and the node admin's tools around it.

``serve`` runs the server; ``plan`` sizes and places a pod manifest without touching anything;
``profile validate`` / ``profile runtimeclass`` check profiles and derive RuntimeClasses; ``ls`` and
``inspect`` read the running shim's state; ``version`` prints versions. Human output by default,
``--format json`` for scripts. Heavy imports (grpc, libvirt) happen only in the commands that need them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from shim import logs
from vmsandbox import __version__
from vmsandbox.containerd_config import DEFAULT_SHIM_DIR
from vmsandbox.errors import InvalidArgument, NotFound, VmSandboxError
from vmsandbox.host import parse_cpulist

EXIT_OK, EXIT_NO, EXIT_BAD_INPUT = 0, 1, 2

SERVE_EXAMPLES = """examples:
  vmsandbox serve --config /etc/vmsandbox/config.yaml
  vmsandbox serve --socket /run/vmsandbox/vmsandbox.sock --cpu-pool 2-7 --profile /etc/vmsandbox/profiles.yaml
  vmsandbox serve --config /etc/vmsandbox/config.yaml --metrics-address 127.0.0.1:9464 --log-format json
"""
PLAN_EXAMPLES = """examples:
  vmsandbox plan pod.yaml
  vmsandbox plan deployment.yaml --profiles /etc/vmsandbox/profiles.yaml --handler vmsandbox-dedicated
  vmsandbox plan pod.yaml --config /etc/vmsandbox/config.yaml --state-dir /var/lib/vmsandbox/state
  vmsandbox plan pod.yaml --host-sysfs tests/fixtures/sysfs/two-socket-64-thread --format xml

exit status: 0 the pod fits, 1 the shim would refuse it (the output says which resource, declared
vs available, or why the shim would answer INVALID_ARGUMENT), 2 no plan could be made: bad input
(an unreadable or invalid manifest, config or profile file, an unknown profile or handler, a bad
option, no state database at --state-dir).
A multi-document manifest (or a kind: List) needs --document N to choose its pod.
The domain XML carries placeholder ids (all zeros); the shim generates real ones.
"""
VALIDATE_EXAMPLES = """examples:
  vmsandbox profile validate /etc/vmsandbox/profiles.yaml
  vmsandbox profile validate deploy/profiles.yaml --host-sysfs tests/fixtures/sysfs/two-socket-64-thread
  vmsandbox profile validate a.yaml b.yaml --format json

Problems print as FILE:LINE: KEY: PROBLEM. Exit status: 0 valid (warnings allowed), 1 errors found.
"""
RUNTIMECLASS_EXAMPLES = """examples:
  vmsandbox profile runtimeclass /etc/vmsandbox/profiles.yaml | kubectl apply -f -
  vmsandbox profile runtimeclass deploy/profiles.yaml --handler vmsandbox-dedicated
"""
CONTAINERD_EXAMPLES = """examples:
  vmsandbox profile containerd /etc/vmsandbox/profiles.yaml > /etc/containerd/conf.d/vmsandbox.toml
  vmsandbox profile containerd profiles.yaml --launchers /usr/local/bin --shim-dir /run/vmsandbox/containerd
"""
SNAPSHOT_EXAMPLES = """examples:
  vmsandbox snapshot make my-pod.yaml --config /etc/vmsandbox/config.yaml   # while the shim is stopped
  vmsandbox snapshot list --config /etc/vmsandbox/config.yaml --format json
  vmsandbox snapshot remove 3f2a9c1b   # or --all
"""

LS_EXAMPLES = """examples:
  vmsandbox ls
  vmsandbox ls --state-dir /var/lib/vmsandbox/state --format json
  vmsandbox ls --config /etc/vmsandbox/config.yaml --no-trunc
"""
INSPECT_EXAMPLES = """examples:
  vmsandbox inspect 3f2a9c            (an id prefix is enough when it is unique)
  vmsandbox inspect 3f2a9c --format json

Exit status: 0 found, 1 no such sandbox (or no state database), 2 ambiguous prefix or bad option.
"""
TOP_EXAMPLES = """examples:
  vmsandbox serve --config /etc/vmsandbox/config.yaml
  vmsandbox plan pod.yaml
  vmsandbox profile validate /etc/vmsandbox/profiles.yaml
  vmsandbox ls
  vmsandbox inspect 3f2a9c

Run `vmsandbox COMMAND --help` for each command's options and examples.
"""


def _err(command: str, message: object) -> None:
    print(f"vmsandbox {command}: {message}", file=sys.stderr)


def _config(path: str | None) -> Any:
    from shim.config import load_config

    return load_config(path)


# -- serve ------------------------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    from shim.server import serve

    config = _config(args.config).with_overrides(
        socket_path=args.socket,
        state_dir=args.state_dir,
        libvirt_uri=args.libvirt_uri,
        cpu_pool=parse_cpulist(args.cpu_pool) if args.cpu_pool else None,
        profile_files=tuple(args.profile) if args.profile else None,
        console_dir=args.console_dir,
        metrics_address=args.metrics_address,
        pod_network=args.pod_network,
        log_format=args.log_format,
    )
    if args.log_format is None and config.log_format != "text":
        logs.setup(args.log_level, config.log_format)
    serve(config)
    return EXIT_OK


# -- plan -------------------------------------------------------------------------------------------
def _plan(args: argparse.Namespace) -> int:
    from cli import inspect_state, plan, textout
    from vmsandbox.adapters.profile_loader import default_profiles, load_profiles

    config = _config(args.config)
    if args.cpu_pool:
        try:
            config = config.with_overrides(cpu_pool=parse_cpulist(args.cpu_pool))
        except ValueError as exc:
            raise InvalidArgument(f"--cpu-pool: {exc}") from None
    files = tuple(args.profiles) if args.profiles else config.profile_files
    profiles = load_profiles(files) if files else default_profiles()
    manifest = plan.load_manifest(args.manifest, args.document)
    host = plan.HostSource.fixture(args.host_sysfs) if args.host_sysfs else plan.HostSource.real(config)
    taken = inspect_state.claims(args.state_dir) if args.state_dir else {}
    result = plan.make_plan(
        manifest,
        profiles,
        config,
        host,
        profile_name=args.profile or "",
        handler=args.handler or "",
        taken=taken,
        docs=plan.load_documents(args.manifest),
    )
    if args.format == "json":
        print(textout.to_json(plan.plan_doc(result)))
    elif args.format == "xml":
        if result.domain_xml is not None:
            sys.stdout.write(result.domain_xml)
        else:
            _err("plan", f"{manifest.pod} does not fit: {result.refusal}")
    else:
        sys.stdout.write(plan.render_text(result))
    return EXIT_OK if result.fits else EXIT_NO


# -- profile ----------------------------------------------------------------------------------------
def _host_for_profiles(args: argparse.Namespace) -> tuple[Any, Any, bool, Any]:
    """(inventory, the config's CPU pools, check guest images?, device pools) for validation; none
    with --no-host."""
    from cli import plan, validate
    from vmsandbox.adapters.sysfs import read_inventory
    from vmsandbox.devices import resolve_pools

    if args.no_host:
        return None, None, False, None
    config = _config(args.config)
    if args.host_sysfs:
        source = plan.HostSource.fixture(args.host_sysfs)
        inv = read_inventory(source.sys_root, source.proc_root)
    else:
        inv = read_inventory(config.sys_root, config.proc_root)
    cpus = validate.CpuPools(
        owned=frozenset(config.cpu_pool) if config.cpu_pool is not None else None,
        shared=frozenset(config.shared_cpus),
        housekeeping=frozenset(config.housekeeping_cpus),
        file=args.config or "",
        lines=validate.config_key_lines(args.config) if args.config else {},
    )
    return inv, cpus, not args.host_sysfs, resolve_pools(config.device_pools, inv)


def _profile_validate(args: argparse.Namespace) -> int:
    from cli import textout, validate

    checked, problems = validate.parse_files(args.files)
    inv, cpus, images, pools = _host_for_profiles(args)
    problems += validate.host_problems(checked, inv, cpus, check_images=images, device_pools=pools)
    if images:  # this host's files (not a fixture's)
        from shim.host_policy import qemu_reaches

        reaches = qemu_reaches(_config(args.config).state_dir, [c.profile for c in checked])
        problems += validate.reach_problem_list(reaches, checked, cpus)
    problems.sort(key=lambda p: (args.files.index(p.file) if p.file in args.files else len(args.files), p.line, p.key))
    errors = [p for p in problems if p.severity == "error"]
    if args.format == "json":
        doc = {
            "valid": not errors,
            "profiles": [
                {"file": c.file, "line": c.start, "name": c.profile.name, "handler": c.profile.handler} for c in checked
            ],
            "problems": [validate.problem_doc(p) for p in problems],
        }
        print(textout.to_json(doc))
    else:
        for p in problems:
            print(p)
        for path in args.files:
            mine = [c.profile for c in checked if c.file == path]
            bad = sum(1 for p in errors if p.file == path)
            verdict = f"{bad} error{'s' if bad != 1 else ''}" if bad else "OK"
            handlers = ", ".join(f"{p.name} -> {p.handler}" for p in mine)
            print(
                f"{path}: {len(mine)} profile{'s' if len(mine) != 1 else ''} {verdict}"
                + (f" ({handlers})" if mine else "")
            )
        for path in sorted({p.file for p in errors} - set(args.files)):  # the shim's config
            bad = sum(1 for p in errors if p.file == path)
            print(f"{path}: {bad} error{'s' if bad != 1 else ''}")
    return EXIT_NO if errors else EXIT_OK


def _profile_runtimeclass(args: argparse.Namespace) -> int:
    from cli import textout, validate
    from vmsandbox.adapters.profile_loader import load_profiles

    profiles = load_profiles(args.files)
    chosen = [p for h, p in profiles.items() if not args.handler or h in args.handler]
    missing = sorted(set(args.handler or ()) - set(profiles))
    if missing:
        raise InvalidArgument(f"--handler {missing[0]}: no profile serves it (handlers: {', '.join(sorted(profiles))})")
    if args.format == "json":
        print(textout.to_json([validate.runtime_class(p) for p in chosen]))
    else:
        sys.stdout.write(validate.runtime_classes_yaml(chosen, " ".join(args.files)))
    return EXIT_OK


def _profile_containerd(args: argparse.Namespace) -> int:
    from vmsandbox.adapters.profile_loader import load_profiles
    from vmsandbox.containerd_config import drop_in

    profiles = load_profiles(args.files)
    handlers = sorted(profiles)
    toml = drop_in(handlers)
    if args.launchers:
        _link_launchers(args.launchers, handlers, args.shim_dir or DEFAULT_SHIM_DIR)
    elif args.shim_dir:
        raise InvalidArgument("--shim-dir is written beside the launchers: it goes with --launchers")
    sys.stdout.write(toml)
    return EXIT_OK


def _link_launchers(directory: str, handlers: list[str], shim_dir: str) -> None:
    """Each handler's launcher linked in ``directory`` (on containerd's PATH) to this installation's
    launcher, and the shim directory's file beside them (``vmsandbox.containerd_config``)."""
    from vmsandbox.adapters import node_host
    from vmsandbox.containerd_config import LAUNCHER, SHIM_DIR_FILE, launcher_name, shim_dir_text

    target = os.path.join(os.path.dirname(sys.executable), LAUNCHER)
    if not os.path.isfile(target):
        raise InvalidArgument(f"no launcher at {target} (beside this Python)")
    text = shim_dir_text(shim_dir)
    for handler in handlers:
        node_host.link(target, os.path.join(directory, launcher_name(handler)))
    node_host.write_atomic(os.path.join(directory, SHIM_DIR_FILE), text.encode(), 0o644)


# -- snapshot -------------------------------------------------------------------------------------
def _snapshot_make(args: argparse.Namespace) -> int:
    from cli import snapshot_cmd, textout

    config = _config(args.config).with_overrides(state_dir=args.state_dir)
    made = snapshot_cmd.make(config, args.manifest, args.handler, args.document, args.force)
    if args.format == "json":
        print(textout.to_json(snapshot_cmd.snapshot_doc(made)))
    else:
        print(snapshot_cmd.render_list([made]))
    return EXIT_OK


def _snapshot_list(args: argparse.Namespace) -> int:
    from cli import snapshot_cmd, textout

    found = snapshot_cmd.listing(_state_dir(args))
    if args.format == "json":
        print(textout.to_json([snapshot_cmd.snapshot_doc(s) for s in found]))
    else:
        print(snapshot_cmd.render_list(found))
    return EXIT_OK


def _snapshot_remove(args: argparse.Namespace) -> int:
    from cli import snapshot_cmd, textout

    if not args.keys and not args.all:
        raise InvalidArgument("name the snapshots to remove (key or unique prefix), or --all")
    removed = snapshot_cmd.remove(_state_dir(args), args.keys, args.all)
    print(textout.to_json(removed) if args.format == "json" else "\n".join(f"removed {k}" for k in removed))
    return EXIT_OK


# -- ls / inspect -----------------------------------------------------------------------------------
def _state_dir(args: argparse.Namespace) -> str:
    return str(args.state_dir or _config(args.config).state_dir)


def _ls(args: argparse.Namespace) -> int:
    from cli import inspect_state, textout

    views = inspect_state.read_sandboxes(_state_dir(args))
    now = time.time_ns()
    if args.format == "json":
        print(textout.to_json([inspect_state.view_doc(v, now) for v in views]))
    else:
        print(inspect_state.render_ls(views, now, full_ids=args.no_trunc))
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    from cli import inspect_state, textout

    views = inspect_state.read_sandboxes(_state_dir(args))
    view = inspect_state.find(views, args.id)
    now = time.time_ns()
    if args.format == "json":
        print(textout.to_json(inspect_state.view_doc(view, now)))
    else:
        print(inspect_state.render_inspect(view, now))
    return EXIT_OK


def _version(args: argparse.Namespace) -> int:
    if args.format == "json":
        from cli import textout

        print(textout.to_json({"vmsandbox": __version__, "python": sys.version.split()[0]}))
    else:
        print(f"vmsandbox {__version__}")
    return EXIT_OK


# -- parser -----------------------------------------------------------------------------------------
def _sub(
    sub: Any,
    name: str,
    help_text: str,
    examples: str,
    func: Callable[[argparse.Namespace], int],
    *,
    formats: Sequence[str] = ("text", "json"),
) -> argparse.ArgumentParser:
    """A subcommand with a description, examples and (unless ``formats`` is empty) ``--format``."""
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        parents=[_logging_options(argparse.SUPPRESS)],
        help=help_text,
        description=help_text[0].upper() + help_text[1:] + ".",
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if formats:
        p.add_argument(
            "--format", choices=list(formats), default=formats[0], help=f"output format (default: {formats[0]})"
        )
    p.set_defaults(func=func)
    return p


def _logging_options(default: Any) -> argparse.ArgumentParser:
    """--log-level and --log-format, accepted before the command and after it (``default``
    SUPPRESS on the commands, so a value given before the command is not reset)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--log-level",
        default="INFO" if default is None else default,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (default INFO)",
    )
    p.add_argument(
        "--log-format", choices=list(logs.FORMATS), default=default, help="log lines as text (default) or JSON"
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vmsandbox",
        parents=[_logging_options(None)],
        description="A CRI runtime that runs each pod in its own pinned QEMU guest, and its admin tools.",
        epilog=TOP_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = _sub(sub, "serve", "run the CRI server on a unix socket", SERVE_EXAMPLES, _serve, formats=())
    serve.add_argument("--config", help="YAML configuration file")
    serve.add_argument("--socket", help="unix socket path (default /run/vmsandbox/vmsandbox.sock)")
    serve.add_argument("--state-dir", help="state directory (default /var/lib/vmsandbox/state)")
    serve.add_argument("--console-dir", help="where guest console logs go")
    serve.add_argument("--libvirt-uri", help="libvirt connection URI (default qemu:///system)")
    serve.add_argument("--cpu-pool", help="host CPUs the shim owns, cpulist syntax (default: all online)")
    serve.add_argument("--profile", action="append", help="profile YAML file (repeatable)")
    serve.add_argument("--metrics-address", help="serve Prometheus metrics on HOST:PORT (default: off)")
    serve.add_argument(
        "--pod-network", choices=["cni", "none"], help="cni: pods get a CNI network (default); none: pods get no NIC"
    )

    plan = _sub(
        sub,
        "plan",
        "show the VM shape, placement and domain XML a pod manifest would get, changing nothing",
        PLAN_EXAMPLES,
        _plan,
        formats=("text", "json", "xml"),
    )
    plan.add_argument("manifest", metavar="POD.yaml", help="a v1 Pod, or a Deployment/StatefulSet/Job/... manifest")
    choose = plan.add_mutually_exclusive_group()
    choose.add_argument("--profile", metavar="NAME", help="size with this profile (by name)")
    choose.add_argument("--handler", metavar="H", help="size with the profile serving this RuntimeClass handler")
    plan.add_argument(
        "--profiles",
        metavar="FILE",
        action="append",
        help="profile YAML file (repeatable; default: the config's, else built-in)",
    )
    plan.add_argument("--config", help="the shim's configuration (cpu_pool, hugepages, profile_files, console_dir)")
    plan.add_argument("--host-sysfs", metavar="DIR", help="plan on a fixture host: DIR holds sys/ (and proc/)")
    plan.add_argument("--cpu-pool", help="host CPUs the shim owns, cpulist syntax (default: the config's, else all)")
    plan.add_argument(
        "--state-dir", help="count what the running shim holds (read-only) instead of planning on an empty host"
    )
    plan.add_argument("--document", type=int, metavar="N", help="which pod of a multi-document manifest (0-based)")

    profile = sub.add_parser(
        "profile",
        parents=[_logging_options(argparse.SUPPRESS)],
        help="check profile files; derive RuntimeClass manifests and containerd's drop-in from them",
        description="Check sizing profiles and derive RuntimeClass manifests from them.",
        epilog=VALIDATE_EXAMPLES + "\n" + RUNTIMECLASS_EXAMPLES + "\n" + CONTAINERD_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    psub = profile.add_subparsers(dest="profile_command", required=True, metavar="SUBCOMMAND")
    validate = _sub(
        psub, "validate", "check profile files against the schema and this host", VALIDATE_EXAMPLES, _profile_validate
    )
    validate.add_argument("files", metavar="FILE", nargs="+", help="profile YAML files")
    validate.add_argument("--config", help="the shim's configuration (cpu_pool, sys_root)")
    validate.add_argument(
        "--host-sysfs", metavar="DIR", help="check against a fixture host: DIR holds sys/ (and proc/)"
    )
    validate.add_argument("--no-host", action="store_true", help="schema checks only, no host checks")
    rc = _sub(
        psub,
        "runtimeclass",
        "print the RuntimeClass of each profile's handler, overhead from the profile",
        RUNTIMECLASS_EXAMPLES,
        _profile_runtimeclass,
        formats=("yaml", "json"),
    )
    rc.add_argument("files", metavar="FILE", nargs="+", help="profile YAML files")
    rc.add_argument("--handler", action="append", help="only this handler (repeatable)")
    ctd = _sub(
        psub,
        "containerd",
        "print containerd's drop-in that makes vmsandbox the runtime shim of each profile's handler",
        CONTAINERD_EXAMPLES,
        _profile_containerd,
        formats=(),
    )
    ctd.add_argument("files", metavar="FILE", nargs="+", help="profile YAML files")
    ctd.add_argument(
        "--launchers",
        metavar="DIR",
        help="also link each handler's launcher into DIR (on containerd's PATH), with the shim directory's file",
    )
    ctd.add_argument(
        "--shim-dir",
        help=f"vmsandbox's containerd_shim_dir, written beside the launchers (default: {DEFAULT_SHIM_DIR})",
    )

    from cli import node

    node.add_parser(sub, [_logging_options(argparse.SUPPRESS)])

    snapshot = sub.add_parser(
        "snapshot",
        parents=[_logging_options(argparse.SUPPRESS)],
        help="make, list and remove the per-shape guest snapshots pods are restored from",
        description="Make, list and remove the per-shape guest snapshots pods are restored from.",
        epilog=SNAPSHOT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ssub = snapshot.add_subparsers(dest="snapshot_command", required=True, metavar="SUBCOMMAND")
    smake = _sub(
        ssub,
        "make",
        "boot and save the snapshot the pods of a manifest would restore from (progress on stderr)",
        SNAPSHOT_EXAMPLES,
        _snapshot_make,
    )
    smake.add_argument("manifest", metavar="POD.yaml", help="a v1 Pod, or a Deployment/StatefulSet/Job/... manifest")
    smake.add_argument("--handler", metavar="H", help="the RuntimeClass handler its pods use (default: the config's)")
    smake.add_argument("--document", type=int, metavar="N", help="which pod of a multi-document manifest (0-based)")
    smake.add_argument("--force", action="store_true", help="make it again even when it exists")
    slist = _sub(ssub, "list", "list the snapshots with their shape, size and age", SNAPSHOT_EXAMPLES, _snapshot_list)
    sremove = _sub(ssub, "remove", "remove snapshots (by key or unique prefix)", SNAPSHOT_EXAMPLES, _snapshot_remove)
    sremove.add_argument("keys", metavar="KEY", nargs="*", help="snapshot key or unique prefix")
    sremove.add_argument("--all", action="store_true", help="remove every snapshot")
    for p in (smake, slist, sremove):
        p.add_argument("--state-dir", help="the shim's state directory (default: the config's)")
        p.add_argument("--config", help="the shim's configuration file")

    ls = _sub(sub, "ls", "list sandboxes with their shape, CPUs, hugepages, devices, age and state", LS_EXAMPLES, _ls)
    inspect = _sub(
        sub, "inspect", "show one sandbox in full, the guest's own report included", INSPECT_EXAMPLES, _inspect
    )
    inspect.add_argument("id", metavar="ID", help="sandbox id or a unique prefix of it")
    for p in (ls, inspect):
        p.add_argument(
            "--state-dir", help="the shim's state directory (default: the config's, else /var/lib/vmsandbox/state)"
        )
        p.add_argument("--config", help="the shim's configuration file (for state_dir)")
    ls.add_argument("--no-trunc", action="store_true", help="print full sandbox ids")

    _sub(sub, "version", "print the version", "examples:\n  vmsandbox version --format json\n", _version)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format or "text")
    command = " ".join(
        filter(
            None,
            [
                args.command,
                getattr(args, "profile_command", None),
                getattr(args, "snapshot_command", None),
                getattr(args, "node_command", None),
            ],
        )
    )
    try:
        return int(args.func(args))
    except VmSandboxError as exc:
        _err(command, exc)
        if command in ("plan", "serve"):  # plan: 1 means "would be refused", which is not an exception
            return EXIT_BAD_INPUT
        if isinstance(exc, NotFound):
            return EXIT_NO
        return EXIT_BAD_INPUT if isinstance(exc, InvalidArgument) else EXIT_NO
    except ValueError as exc:  # cpulist syntax and the like
        _err(command, exc)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
