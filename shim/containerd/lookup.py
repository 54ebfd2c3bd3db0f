"""Which pods a runtime handler's containerd services answer for, and the pid they give of each:
one rule for the Sandbox and Task services (and the front's log sinks)."""

from __future__ import annotations

from shim.model import SandboxRecord
from shim.pods import Pods
from vmsandbox import validation


def handler_sandbox(pods: Pods, runtime_handler: str, sandbox_id: str) -> SandboxRecord | None:
    """The sandbox ``sandbox_id`` names exactly (no prefix: containerd's ids are whole), when it is
    one of ``runtime_handler``'s; None otherwise, for an id that is not 64 hex digits too."""
    if not validation.is_full_id(sandbox_id):
        return None
    record = pods.records.find(sandbox_id)
    if record is None or record.id != sandbox_id or record.runtime_handler != runtime_handler:
        return None
    return record


def qemu_pid(pods: Pods, record: SandboxRecord) -> int:
    """The pid containerd is given for a pod and its containers: its QEMU's (0 when not running)."""
    return pods.sandboxes.hypervisor.emulator_pid(record.domain) or 0
