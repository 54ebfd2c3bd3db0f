"""Fault injection at named points: die by SIGKILL there, or fail the RPC there.

**A test-only hook, inert unless the environment variable ``VMSANDBOX_FAULT`` is set or a test
in the same process calls ``raising``.** The variable is read once, when this module is imported.

- ``VMSANDBOX_FAULT=<point>``: the first ``checkpoint()`` with that name kills the shim on the
  spot (``SIGKILL``: no ``finally``, no rollback, no flush, exactly like the OOM killer or a power
  cut), so a test can restart the shim on the same state directory and check what reconciliation
  makes of the remains.
- ``VMSANDBOX_FAULT=raise:<point>``, or ``with faults.raising(point):`` in process: that
  ``checkpoint()`` raises ``InjectedFault`` instead, so the RPC's own rollback runs (``shim.rpc``)
  and a test checks that it left nothing behind.

Production never sets either; then ``checkpoint()`` is a comparison with an empty string. The
points of each RPC's steps are ``shim.rpc``'s ``<rpc>:<step>`` names (``rpc_points``), right
after that step: ``RunPodSandbox:claim`` (the claims are committed, the sandbox row is not
written yet), ``RemovePodSandbox:guest-destroy`` (the guest is gone, its domain still defined
and its claims held), ``CreateContainer:admit`` (admitted and recorded, its guest has not made it),
``CreateContainer:guest-create`` (the guest made it, the record does not say so),
``StartContainer:guest-start`` (the guest started it, the record does not say so),
``PullImage:blobs`` (the blobs are in the store, no disk made) and ``PullImage:disk`` (the disk is
in place, the catalogue does not name the image), for instance. The points below are the ones
inside the owners' own work:

``network:after-add``  RunPodSandbox's row says ``creating``; CNI ADD is done, the macvtap not made yet
``network:given-macvtap``  the macvtap is on the given namespace's ``eth0``; its record says ``adding``
``restore:after-stage``        the snapshot's image is copied for the pod, libvirt has not read it
``restore:after-restore``      the guest is restored and running, not yet made this pod's
``restore:after-personalize``  the restored guest is this pod's; the row still says ``creating``
``snapshot:after-start``       a snapshot's guest is booting (its claims held under the snapshot key)
``snapshot:after-save``        the snapshot's image is written, not yet moved into the store
``hot-plug:after-vcpus``       a resize's vCPUs are online in the guest, its memory not yet plugged
``hot-plug:after-dimm``        a resize's DIMM is plugged too; the guest has not shown them online
``dra:after-record``           NodePrepareResources kept a claim's record saying ``adding``; no host-local ADD yet
``dra:after-ipam-add``         host-local ADDed the claim's addresses; its record still says ``adding``
``dra:after-ipam-del``         NodeUnprepareResources DELeted the claim's addresses; its record is still kept
``dra:before-status``          the pod is READY with its claimed NICs; their claims' status not written yet
``dra:after-status``           the claims' status is written; RunPodSandbox has not answered yet
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator

from vmsandbox.errors import InfrastructureError

log = logging.getLogger(__name__)

ENV = "VMSANDBOX_FAULT"
POINTS = (
    "network:after-add",
    "network:given-macvtap",
    "restore:after-stage",
    "restore:after-restore",
    "restore:after-personalize",
    "snapshot:after-start",
    "snapshot:after-save",
    "hot-plug:after-vcpus",
    "hot-plug:after-dimm",
    "dra:after-record",
    "dra:after-ipam-add",
    "dra:after-ipam-del",
    "dra:before-status",
    "dra:after-status",
)

RAISE = "raise:"


class InjectedFault(InfrastructureError):
    """The failure a test injected at a fault point."""


_SETTING = os.environ.get(ENV, "")
_ARMED = _SETTING.removeprefix(RAISE)  # the point, kill or raise
_RAISES = _SETTING.startswith(RAISE)
_raising: set[str] = set()  # points set by ``raising`` in this process
_known: set[str] = set(POINTS)  # and the RPC steps' points, added by shim.rpc as it declares them
if _SETTING:
    what = "fail the RPC" if _RAISES else "kill itself (SIGKILL)"
    log.warning("%s=%s: this shim will %s at that point; test use only", ENV, _SETTING, what)


def declare(*points: str) -> None:
    """More fault points (an RPC's steps, ``shim.rpc``)."""
    _known.update(points)


def known() -> frozenset[str]:
    return frozenset(_known)


def armed() -> str:
    """The fault point this process will die (or fail) at, or ''."""
    return _ARMED


@contextlib.contextmanager
def raising(point: str) -> Iterator[None]:
    """In process, for tests: ``checkpoint(point)`` raises ``InjectedFault`` while this lasts."""
    if point not in _known:
        raise ValueError(f"{point!r} is no fault point (known: {', '.join(sorted(_known))})")
    _raising.add(point)
    try:
        yield
    finally:
        _raising.discard(point)


def checkpoint(name: str) -> None:
    """Die by SIGKILL, or raise ``InjectedFault``, here if a test asked for this point; otherwise
    do nothing."""
    if _raising and name in _raising:
        raise InjectedFault(f"fault injected at {name}")
    if _ARMED and name == _ARMED:
        if _RAISES:
            raise InjectedFault(f"fault injected at {name}")
        log.critical("fault injection: SIGKILL at %s", name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
