"""Listing our domains survives a domain that disappears while it is listed (another shim or a
tear-down removing it between listAllDomains and the per-domain calls): the shim must still start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import libvirt
import pytest

from vmsandbox.adapters.hypervisor import Hypervisor


def _gone() -> libvirt.libvirtError:
    exc = libvirt.libvirtError("Domain not found: no domain with matching uuid")
    exc.err = (libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_FROM_QEMU, "Domain not found", 2, "", None, None, 0, 0)
    return exc


OURS = (Path(__file__).parents[2] / "golden" / "exclusive-2mi-tcg.xml").read_text()  # carries our metadata


class VanishingDomain:
    def __init__(self, name: str, fail_on: str) -> None:
        self._name, self._fail_on = name, fail_on

    def name(self) -> str:
        return self._name

    def XMLDesc(self, _flags: int) -> str:
        if self._fail_on == "xml":
            raise _gone()
        return OURS

    def isActive(self) -> int:
        raise _gone()


class Conn:
    def __init__(self, domains: list[Any]) -> None:
        self.domains = domains

    def isAlive(self) -> int:
        return 1

    def listAllDomains(self, _flags: int) -> list[Any]:
        return self.domains


def test_domains_that_vanish_while_listed_are_skipped() -> None:
    hv = Hypervisor("test:///default", attempts=1)
    hv._conn = Conn(
        [VanishingDomain("vmsandbox-" + "a" * 32, "xml"), VanishingDomain("vmsandbox-" + "b" * 32, "state")]
    )
    assert hv.list_ours() == []


def test_emulator_memory_of_a_process_that_is_not_qemu_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pid file naming a pid that another process took since: nothing is read from it."""
    hv = Hypervisor("test:///default", attempts=1)
    monkeypatch.setattr(hv, "emulator_pid", lambda name: os.getpid())
    assert hv.emulator_memory_kib("vmsandbox-x") is None
    monkeypatch.setattr(hv, "emulator_pid", lambda name: None)
    assert hv.emulator_memory_kib("vmsandbox-x") is None
