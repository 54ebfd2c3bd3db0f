"""Removing every guest a vmsandbox state holds, when a node, a cluster or a test run goes away.

``python -m cli.teardown`` is what ``scripts/cluster.sh down`` and ``scripts/stop-host.sh``
run, and the benchmarks and test helpers call the same functions:

``sandboxes SOCKET --state-dir DIR``  every sandbox through the shim: the state's own (VM) sandboxes
                                      first, then the downstream's; one failure never stops the rest
``domains --state-dir DIR``           with the shim stopped: every domain libvirt still has of that
                                      state (its metadata's owner is the state's instance id), then
                                      the pod networks the state records (``remove_state_networks``)
``orphans``                           every vmsandbox domain whose state directory is gone (its
                                      metadata names it; see ``orphaned``)

Each failure is one plain line on stderr and the exit status is 1 at the end; nothing here stops at
the first failure. This owns no state: it acts through the shim, libvirt and the state database
(read-only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

from cli.inspect_state import DB_NAME, open_state, read_sandboxes
from shim.pod_networks import OWNER_CALLER, macvtap_name, netns_name
from vmsandbox.adapters import netns
from vmsandbox.adapters.hypervisor import DomainInfo, Hypervisor
from vmsandbox.domain import DOMAIN_PREFIX
from vmsandbox.domain_xml import read_identity, read_shared_dirs
from vmsandbox.errors import InfrastructureError, VmSandboxError
from vmsandbox.snapshot_rules import SNAPSHOT_DOMAIN_PREFIX

DEFAULT_URI = "qemu:///system"
PREFIXES = (DOMAIN_PREFIX, SNAPSHOT_DOMAIN_PREFIX)  # a pod's guest; a snapshot's guest being made


@dataclass(frozen=True)
class Outcome:
    """What a tear-down did (one line each) and what it could not do (one line each)."""

    done: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    def __add__(self, other: Outcome) -> Outcome:
        return Outcome(self.done + other.done, self.problems + other.problems)


# -- pure decisions ---------------------------------------------------------------------------------
def removal_order(listed: Iterable[tuple[str, str]], vm_ids: set[str]) -> list[tuple[str, str]]:
    """``listed`` (sandbox id, label) with the state's own sandboxes first (a VM left running is
    the costly leftover; a downstream that is down fails the rest), then any of ``vm_ids`` the
    list missed, then the others, each in the order given."""
    listed = list(listed)
    seen = {sid for sid, _ in listed}
    mine = [(sid, label) for sid, label in listed if sid in vm_ids]
    missed = [(sid, "not listed") for sid in sorted(vm_ids - seen)]
    theirs = [(sid, label) for sid, label in listed if sid not in vm_ids]
    return mine + missed + theirs


def owned_by(domains: Iterable[DomainInfo], owner: str) -> list[DomainInfo]:
    """The domains of the state whose instance id is ``owner``."""
    return [d for d in domains if owner and d.owner == owner and d.name.startswith(PREFIXES)]


def orphaned(domains: Iterable[DomainInfo], exists: Callable[[str], bool] = os.path.exists) -> list[DomainInfo]:
    """The domains no shim can own any more. A domain's metadata names its state directory: it is
    an orphan when that directory's state database is gone. One made before the metadata said so
    is an orphan when none of the directories it shares into its guest (a sandbox's, a snapshot's,
    all in its state directory, and there for as long as the domain may be) exists; one that shares
    nothing cannot be told apart, and is left alone."""
    out = []
    for d in domains:
        if not d.name.startswith(PREFIXES):
            continue
        ident = read_identity(d.xml)
        if ident is None:
            continue
        if ident.state_dir:
            if not exists(os.path.join(ident.state_dir, DB_NAME)):
                out.append(d)
            continue
        shared = read_shared_dirs(d.xml)
        if shared and not any(exists(p) for p in shared):
            out.append(d)
    return out


# -- the shell ----------------------------------------------------------------------------------------
def state_owner(state_dir: str | Path) -> str | None:
    """The instance id of the state database in ``state_dir`` (read-only); None when there is none."""
    if not (Path(state_dir) / DB_NAME).is_file():
        return None
    with open_state(state_dir) as db:
        try:
            row = db.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()
        except sqlite3.Error as exc:
            raise InfrastructureError(f"state database in {state_dir}: {exc}") from exc
    return str(row[0]) if row else None


def state_sandbox_ids(state_dir: str | Path) -> set[str]:
    """The sandboxes the state database holds (every one of them is a VM); none without one."""
    if not (Path(state_dir) / DB_NAME).is_file():
        return set()
    return {v.id for v in read_sandboxes(state_dir)}


def remove_domains(hypervisor: Hypervisor, domains: Iterable[DomainInfo], why: str) -> Outcome:
    done, problems = [], []
    for d in domains:
        try:
            hypervisor.teardown(d.name)
        except VmSandboxError as exc:
            problems.append(f"domain {d.name} ({why}) not removed: {exc}")
        else:
            done.append(f"removed domain {d.name} ({why})")
    return Outcome(tuple(done), tuple(problems))


def remove_state_domains(state_dir: str | Path, uri: str = DEFAULT_URI) -> Outcome:
    """Destroy and undefine every domain of the state in ``state_dir`` (its shim stopped)."""
    try:
        owner = state_owner(state_dir)
    except VmSandboxError as exc:
        return Outcome(problems=(f"the domains of state {state_dir} not looked for: {exc}",))
    if owner is None:
        return Outcome()
    hypervisor = Hypervisor(uri, attempts=2)
    try:
        domains = [d for p in PREFIXES for d in hypervisor.list_domains(p)]
        return remove_domains(hypervisor, owned_by(domains, owner), f"state {state_dir}")
    except VmSandboxError as exc:
        return Outcome(problems=(f"the domains of state {state_dir} not listed: {exc}",))
    finally:
        hypervisor.close()


MAX_NETWORK_RECORD_BYTES = 1 << 20


def remove_state_networks(state_dir: str | Path) -> Outcome:
    """With the shim stopped: the macvtap and, unless its caller gave it, the network namespace
    each pod network record of the state names (``<state>/network/<sandbox id>.json``, as
    ``shim.pod_networks`` writes it), then the record. A record's names are used only when they are
    the ones the shim gives that sandbox (``vmt`` + 12 hex digits of its id; a namespace file named
    ``vmsandbox-<id>``), so a damaged record never removes another link or file. No CNI DEL runs:
    the plugins' directories are the stopped shim's configuration; its next start's reconcile, or
    the network's own clean-up, releases what IPAM holds."""
    records = Path(state_dir) / "network"
    if not records.is_dir():
        return Outcome()
    done, problems = [], []
    for path in sorted(records.glob("*.json")):
        sid = path.stem
        try:
            st = os.lstat(path)
            if (
                not re.fullmatch(r"[0-9a-f]{64}", sid)
                or not S_ISREG(st.st_mode)
                or st.st_size > MAX_NETWORK_RECORD_BYTES
            ):
                raise ValueError("not a pod network record of the shim's (a regular file named by a sandbox id)")
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            link = doc.get("macvtap")
            if link is not None and link != macvtap_name(sid):
                raise ValueError(f"names the link {str(link)[:40]!r}, not its sandbox's")
            ns = Path(str(doc.get("netns", "")))
            own_ns = doc.get("owner") != OWNER_CALLER and ns.name == netns_name(sid)
            if link is not None:
                netns.delete_link(link)
            if own_ns:
                netns.delete(ns)
            path.unlink(missing_ok=True)
        except (OSError, ValueError, VmSandboxError) as exc:
            problems.append(f"pod network of {sid[:12]} (state {state_dir}) not removed: {exc}")
        else:
            done.append(f"removed the pod network of {sid[:12]} (state {state_dir})")
    return Outcome(tuple(done), tuple(problems))


def remove_orphans(uri: str = DEFAULT_URI) -> Outcome:
    """Destroy and undefine every vmsandbox domain whose state directory is gone."""
    hypervisor = Hypervisor(uri, attempts=2)
    try:
        domains = [d for p in PREFIXES for d in hypervisor.list_domains(p)]
        return remove_domains(hypervisor, orphaned(domains), "its state directory is gone")
    except VmSandboxError as exc:
        return Outcome(problems=(f"vmsandbox domains not listed: {exc}",))
    finally:
        hypervisor.close()


def remove_through_shim(socket: str | Path, vm_ids: set[str], timeout_s: float = 180) -> Outcome:
    """StopPodSandbox and RemovePodSandbox of every sandbox the shim on ``socket`` lists (and of
    ``vm_ids``, listed or not), the VM ones first; every failure is noted and the next one tried."""
    import grpc

    from gen.cri.runtime.v1 import api_pb2 as pb
    from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc

    def why(exc: grpc.RpcError) -> str:
        if not isinstance(exc, grpc.Call):
            return str(exc)
        first = (exc.details() or "").strip().splitlines()[:1]
        return f"{exc.code().name}: {first[0]}" if first else exc.code().name

    done: list[str] = []
    problems: list[str] = []
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        rt = pb_grpc.RuntimeServiceStub(channel)
        listed: list[tuple[str, str]] = []
        try:
            for s in rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
                listed.append((s.id, f"{s.metadata.namespace}/{s.metadata.name}"))
        except grpc.RpcError as exc:
            problems.append(f"ListPodSandbox failed ({why(exc)}); removing the state's own sandboxes by id")
        for sid, label in removal_order(listed, vm_ids):
            kind = "VM" if sid in vm_ids else "downstream"
            try:
                rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=timeout_s)
                rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=timeout_s)
            except grpc.RpcError as exc:
                problems.append(f"{kind} sandbox {sid[:13]} ({label}) not removed: {why(exc)}")
            else:
                done.append(f"removed {kind} sandbox {sid[:13]} ({label})")
    return Outcome(tuple(done), tuple(problems))


def _report(outcome: Outcome, prog: str) -> int:
    for line in outcome.done:
        print(line, flush=True)
    for line in outcome.problems:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
    return 1 if outcome.problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.teardown", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sandboxes", help="remove every sandbox through the shim, the state's own first")
    p.add_argument("socket")
    p.add_argument("--state-dir", required=True)
    p = sub.add_parser("domains", help="remove the domains and pod networks of a state whose shim is stopped")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--libvirt-uri", default=DEFAULT_URI)
    p = sub.add_parser("orphans", help="remove the vmsandbox domains whose state directory is gone")
    p.add_argument("--libvirt-uri", default=DEFAULT_URI)
    args = parser.parse_args(argv)
    prog = f"teardown {args.command}"
    try:
        if args.command == "sandboxes":
            try:
                ids, unread = state_sandbox_ids(args.state_dir), Outcome()
            except VmSandboxError as exc:  # the shim still lists them
                ids, unread = set(), Outcome(problems=(f"the state's sandboxes not read: {exc}",))
            outcome = unread + remove_through_shim(args.socket, ids)
        elif args.command == "domains":
            outcome = remove_state_domains(args.state_dir, args.libvirt_uri) + remove_state_networks(args.state_dir)
        else:
            outcome = remove_orphans(args.libvirt_uri)
    except Exception as exc:  # one plain line for the script that runs this, never a traceback
        outcome = Outcome(problems=(f"{type(exc).__name__}: {exc}",))
    return _report(outcome, prog)


if __name__ == "__main__":
    sys.exit(main())
