"""``vmsandbox node install|uninstall|label``: a node made ready for shim mode, and put back, by
the DaemonSet of ``deploy/install/`` (its entrypoint runs these on the host; docs/containerd-shim.md).

``install`` (the payload and the daemon's ``config.yaml`` already under the prefix): the default
profiles on the installed guest image, the daemon's directories, containerd's drop-in, its main
configuration importing it (the original kept), each handler's launcher linked onto containerd's
``PATH`` with the file naming the daemon's shim directory beside them, containerd restarted and
waited for; a failed restart undoes it all and restarts containerd again.
Every change is recorded first (``vmsandbox/node_install.py``'s ``InstallRecord``), and
``uninstall`` undoes what the record names: links, the shim directory's file, drop-in,
containerd's configuration byte for byte, the directories the install made; then containerd
restarted. ``label`` sets or removes the Node's ``vmsandbox.dev/runtime`` label with the service
account's token and CA from the environment (``VMSANDBOX_API_TOKEN``, ``VMSANDBOX_API_CA``), else a
kubeconfig's credentials.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import sys
from collections.abc import Callable

from shim.config import load_config
from vmsandbox import node_install as plan
from vmsandbox.adapters import node_host as host
from vmsandbox.adapters.profile_loader import load_profiles
from vmsandbox.containerd_config import drop_in, shim_dir_text
from vmsandbox.errors import InfrastructureError, InvalidArgument, VmSandboxError

DEFAULT_RESTART = "systemctl restart containerd"


def _say(message: str) -> None:
    print(f"vmsandbox node: {message}", file=sys.stderr, flush=True)


def _layout(args: argparse.Namespace) -> plan.NodeLayout:
    return plan.NodeLayout(
        prefix=args.prefix,
        containerd_config=args.containerd_config,
        drop_in=args.drop_in,
        launcher_dir=args.launcher_dir,
    )


def _daemon_dirs(layout: plan.NodeLayout) -> tuple[str, list[str]]:
    """containerd's socket and the directories the daemon's configuration names."""
    config = load_config(layout.config)
    if not config.containerd_address:
        raise InvalidArgument(f"{layout.config}: containerd_address is not set (shim mode needs it)")
    dirs = [config.state_dir, config.console_dir, config.containerd_shim_dir, posixpath.dirname(config.socket_path)]
    if config.image_store_dir:
        dirs.append(config.image_store_dir)
    return config.containerd_address, dirs


def _restart(command: str, address: str, timeout_s: float) -> None:
    _say(f"restarting containerd: {command}")
    host.restart_containerd(command, timeout_s)
    version = host.wait_cri(address, timeout_s)
    _say(f"containerd {version} answers on {address}")


def _undo(record: plan.InstallRecord) -> list[str]:
    """Undo what ``record`` names; each failure is kept and the rest still done."""
    layout = record.layout
    problems: list[str] = []

    def step(what: str, fn: Callable[..., object], *a: object) -> None:
        try:
            fn(*a)
        except (OSError, VmSandboxError) as e:
            problems.append(f"{what}: {e}")

    for name in record.launchers:
        step(f"launcher link {name}", host.unlink_ours, layout.launcher_link(name), layout.launcher)
    if record.shim_dir_file:
        step("the shim directory's file", host.remove_file, layout.shim_dir_file)
    step("drop-in", host.remove_file, layout.drop_in)
    if record.config_changed:
        if record.config_existed:
            backup = host.read_bytes(layout.config_backup)
            if backup is None:
                problems.append(f"containerd's configuration: no backup at {layout.config_backup}; left as it is")
            else:
                step(
                    "containerd's configuration",
                    host.write_atomic,
                    layout.containerd_config,
                    backup,
                    record.config_mode,
                )
        else:
            step("containerd's configuration", host.remove_file, layout.containerd_config)
    for d in reversed(record.made_dirs):
        step(d, host.remove_tree, d)
    return problems


def install(args: argparse.Namespace) -> int:
    layout = _layout(args)
    old = host.read_bytes(layout.record)
    if old is not None:
        _say(f"an earlier install's record is at {layout.record}: undoing it first")
        problems = _undo(plan.record_from_json(old.decode("utf-8", errors="replace")))
        if problems:
            raise InfrastructureError("the earlier install was not undone: " + "; ".join(problems))
        host.remove_file(layout.record)
    source = host.read_bytes(posixpath.join(layout.payload, "profiles.yaml"))
    if source is None:
        raise InvalidArgument(f"no profiles in the payload ({layout.payload}/profiles.yaml)")
    host.make_dirs(layout.etc)
    profiles_text = host.profiles_for_node(source.decode("utf-8"), layout.image_dir)
    host.write_atomic(layout.profiles, profiles_text.encode(), 0o644)
    address, dirs = _daemon_dirs(layout)
    handlers = sorted(load_profiles([layout.profiles]))
    config = load_config(layout.config)
    toml = drop_in(handlers)
    shim_dir = shim_dir_text(config.containerd_shim_dir)
    launchers = plan.launchers_for(handlers)

    made: list[str] = []
    for d in [*dirs, posixpath.dirname(layout.drop_in)]:
        top = plan.first_missing(d, host.existing_dirs(d))
        if top is None or any(top == m or top.startswith(m + "/") for m in made):
            continue
        if top == layout.prefix or top.startswith(layout.prefix + "/"):
            continue  # goes with the prefix
        made.append(top)
    for path in (layout.drop_in, layout.shim_dir_file):
        if os.path.lexists(path):
            raise InvalidArgument(f"{path} exists already: not the installer's to replace")
    current = host.read_bytes(layout.containerd_config)
    text = None if current is None else current.decode("utf-8")
    new = plan.config_with_import(text, layout.drop_in)
    record = plan.InstallRecord(
        layout,
        tuple(made),
        config_existed=current is not None,
        config_changed=new is not None,
        config_mode=host.file_mode(layout.containerd_config) if current is not None else 0o644,
        launchers=launchers,
        shim_dir_file=True,
    )
    if current is not None and new is not None:
        host.make_dirs(posixpath.dirname(layout.config_backup), 0o700)
        host.write_atomic(layout.config_backup, current, 0o600)
    host.write_atomic(layout.record, record.to_json().encode(), 0o600)
    _say(f"record of the install: {layout.record}")
    try:
        for d in dirs:
            host.make_dirs(d, 0o711)
        host.make_dirs(posixpath.dirname(layout.drop_in))
        host.write_atomic(layout.drop_in, toml.encode(), 0o644)
        _say(f"drop-in {layout.drop_in}: handlers {', '.join(handlers)}")
        if new is not None:
            host.write_atomic(layout.containerd_config, new.encode(), record.config_mode)
            _say(f"{layout.containerd_config} imports the drop-in (the original kept at {layout.config_backup})")
        for name in launchers:
            host.link(layout.launcher, layout.launcher_link(name))
            _say(f"launcher {layout.launcher_link(name)} -> {layout.launcher}")
        host.write_atomic(layout.shim_dir_file, shim_dir.encode(), 0o644)
        _say(f"{layout.shim_dir_file}: {config.containerd_shim_dir}")
        _restart(args.restart_command, address, args.timeout)
    except (OSError, VmSandboxError) as e:
        _say(f"install failed ({e}): undoing it")
        problems = _undo(record)
        try:
            _restart(args.restart_command, address, args.timeout)
        except VmSandboxError as again:
            problems.append(f"containerd restarted after the undo: {again}")
        if not problems:
            host.remove_file(layout.record)
        raise InfrastructureError(
            f"install failed: {e}" + ("; undo: " + "; ".join(problems) if problems else "")
        ) from None
    _say("installed")
    return 0


def uninstall(args: argparse.Namespace) -> int:
    record_path = plan.NodeLayout(prefix=args.prefix).record
    data = host.read_bytes(record_path)
    if data is None:
        _say(f"no install record at {record_path}: nothing to undo")
        return 0
    record = plan.record_from_json(data.decode("utf-8", errors="replace"))
    address = ""
    try:
        address, _ = _daemon_dirs(record.layout)
    except (OSError, VmSandboxError) as e:
        _say(f"the daemon's configuration is not readable ({e}): containerd is restarted without waiting on it")
    problems = _undo(record)
    try:
        if address:
            _restart(args.restart_command, address, args.timeout)
        else:
            host.restart_containerd(args.restart_command, args.timeout)
    except VmSandboxError as e:
        problems.append(str(e))
    if problems:
        for p in problems:
            _say(f"not undone: {p}")
        return 1
    host.remove_file(record_path)
    _say("uninstalled: containerd's configuration is as it was")
    return 0


def label(args: argparse.Namespace) -> int:
    body = plan.label_patch(not args.remove)
    token = os.environ.get("VMSANDBOX_API_TOKEN", "")
    ca = os.environ.get("VMSANDBOX_API_CA", "")
    what = "removed" if args.remove else "set"
    try:
        if not (token and args.server):
            raise InfrastructureError("no service account token or API server given")
        host.patch_node_label(args.node, body, server=args.server, token=token, ca_pem=ca)
    except VmSandboxError as e:
        if not args.kubeconfig:
            raise
        # the service account goes with the rest of deploy/install/ on `kubectl delete`
        _say(f"with the service account: {e}; with {args.kubeconfig}")
        host.patch_node_label(args.node, body, server="", kubeconfig=args.kubeconfig)
    _say(f"node {args.node}: label {plan.RUNTIME_LABEL} {what}")
    return 0


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:  # type: ignore[type-arg]
    node = sub.add_parser(
        "node",
        parents=parents,
        help="make this node ready for shim mode, or put it back (the installer's DaemonSet runs these)",
        description="Install shim mode on this node (containerd's drop-in, launcher, restart), or undo it.",
    )
    nsub = node.add_subparsers(dest="node_command", required=True, metavar="SUBCOMMAND")
    defaults = plan.NodeLayout()
    for name, func, text in (
        ("install", install, "install: drop-in, containerd's imports, launcher links; containerd restarted"),
        ("uninstall", uninstall, "undo what the install's record names; containerd restarted"),
    ):
        p = nsub.add_parser(name, parents=parents, help=text, description=text)
        p.add_argument("--prefix", default=defaults.prefix, help="the install's directory (default: %(default)s)")
        if name == "install":
            p.add_argument("--containerd-config", default=defaults.containerd_config, help="(default: %(default)s)")
            p.add_argument("--drop-in", default=defaults.drop_in, help="(default: %(default)s)")
            p.add_argument(
                "--launcher-dir",
                default=defaults.launcher_dir,
                help="a directory on containerd's PATH (default: %(default)s)",
            )
        p.add_argument("--restart-command", default=DEFAULT_RESTART, help="(default: %(default)s)")
        p.add_argument("--timeout", type=float, default=120.0, help="seconds for containerd's restart and its CRI")
        p.set_defaults(func=func)
    lp = nsub.add_parser(
        "label",
        parents=parents,
        help="set or remove the node's vmsandbox.dev/runtime label",
        description="Set or remove the node's vmsandbox.dev/runtime label through the API server.",
    )
    lp.add_argument("node", help="the Node's name")
    lp.add_argument("--remove", action="store_true", help="remove the label")
    lp.add_argument("--server", default="", help="the API server's URL (https://HOST:PORT)")
    lp.add_argument("--kubeconfig", default="", help="credentials to use when the service account's are refused")
    lp.set_defaults(func=label)
