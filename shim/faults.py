"""Fault injection for crash-recovery tests: die by SIGKILL at a named point.

**A test-only hook, inert unless the environment variable ``VMSANDBOX_FAULT`` is set.** The
variable is read once, when this module is imported. When it names one of ``POINTS``, the
first ``checkpoint()`` with that name kills the shim on the spot (``SIGKILL``: no ``finally``,
no rollback, no flush, exactly like the OOM killer or a power cut), so a test can restart the
shim on the same state directory and check what reconciliation makes of the remains.
Production never sets the variable; then ``checkpoint()`` is a comparison with an empty string.

The points, in the order a sandbox passes them:

``run:before-claim``   RunPodSandbox sized the pod, nothing is claimed yet
``run:after-claim``    the claims are committed, the sandbox row is not written yet
``network:after-add``  the row says ``creating``; CNI ADD is done, the macvtap not made yet
``run:after-network``  the row says ``creating``; the pod network is whole, no domain yet
``run:after-define``   the row says ``creating``; the domain is defined, not started
``run:after-start``    the guest is running, the row still says ``creating``
``restore:after-define``       the row says ``creating``; the pod's domain is defined for a restore
``restore:after-stage``        the snapshot's image is copied for the pod, libvirt has not read it
``restore:after-restore``      the guest is restored and running, not yet made this pod's
``restore:after-personalize``  the restored guest is this pod's; the row still says ``creating``
``snapshot:after-start``       a snapshot's guest is booting (its claims held under the snapshot key)
``snapshot:after-save``        the snapshot's image is written, not yet moved into the store
``run:after-ready``    the row says READY; the RPC has not answered yet
``remove:after-destroy``  Stop/RemovePodSandbox destroyed the guest; the domain is still defined
                          and the claims are still held
``remove:after-release``  the domain is gone and the claims released; the row still says READY
``pull:after-blobs``      PullImage has the blobs in the store; the tree is not unpacked yet
``pull:after-tree``       the tree is unpacked and in place; the catalogue does not name the image yet
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

ENV = "VMSANDBOX_FAULT"
POINTS = (
    "run:before-claim",
    "run:after-claim",
    "network:after-add",
    "run:after-network",
    "run:after-define",
    "run:after-start",
    "restore:after-define",
    "restore:after-stage",
    "restore:after-restore",
    "restore:after-personalize",
    "snapshot:after-start",
    "snapshot:after-save",
    "run:after-ready",
    "remove:after-destroy",
    "remove:after-release",
    "pull:after-blobs",
    "pull:after-tree",
)

_ARMED = os.environ.get(ENV, "")
if _ARMED:
    if _ARMED in POINTS:
        log.warning("%s=%s: this shim will kill itself (SIGKILL) at that point; test use only", ENV, _ARMED)
    else:
        log.warning("%s=%s names no fault point (known: %s); ignored", ENV, _ARMED, ", ".join(POINTS))


def armed() -> str:
    """The fault point this process will die at, or ''."""
    return _ARMED


def checkpoint(name: str) -> None:
    """Die by SIGKILL here if ``VMSANDBOX_FAULT`` names this point; otherwise do nothing."""
    if _ARMED and name == _ARMED:
        log.critical("fault injection: SIGKILL at %s", name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
