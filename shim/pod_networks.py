"""``PodNetworks``: the pods' networks on the host — each pod's network namespace, its CNI
attachment and the macvtap its guest's NIC uses — and the one component that knows how they are
named and recorded.

A pod that is not host-network gets a namespace (``<netns_dir>/vmsandbox-<sandbox id>``), CNI ADD
of the configuration chosen from ``cni_conf_dir`` with ``eth0`` as the interface, and a passthru
macvtap on that ``eth0`` moved to the host namespace for libvirt (why: docs/network.md,
"Pod network"). What was done is recorded in ``<state_dir>/network/<sandbox id>.json`` before it is
done, so DEL (at StopPodSandbox, retried until it succeeds) and the clean-up of a shim that died
half-way (``reconcile``) use the same configuration and the ADD result. A host-network pod gets
QEMU's user-mode network and no CNI; ``pod_network: none`` gives pods no NIC at all.

A pod may instead come with a namespace its caller made and ran CNI ADD in (containerd's CRI
plugin, when vmsandbox is its sandbox shim): then no namespace is made and no CNI runs here; what
``eth0`` carries is read there (``vmsandbox.given_netns``) and the macvtap goes on it as above. Its
record says ``"owner": "caller"``, and the shim then only ever deletes the macvtap and the record:
CNI DEL and the namespace are the caller's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim import faults
from shim.config import ShimConfig
from vmsandbox import cni, cri_metrics
from vmsandbox.adapters import cni_exec, netns, sysfs
from vmsandbox.domain import NetworkInterface
from vmsandbox.errors import InvalidArgument, VmSandboxError, WrongState
from vmsandbox.given_netns import guest_network, parse_interfaces, parse_routes
from vmsandbox.network import GuestNic, NamespaceOptions, PodNetwork, PortMapping, Route
from vmsandbox.pod import PodMeta

log = logging.getLogger(__name__)

NETNS_PREFIX = "vmsandbox-"
MACVTAP_PREFIX = "vmt"  # + 12 hex digits of the sandbox id: 15 characters, the kernel's limit
# QEMU's user-mode network: the guest's address, the gateway (the host) and its prefix are fixed
USER_NET = GuestNic("", ("10.0.2.15/24",), (Route("0.0.0.0/0", "10.0.2.2"),))
DEL_ATTEMPTS = 3
OWNER_CALLER = "caller"  # a record's "owner" when the namespace was given (absent: the shim's own)


@dataclass(frozen=True)
class Attachment:
    """What a pod's guest gets: its NIC (None: no network device) and what the pod reports."""

    network: PodNetwork
    interface: NetworkInterface | None


def macvtap_name(sandbox_id: str) -> str:
    """The macvtap a sandbox's guest NIC uses: 15 characters, the kernel's limit."""
    return f"{MACVTAP_PREFIX}{sandbox_id[:12]}"


def netns_name(sandbox_id: str) -> str:
    """The file name of the network namespace the shim makes for a sandbox."""
    return f"{NETNS_PREFIX}{sandbox_id}"


def _user_mac(sandbox_id: str) -> str:
    """A locally administered MAC derived from the sandbox id (QEMU's 52:54:00 prefix)."""
    return "52:54:00:" + ":".join(sandbox_id[i : i + 2] for i in (0, 2, 4))


def _given(doc: dict[str, Any]) -> bool:
    """Whether a record's namespace is its caller's: then the shim runs no CNI DEL and never
    deletes the namespace."""
    return doc.get("owner") == OWNER_CALLER


class PodNetworks:
    def __init__(self, config: ShimConfig) -> None:
        self.mode = config.pod_network
        self.conf_dir = Path(config.cni_conf_dir)
        self.bin_dirs = tuple(config.cni_bin_dirs)
        self.netns_dir = Path(config.netns_dir)
        self.records = Path(config.state_dir) / "network"
        self._lock = threading.Lock()
        self._seen: tuple[tuple[str, int, int], ...] | None = None
        self._network: cni.NetworkConfig | None = None
        self._skipped: list[str] = []
        self.sys_root = "/sys"  # where the macvtaps' counters are read (tests point it at a tree)

    # -- the configuration ----------------------------------------------------------------------
    def _current(self) -> tuple[cni.NetworkConfig | None, list[str]]:
        """The configuration to use, read again whenever the directory's files changed."""
        try:
            entries = sorted(
                (e.name, e.stat().st_mtime_ns, e.stat().st_size)
                for e in os.scandir(self.conf_dir)
                if e.name.endswith(cni.CONFIG_SUFFIXES) and e.is_file()
            )
        except OSError:
            entries = []
        seen = tuple(entries)
        with self._lock:
            if seen != self._seen:
                texts = []
                for name, _, size in entries:
                    if size > cni.MAX_CONFIG_BYTES:
                        continue
                    try:
                        texts.append((name, (self.conf_dir / name).read_text(errors="replace")))
                    except OSError:
                        continue
                self._network, self._skipped = cni.choose_network(texts)
                self._seen = seen
                if self._network is not None:
                    log.info(
                        "pod network: CNI network %r from %s", self._network.name, self.conf_dir / self._network.source
                    )
            return self._network, self._skipped

    def ready(self) -> tuple[bool, str, str]:
        """NetworkReady for Status: (ready, reason, message)."""
        if self.mode == "none":
            return True, "", ""
        network, skipped = self._current()
        if network is not None:
            return True, "", ""
        why = f" ({'; '.join(skipped)})" if skipped else ""
        return (
            False,
            "NetworkPluginNotReady",
            f"cni plugin not initialized: no valid network configuration in {self.conf_dir}{why}"[:1024],
        )

    # -- records --------------------------------------------------------------------------------
    def _record_path(self, sandbox_id: str) -> Path:
        return self.records / f"{sandbox_id}.json"

    def _write(self, sandbox_id: str, doc: dict[str, Any]) -> None:
        self.records.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.records / f".{sandbox_id}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._record_path(sandbox_id))

    def _read(self, sandbox_id: str) -> dict[str, Any] | None:
        try:
            doc = json.loads(self._record_path(sandbox_id).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.error("pod network record of %s is unreadable, treated as absent: %s", sandbox_id[:12], exc)
            return None
        return doc if isinstance(doc, dict) else None

    # -- counters -------------------------------------------------------------------------------
    def link_counters(self, sandbox_id: str) -> tuple[tuple[str, cri_metrics.LinkCounters], ...]:
        """The pod's network counters as the pod sees them, by the interface name CNI gave it in
        the pod's namespace: those of its macvtap, which carries every frame of its guest's NIC
        (none for a pod without a CNI attachment, or whose macvtap is gone)."""
        doc = self._read(sandbox_id)
        if doc is None or doc.get("state") != "attached" or not isinstance(doc.get("macvtap"), str):
            return ()
        host = sysfs.link_counters(doc["macvtap"], self.sys_root)
        if host is None:
            return ()
        return ((cni.IFNAME, cri_metrics.pod_side("macvtap", host)),)

    # -- attach / detach ------------------------------------------------------------------------
    def attach(
        self,
        sandbox_id: str,
        meta: PodMeta,
        namespaces: NamespaceOptions,
        ports: tuple[PortMapping, ...],
        annotations: dict[str, str],
        given_netns: str | None = None,
    ) -> Attachment:
        """The pod's network, made whole or not at all (everything undone before an error leaves).
        With ``given_netns``, in that namespace, which the caller made and ran CNI in (whatever
        ``pod_network`` says: the caller reports the pod's IPs, so its guest must carry them)."""
        if given_netns is not None:
            if namespaces.host_network:
                raise InvalidArgument(
                    f"network namespace {given_netns[:200]!r} given for a host-network pod, which has none of its own"
                )
            return self._attach_given(sandbox_id, given_netns)
        if self.mode == "none":
            return Attachment(PodNetwork(), None)
        if namespaces.host_network:
            mac = _user_mac(sandbox_id)
            return Attachment(
                PodNetwork(nic=GuestNic(mac, USER_NET.addresses, USER_NET.routes)),
                NetworkInterface("user", mac),
            )
        network, _ = self._current()
        if network is None:
            raise WrongState(self.ready()[2])
        path = self.netns_dir / netns_name(sandbox_id)
        args = cni.PodArgs(sandbox_id, str(path), meta.namespace, meta.name, meta.uid)
        capabilities = cni.runtime_config(ports, annotations)
        doc: dict[str, Any] = {
            "netns": str(path),
            "network": network.to_doc(),
            "args": {"namespace": meta.namespace, "name": meta.name, "uid": meta.uid},
            "capabilities": capabilities,
            "result": None,
            "macvtap": macvtap_name(sandbox_id),
            "state": "adding",
        }
        self._write(sandbox_id, doc)  # before anything exists, so a crash from here on is cleaned up
        started = time.monotonic()
        with self._whole(sandbox_id, doc):
            netns.create(path)
            result: dict[str, Any] | None = None
            for i, plugin in enumerate(network.plugins):
                stdin = cni.plugin_input(network, i, capabilities, result)
                result = cni_exec.run_plugin(
                    plugin["type"], stdin, cni.plugin_env("ADD", args, self.bin_dirs), self.bin_dirs, want_result=True
                )
            assert result is not None
            doc["result"] = result
            self._write(sandbox_id, doc)
            faults.checkpoint("network:after-add")
            mac, mtu = netns.link(path, cni.IFNAME)
            pod = cni.pod_network(result, mac, mtu)
            netns.add_macvtap(path, cni.IFNAME, doc["macvtap"])
            doc["state"] = "attached"
            self._write(sandbox_id, doc)
        log.info(
            "pod network of %s: %s on %s, macvtap %s, in %d ms",
            sandbox_id[:12],
            ", ".join(pod.ips),
            network.name,
            doc["macvtap"],
            (time.monotonic() - started) * 1000,
        )
        return Attachment(pod, NetworkInterface("ethernet", mac, doc["macvtap"]))

    def _attach_given(self, sandbox_id: str, path: str) -> Attachment:
        """The macvtap on ``eth0`` of the namespace ``path`` the caller made, and what ``eth0``
        carries there for the guest; nothing of the namespace is changed but the macvtap."""
        doc: dict[str, Any] = {
            "owner": OWNER_CALLER,
            "netns": path,
            "macvtap": macvtap_name(sandbox_id),
            "state": "adding",
        }
        started = time.monotonic()
        with self._whole(sandbox_id, doc):
            with netns.given(path) as held:
                self._write(sandbox_id, doc)  # before the macvtap exists, so a crash from here on is cleaned up
                interfaces, routes4, routes6 = netns.read_network(held)
                pod = guest_network(
                    parse_interfaces(interfaces),
                    parse_routes(routes4, 4) + parse_routes(routes6, 6),
                    f"network namespace {path}",
                )
                netns.add_macvtap(held, cni.IFNAME, doc["macvtap"])
                faults.checkpoint("network:given-macvtap")
            doc["state"] = "attached"
            self._write(sandbox_id, doc)
        assert pod.nic is not None
        log.info(
            "pod network of %s: %s in the given namespace %s, macvtap %s, in %d ms",
            sandbox_id[:12],
            ", ".join(pod.ips),
            path,
            doc["macvtap"],
            (time.monotonic() - started) * 1000,
        )
        return Attachment(pod, NetworkInterface("ethernet", pod.nic.mac, doc["macvtap"]))

    def _del(self, sandbox_id: str, doc: dict[str, Any]) -> None:
        """CNI DEL of every plugin, last first, with the ADD result (a plugin tolerates DEL of what
        it never added, so a half-made ADD is deleted the same way)."""
        network = cni.parse_config(json.dumps(doc["network"]), f"the configuration recorded for {sandbox_id[:12]}")
        path = Path(doc["netns"])
        a = doc["args"]
        args = cni.PodArgs(sandbox_id, str(path) if netns.exists(path) else "", a["namespace"], a["name"], a["uid"])
        result = doc.get("result")
        for i in reversed(range(len(network.plugins))):
            prev = result if network.cni_version not in ("0.3.0", "0.3.1") else None
            stdin = cni.plugin_input(network, i, doc.get("capabilities") or {}, prev)
            cni_exec.run_plugin(
                network.plugins[i]["type"],
                stdin,
                cni.plugin_env("DEL", args, self.bin_dirs),
                self.bin_dirs,
                want_result=False,
            )

    @contextlib.contextmanager
    def _whole(self, sandbox_id: str, doc: dict[str, Any]) -> Iterator[None]:
        """Everything the block made of the network recorded in ``doc`` is undone when it fails;
        the error says it was the pod network."""
        try:
            yield
        except BaseException as exc:
            try:
                self._undo(sandbox_id, doc)
            except VmSandboxError as undo_exc:
                log.error(
                    "pod network of %s: undoing a failed set-up failed, left for reconcile: %s",
                    sandbox_id[:12],
                    undo_exc,
                )
            if isinstance(exc, VmSandboxError):
                raise type(exc)(f"pod network: {exc}") from exc
            raise

    def _undo(self, sandbox_id: str, doc: dict[str, Any]) -> None:
        # in a given namespace, a macvtap a crash left there (made, not moved out yet) goes with
        # eth0 when the caller deletes the namespace, as the failed sandbox makes it do
        netns.delete_link(doc["macvtap"])
        if not _given(doc):
            self._del(sandbox_id, doc)
            netns.delete(Path(doc["netns"]))
        self._record_path(sandbox_id).unlink(missing_ok=True)

    def detach(self, sandbox_id: str) -> None:
        """StopPodSandbox: CNI DEL (retried); the namespace stays until ``remove``. Idempotent; a
        DEL that keeps failing raises, and the attachment stays recorded for the next try. In a
        namespace the caller gave, only the macvtap goes (CNI DEL is the caller's)."""
        doc = self._read(sandbox_id)
        if doc is None or doc.get("state") == "deleted":
            return
        netns.delete_link(doc["macvtap"])
        if _given(doc):
            doc["state"] = "deleted"
            self._write(sandbox_id, doc)
            log.info("pod network of %s: macvtap deleted (the namespace is its caller's)", sandbox_id[:12])
            return
        for attempt in range(DEL_ATTEMPTS):
            try:
                self._del(sandbox_id, doc)
                break
            except cni.CniError as exc:
                if attempt == DEL_ATTEMPTS - 1:
                    raise cni.CniError(
                        f"pod network of {sandbox_id[:12]}: {exc} (tried {DEL_ATTEMPTS} times; the next "
                        "StopPodSandbox or the periodic reconcile tries again)"
                    ) from exc
                time.sleep(0.2 * (attempt + 1))
        doc["state"] = "deleted"
        self._write(sandbox_id, doc)
        log.info("pod network of %s: CNI DEL done", sandbox_id[:12])

    def remove(self, sandbox_id: str) -> None:
        """RemovePodSandbox: DEL if not done yet, then the namespace (unless the caller's) and the
        record go."""
        doc = self._read(sandbox_id)
        if doc is None:
            return
        self.detach(sandbox_id)
        if not _given(doc):
            netns.delete(Path(doc["netns"]))
        self._record_path(sandbox_id).unlink(missing_ok=True)

    def reconcile(self, live: set[str]) -> list[str]:
        """Removes the networks of sandboxes that no longer exist (a shim that died half-way through
        RunPodSandbox, a rollback whose DEL failed); returns what it removed. Only recorded networks
        are touched: every namespace and macvtap is recorded before it is made, and other shims may
        share the namespace directory."""
        removed: list[str] = []
        if not self.records.is_dir():
            return removed
        for p in sorted(self.records.glob("*.json")):
            sid = p.stem
            if sid in live:
                continue
            try:
                self.remove(sid)
                removed.append(sid)
                log.warning("reconcile: removed the pod network of sandbox %s, which no longer exists", sid[:12])
            except VmSandboxError as exc:
                log.error("reconcile: pod network of %s not removed yet: %s", sid[:12], exc)
        return removed
