"""``RuncNics``: the claimed network devices of ordinary (runc) pods, one owner.

The kubelet prepares an ordinary pod's claims of this driver as it does a VM pod's; containerd runs
the pod and tells NRI's RunPodSandbox (``shim.dra.nri_plugin``), and here each device of the pod's
prepared claims (``ClaimStore.for_pod``) becomes a link of its network namespace
(``vmsandbox.dra_runc.runc_nics``): a veth pair whose host end is a port of a ``bridge`` network's
bridge, or a macvlan on a ``macvlan`` network's host interface, named, given the claim's static
addresses and brought up. Pods of vmsandbox's own handlers are left alone (their NICs are their
VM's). What is made for a pod is recorded first, one JSON file per sandbox under
``<state_dir>/dra/runc`` (0700, files 0600, written atomically), so that a failure, StopPodSandbox,
RemovePodSandbox or, after a crash, the reconcile with the runtime's pods (NRI's Synchronize)
removes it all: the host links (a veth's peer goes with it; a macvlan goes with the namespace)
and the record. A failure fails the pod's RunPodSandbox with its message, after the rollback. Once
the links are up, each claim's ``status.devices[]`` is written as a VM pod's is, from what the
namespace shows (``DraDriver.write_status``), on a thread of its own (NRI bounds a plugin's call).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from shim.dra.record_files import fsync_dir, read_bounded, write_atomically
from shim.dra.store import ClaimStore
from vmsandbox.adapters import netns
from vmsandbox.agent_protocol import NicReport
from vmsandbox.dra import ClaimedNic, NetworkAttachment, PreparedClaim
from vmsandbox.dra_runc import (
    HOST_LINK_PREFIX,
    Made,
    RuncNic,
    RuncPod,
    check_netns,
    check_sandbox_id,
    made_from_record,
    made_record,
    nic_report,
    runc_nics,
)
from vmsandbox.errors import InvalidArgument, VmSandboxError

log = logging.getLogger(__name__)

StatusWriter = Callable[[Sequence[PreparedClaim], Sequence[ClaimedNic], Sequence[NicReport], str], None]
_OURS = re.compile(rf"{HOST_LINK_PREFIX}[0-9a-f]{{12}}")
WHERE = "the pod's network namespace"


class Links(Protocol):
    """The host's links as ``RuncNics`` makes them (``vmsandbox.adapters.netns``; a fake in tests)."""

    def hold(self, path: str) -> AbstractContextManager[Path]: ...
    def add_veth(self, ns: Path, host: str, name: str, mac: str, bridge: str) -> None: ...
    def add_macvlan(self, ns: Path, lower: str, mode: str, name: str, mac: str) -> None: ...
    def address(self, ns: Path, name: str, cidrs: tuple[str, ...]) -> None: ...
    def read(self, ns: Path, name: str) -> str: ...
    def delete_in(self, ns: Path, name: str) -> None: ...
    def delete(self, host: str) -> None: ...
    def host_links(self) -> list[str]: ...


class HostLinks:
    """``Links`` with iproute2 (``vmsandbox.adapters.netns``)."""

    def hold(self, path: str) -> AbstractContextManager[Path]:
        return netns.given(path)

    def add_veth(self, ns: Path, host: str, name: str, mac: str, bridge: str) -> None:
        netns.add_veth_into(ns, host, name, mac, bridge)

    def add_macvlan(self, ns: Path, lower: str, mode: str, name: str, mac: str) -> None:
        netns.add_macvlan_into(ns, lower, mode, name, mac)

    def address(self, ns: Path, name: str, cidrs: tuple[str, ...]) -> None:
        netns.address_in(ns, name, cidrs)

    def read(self, ns: Path, name: str) -> str:
        return netns.addresses_in(ns, name)

    def delete_in(self, ns: Path, name: str) -> None:
        netns.delete_link_in(ns, name)

    def delete(self, host: str) -> None:
        netns.delete_link(host)

    def host_links(self) -> list[str]:
        return sorted(os.listdir("/sys/class/net"))


def runc_dir(state_dir: str) -> Path:
    return Path(state_dir) / "dra" / "runc"


class RuncNics:
    def __init__(
        self,
        store: ClaimStore,
        networks: tuple[NetworkAttachment, ...],
        vm_handlers: frozenset[str],
        directory: Path,
        status: StatusWriter | None = None,
        links: Links | None = None,
    ) -> None:
        self._store = store
        self._networks = networks
        self._vm_handlers = vm_handlers
        self._dir = directory
        self._status = status
        self._links: Links = links if links is not None else HostLinks()
        self._lock = threading.Lock()  # one pod's links at a time, and the reconcile
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)

    # -- RunPodSandbox ------------------------------------------------------------------------
    def attach(self, pod: RuncPod) -> list[RuncNic]:
        """Make the pod's claimed devices in its namespace (none when it has no claims of this
        driver, or is a VM pod); a failure removes what was made and raises, naming the device."""
        if pod.runtime_handler in self._vm_handlers:
            return []  # a VM pod: its claims are its domain's NICs
        claims = [c for c in self._store.for_pod(pod.uid) if c.devices] if pod.uid else []
        if not claims:
            return []
        check_sandbox_id(pod.sandbox_id)
        nics = list(runc_nics(pod.full_name, pod.sandbox_id, claims, self._networks))
        path = check_netns(pod)
        made = Made(pod.sandbox_id, pod.uid, tuple(n.host_link for n in nics if n.host_link))
        with self._lock:
            self._write(made)  # before anything is made: a crash leaves nothing the reconcile misses
            try:
                with self._links.hold(path) as ns:
                    reported = self._make(ns, nics)
            except BaseException:
                self._remove(made)
                raise
        seen = [replace(n.nic, mac=r.mac or n.nic.mac) for n, r in zip(nics, reported, strict=True)]
        log.info(
            "DRA: pod %s (sandbox %s) has its claimed devices %s",
            pod.full_name,
            pod.sandbox_id[:12],
            ", ".join(f"{n.nic.name} on {n.nic.device}" for n in nics),
        )
        if self._status is not None:
            status = self._status
            threading.Thread(
                target=status, args=(claims, seen, reported, WHERE), name="dra-runc-status", daemon=True
            ).start()
        return nics

    def _make(self, ns: Path, nics: list[RuncNic]) -> list[NicReport]:
        made: list[RuncNic] = []
        try:
            for n in nics:
                what = f"claim {n.nic.claim} device {n.nic.device} ({n.nic.name})"
                try:
                    if n.nic.kind == "bridge":
                        self._links.add_veth(ns, n.host_link, n.nic.name, n.nic.mac, n.nic.host_interface)
                    else:
                        self._links.add_macvlan(ns, n.nic.host_interface, n.nic.mode, n.nic.name, n.nic.mac)
                    made.append(n)
                    self._links.address(ns, n.nic.name, n.nic.addresses)
                except VmSandboxError as exc:
                    raise type(exc)(f"{what}: {exc}") from None
            return [nic_report(self._links.read(ns, n.nic.name), n.nic.name) for n in nics]
        except BaseException:
            for n in reversed(made):
                with contextlib.suppress(VmSandboxError, OSError):
                    if n.host_link:
                        self._links.delete(n.host_link)
                    else:
                        self._links.delete_in(ns, n.nic.name)
            raise

    # -- StopPodSandbox, RemovePodSandbox, reconcile -------------------------------------------
    def detach(self, sandbox_id: str) -> bool:
        """Remove what was made for the sandbox; False when nothing was (idempotent)."""
        try:
            check_sandbox_id(sandbox_id)
        except InvalidArgument:
            return False
        with self._lock:
            made = self._read(self._dir / f"{sandbox_id}.json")
            if made is None:
                return False
            self._remove(made)
        log.info("DRA: the claimed devices of sandbox %s removed", sandbox_id[:12])
        return True

    def reconcile(self, live: set[str]) -> int:
        """Remove what was made for sandboxes the runtime no longer has, and host links of ours no
        record names (a crash between making and recording cannot leave one, but a record lost
        can); the number of sandboxes cleaned."""
        cleaned = 0
        with self._lock:
            kept: set[str] = set()
            for made in self._records():
                if made.sandbox_id in live:
                    kept.update(made.host_links)
                    continue
                self._remove(made)
                cleaned += 1
            for link in self._links.host_links():
                if _OURS.fullmatch(link) and link not in kept:
                    with contextlib.suppress(VmSandboxError, OSError):
                        self._links.delete(link)
                        log.warning("DRA: host link %s of no pod removed", link)
        if cleaned:
            log.info("DRA: the claimed devices of %d sandbox(es) gone from the runtime removed", cleaned)
        return cleaned

    def recorded(self) -> list[Made]:
        with self._lock:
            return list(self._records())

    # -- the records --------------------------------------------------------------------------
    def _records(self) -> Iterator[Made]:
        for entry in sorted(self._dir.iterdir()):
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                entry.unlink(missing_ok=True)
                continue
            if entry.name.endswith(".json"):
                made = self._read(entry)
                if made is not None:
                    yield made

    def _read(self, path: Path) -> Made | None:
        try:
            made = made_from_record(json.loads(read_bounded(path)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, InvalidArgument) as exc:
            log.warning("DRA: runc pod record %s unreadable, removed: %s", path.name, exc)
            path.unlink(missing_ok=True)
            return None
        if path.name != f"{made.sandbox_id}.json":
            log.warning("DRA: runc pod record %s names sandbox %s, removed", path.name, made.sandbox_id[:12])
            path.unlink(missing_ok=True)
            return None
        return made

    def _write(self, made: Made) -> None:
        data = json.dumps(made_record(made), sort_keys=True).encode()
        write_atomically(self._dir, f"{made.sandbox_id}.json", data)

    def _remove(self, made: Made) -> None:
        """Delete the host links, then the record (kept while a link could not be deleted)."""
        failed = []
        for link in made.host_links:
            try:
                self._links.delete(link)
            except (VmSandboxError, OSError) as exc:
                failed.append(f"{link}: {exc}")
        if failed:
            log.error("DRA: sandbox %s: host links not removed: %s", made.sandbox_id[:12], "; ".join(failed))
            return
        (self._dir / f"{made.sandbox_id}.json").unlink(missing_ok=True)
        fsync_dir(self._dir)
