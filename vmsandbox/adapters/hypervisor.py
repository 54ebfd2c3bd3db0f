"""The libvirt adapter: define, start, inspect and tear down our domains.

Only this module imports libvirt. Transient libvirt errors (RPC hiccups, a dropped connection,
a state-change lock timeout) are retried with tenacity, reconnecting when the connection died;
every other libvirt error becomes an ``InfrastructureError`` carrying libvirt's message.
Tear-down is idempotent: a domain that is already gone is not an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import libvirt
from tenacity import (
    RetryCallState,
    before_sleep_log,
    retry,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from vmsandbox.domain import DOMAIN_PREFIX
from vmsandbox.domain_xml import read_channel_path, read_identity
from vmsandbox.errors import InfrastructureError
from vmsandbox.qemu_memory import (
    SMAPS_MAX,
    SMAPS_ROLLUP_MAX,
    beyond_guest_ram_kib,
    guest_ram_mapping_kib,
    parse_smaps_rollup,
)

log = logging.getLogger(__name__)
_log_retry = before_sleep_log(log, logging.WARNING)
T = TypeVar("T")


def _quiet(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; ours are raised and logged instead."""


libvirt.registerErrorHandler(_quiet, None)

_TRANSIENT_CODES = {
    libvirt.VIR_ERR_RPC,
    libvirt.VIR_ERR_NO_CONNECT,
    libvirt.VIR_ERR_OPERATION_TIMEOUT,
    libvirt.VIR_ERR_SYSTEM_ERROR,
}
_TRANSIENT_DOMAINS = {libvirt.VIR_FROM_RPC, libvirt.VIR_FROM_REMOTE}


def is_transient(exc: BaseException) -> bool:
    if not isinstance(exc, libvirt.libvirtError):
        return False
    code = exc.get_error_code()
    if code == libvirt.VIR_ERR_SYSTEM_ERROR:
        # system errors are transient only when they come from the connection itself
        return bool(exc.get_error_domain() in _TRANSIENT_DOMAINS)
    return bool(code in _TRANSIENT_CODES or exc.get_error_domain() in _TRANSIENT_DOMAINS)


def _no_domain(exc: libvirt.libvirtError) -> bool:
    return bool(exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN)


QEMU_RUN_DIR = "/run/libvirt/qemu"  # where qemu:///system keeps each running domain's pid file


@dataclass(frozen=True)
class DomainInfo:
    name: str
    sandbox_id: str
    active: bool
    xml: str
    owner: str = ""  # instance id of the state database that defined it ("" before schema 2)


_DAEMON_PIDFILES = (
    ("/run/libvirtd.pid", ("libvirtd",)),
    ("/run/libvirt/virtqemud.pid", ("virtqemud",)),
    ("/run/virtqemud.pid", ("virtqemud",)),
)
"""Where the system instance's daemon writes its pid (monolithic, then modular), and its name."""


class Hypervisor:
    """One libvirt connection, shared by threads, reopened when it dies."""

    def __init__(self, uri: str, *, attempts: int = 4, observe: Callable[[str], None] | None = None) -> None:
        self.uri = uri
        self._attempts = attempts
        self._observe = observe or (lambda _event: None)  # "retry" / "error", for metrics
        self._lock = threading.Lock()
        self._conn: Any = None

    def _connection(self) -> Any:
        with self._lock:
            if self._conn is not None:
                try:
                    if self._conn.isAlive():
                        return self._conn
                except libvirt.libvirtError:
                    pass
                log.warning("libvirt connection to %s is dead; reconnecting", self.uri)
            try:
                self._conn = libvirt.open(self.uri)
            except libvirt.libvirtError as exc:
                self._observe("error")
                raise InfrastructureError(f"cannot connect to libvirt at {self.uri}: {exc}") from exc
            return self._conn

    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(conn)``, retrying transient libvirt errors; wrap the rest."""

        @retry(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=0.1, max=2),
            before_sleep=self._before_retry,
            reraise=True,
        )
        def attempt() -> T:
            return fn(self._connection())

        try:
            return attempt()
        except libvirt.libvirtError as exc:
            self._observe("error")
            raise InfrastructureError(f"libvirt {what}: {exc}") from exc

    def _before_retry(self, state: RetryCallState) -> None:
        self._observe("retry")
        _log_retry(state)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(libvirt.libvirtError):
                    self._conn.close()
                self._conn = None

    # -- queries --------------------------------------------------------------------------------
    def version(self) -> str:
        def get(conn: Any) -> str:
            v = conn.getLibVersion()
            return f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000}"

        return self._call("version", get)

    def qemu_version(self) -> str:
        """The version of the hypervisor libvirt runs (QEMU's), as ``7.2.22``."""

        def get(conn: Any) -> str:
            v = conn.getVersion()
            return f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000}"

        return self._call("hypervisor version", get)

    def live_xml(self, name: str) -> str:
        return self._call(f"XML of {name}", lambda conn: str(conn.lookupByName(name).XMLDesc(0)))

    def is_active(self, name: str) -> bool:
        """Whether the guest of ``name`` is running (False when there is no such domain)."""

        def get(conn: Any) -> bool:
            try:
                return bool(conn.lookupByName(name).isActive())
            except libvirt.libvirtError as exc:
                if _no_domain(exc):
                    return False
                raise

        return self._call(f"state of {name}", get)

    def emulator_pid(self, name: str) -> int | None:
        """The pid of the running QEMU of ``name`` (libvirt's pid file for the domain), None when
        the domain is not running. Only the system instance's run directory is known."""
        if not self.is_active(name):
            return None
        try:
            return int(Path(QEMU_RUN_DIR, f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def emulator_memory_kib(self, name: str, guest_ram_kib: int = 0) -> int | None:
        """QEMU's private memory beyond guest RAM for the running domain ``name``, in KiB (its
        anonymous pages, ``vmsandbox.qemu_memory``); ``guest_ram_kib``: the guest RAM of a domain on
        ordinary pages, whose mapping (found in the full smaps) is taken out (0: hugepage-backed,
        never anonymous). None when it is not running or cannot be read. The pid file names a
        process that may have exited since, its pid taken by another: only a process named
        ``qemu*`` is read, at most ``SMAPS_ROLLUP_MAX`` (``SMAPS_MAX``) bytes, never through a symlink."""
        pid = self.emulator_pid(name)
        if pid is None:
            return None
        proc = Path("/proc", str(pid))
        try:
            if not proc.joinpath("comm").read_text()[:64].startswith("qemu"):
                return None
            rollup = parse_smaps_rollup(_read_proc(proc / "smaps_rollup", SMAPS_ROLLUP_MAX))
            guest_ram = None
            if guest_ram_kib > 0:
                smaps = _read_proc(proc / "smaps", SMAPS_MAX).decode("ascii", errors="replace")
                guest_ram = guest_ram_mapping_kib(smaps, guest_ram_kib)
        except (OSError, UnicodeDecodeError):
            return None
        return beyond_guest_ram_kib(rollup, guest_ram)

    def daemon_pid(self) -> int | None:
        """The pid of the libvirt daemon that starts this URI's QEMUs (``libvirtd`` or
        ``virtqemud`` of the system instance, by its pid file), or None when there is none to
        find (an embedded or test driver, a daemon without a pid file): each QEMU's mount
        namespace is a copy of that daemon's, so what a guest must see mounted is mounted there."""
        if not self.uri.startswith("qemu:///system"):
            return None
        for pidfile, names in _DAEMON_PIDFILES:
            try:
                pid = int(Path(pidfile).read_text().strip())
                if Path(f"/proc/{pid}/comm").read_text().strip() in names:
                    return pid
            except (OSError, ValueError):
                continue
        return None

    def channel_path(self, name: str, channel: str) -> str:
        path = read_channel_path(self.live_xml(name), channel)
        if not path:
            raise InfrastructureError(f"domain {name} has no socket for channel {channel}")
        return path

    def list_ours(self) -> list[DomainInfo]:
        """Every sandbox domain carrying our metadata (running or only defined)."""
        return self.list_domains(DOMAIN_PREFIX)

    def list_domains(self, prefix: str) -> list[DomainInfo]:
        """Every domain whose name starts with ``prefix`` and that carries our metadata."""

        def get(conn: Any) -> list[DomainInfo]:
            out = []
            for dom in conn.listAllDomains(0):
                name = dom.name()
                if not name.startswith(prefix):
                    continue
                try:
                    xml = dom.XMLDesc(0)
                    active = bool(dom.isActive())
                except libvirt.libvirtError as exc:
                    if _no_domain(exc):
                        continue  # removed while we listed (another shim or a tear-down)
                    raise
                ident = read_identity(xml)
                if ident is None:
                    continue
                out.append(
                    DomainInfo(name=name, sandbox_id=ident.sandbox_id, active=active, xml=xml, owner=ident.owner)
                )
            return out

        return self._call("list domains", get)

    # -- lifecycle ------------------------------------------------------------------------------
    def define(self, xml: str) -> None:
        self._call("define", lambda conn: conn.defineXML(xml))

    def start(self, name: str, paused: bool = False) -> None:
        """Start the defined domain ``name``; ``paused``: its QEMU runs, its vCPUs not yet (``resume``)."""
        flags = libvirt.VIR_DOMAIN_START_PAUSED if paused else 0
        self._call(f"start {name}", lambda conn: conn.lookupByName(name).createWithFlags(flags))

    def resume(self, name: str) -> None:
        self._call(f"resume {name}", lambda conn: conn.lookupByName(name).resume())

    def create_transient(self, xml: str) -> None:
        """Start a domain that libvirt forgets when it stops (a snapshot's guest)."""
        self._call("create", lambda conn: conn.createXML(xml, 0))

    def save(self, name: str, path: str) -> None:
        """Save the running guest of ``name`` to ``path`` (libvirt's save image); the guest stops."""
        self._call(f"save {name}", lambda conn: conn.lookupByName(name).saveFlags(path, None, 0))

    def restore(self, path: str, xml: str) -> None:
        """Restore the save image at ``path`` as the domain of ``xml`` (libvirt checks that the
        XML keeps the saved guest's ABI) and let it run. The domain is defined first by the caller
        when it is to outlive its guest."""
        self._call("restore", lambda conn: conn.restoreFlags(path, xml, libvirt.VIR_DOMAIN_SAVE_RUNNING))

    def destroy(self, name: str) -> bool:
        """Stop the guest of ``name`` (its definition stays); True if it was running."""

        def stop(conn: Any) -> bool:
            try:
                dom = conn.lookupByName(name)
                if not dom.isActive():
                    return False
                dom.destroy()
                return True
            except libvirt.libvirtError as exc:
                if _no_domain(exc) or exc.get_error_code() == libvirt.VIR_ERR_OPERATION_INVALID:
                    return False
                raise

        return self._call(f"destroy {name}", stop)

    def teardown(self, name: str) -> bool:
        """Destroy (if running) and undefine ``name``; True if there was anything to remove."""

        def remove(conn: Any) -> bool:
            try:
                dom = conn.lookupByName(name)
            except libvirt.libvirtError as exc:
                if _no_domain(exc):
                    return False
                raise
            try:
                if dom.isActive():
                    dom.destroy()
            except libvirt.libvirtError as exc:
                if not (_no_domain(exc) or exc.get_error_code() == libvirt.VIR_ERR_OPERATION_INVALID):
                    raise
            try:
                dom.undefine()
            except libvirt.libvirtError as exc:
                if not _no_domain(exc):
                    raise
            return True

        return self._call(f"tear down {name}", remove)

    # -- devices of a running guest -------------------------------------------------------------
    def attach_device(self, name: str, xml: str) -> None:
        """Hot-plug the device ``xml`` into the running guest of ``name`` (live only: the
        definition stays as RunPodSandbox made it)."""
        self._call(
            f"attach a device to {name}",
            lambda conn: conn.lookupByName(name).attachDeviceFlags(xml, libvirt.VIR_DOMAIN_AFFECT_LIVE),
        )

    def detach_device(self, name: str, xml: str) -> None:
        """Ask the running guest of ``name`` to give up the device ``xml``; libvirt finishes the
        removal when the guest agrees. A guest that is not running has nothing to detach."""

        def detach(conn: Any) -> None:
            try:
                conn.lookupByName(name).detachDeviceFlags(xml, libvirt.VIR_DOMAIN_AFFECT_LIVE)
            except libvirt.libvirtError as exc:
                gone = (libvirt.VIR_ERR_OPERATION_INVALID, libvirt.VIR_ERR_DEVICE_MISSING)
                if not (_no_domain(exc) or exc.get_error_code() in gone):
                    raise

        self._call(f"detach a device from {name}", detach)


def _read_proc(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of a /proc file, never through a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
