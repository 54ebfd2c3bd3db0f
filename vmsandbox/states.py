"""The names of sandbox and container states, as records keep them (one module: every other
module imports them from here).

A sandbox is ``SANDBOX_CREATING`` from the moment RunPodSandbox claims its resources until its
guest answered (a record a crash leaves so is torn down by the reconcile), then ``SANDBOX_READY``
until its guest stops or is lost, then ``SANDBOX_NOTREADY``. The CRI names (``SANDBOX_READY``,
``CONTAINER_RUNNING``, ...) are the CRI enum's own names; ``translate`` maps them to its numbers.
"""

from __future__ import annotations

SANDBOX_CREATING = "creating"
SANDBOX_READY = "SANDBOX_READY"
SANDBOX_NOTREADY = "SANDBOX_NOTREADY"
SANDBOX_STATES = (SANDBOX_CREATING, SANDBOX_READY, SANDBOX_NOTREADY)

CONTAINER_CREATED = "CONTAINER_CREATED"
CONTAINER_RUNNING = "CONTAINER_RUNNING"
CONTAINER_EXITED = "CONTAINER_EXITED"
CONTAINER_UNKNOWN = "CONTAINER_UNKNOWN"
CONTAINER_STATES = (CONTAINER_CREATED, CONTAINER_RUNNING, CONTAINER_EXITED, CONTAINER_UNKNOWN)
