"""A pod's envelope grown into its resize headroom: the headroom the growth needs plugged into the
guest (``shim.hot_plug``), then the growth recorded with the pod. Both resize RPCs
(UpdatePodSandboxResources, UpdateContainerResources) grow through ``grow`` as their ``grow``
step; ``put_growth`` is its undo (what was plugged stays plugged: nothing was claimed for it).
"""

from __future__ import annotations

from dataclasses import replace

from shim.hot_plug import HotPlug
from shim.model import SandboxRecord
from shim.sandboxes import Sandboxes
from vmsandbox.errors import NotFound
from vmsandbox.resize import Growth, needed


def grow(sb: Sandboxes, hot_plug: HotPlug, record: SandboxRecord, growth: Growth) -> SandboxRecord:
    """The pod's record with ``growth`` recorded, once the guest holds what it needs."""
    if growth == record.growth:
        return record
    hot_plug.grow(record, needed(record.sized_shape(), growth))
    return put_growth(sb, record.id, growth)


def put_growth(sb: Sandboxes, sandbox_id: str, growth: Growth) -> SandboxRecord:
    """Record the pod's growth (the rest of its record as it is now)."""
    with sb.locks.lock_for(sandbox_id):
        current = sb.records.find(sandbox_id)
        if current is None:
            raise NotFound(f"pod sandbox {sandbox_id[:12]} was removed")
        updated = replace(current, growth=growth)
        sb.records.put_sandbox(updated)
        return updated
