"""The host's resources and who holds them: the one owner of the pools, the free state and the claims.

``ResourceManager`` turns the shim's configuration and the host inventory into the pools it may
hand out (``shim.host_policy.HostPolicy``), keeps what is free in memory (``FreeState``, updated in
place) and records every claim in the ledger before handing it out. The in-memory state is the
authority while the shim runs; the ledger is its write-ahead record, from which ``open`` (and
``resync``, at reconciliation) rebuilds it. The request path never reads the ledger or sysfs to
place a pod: ``reserve`` decides under one lock, commits the claim in one small transaction (the
ledger refuses anything already held, even by another process) and updates the free state.

Hugepage budgets subtract, once at open, the pages the kernel shows in use beyond the shim's own
claims (another hugepage user on the host); pages taken by someone else later make the guest's
start fail and roll back, rather than being found by a sysfs read per decision.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shim.config import ShimConfig
from shim.host_policy import HostPolicy
from vmsandbox.adapters.ledger import ClaimConflict, Ledger
from vmsandbox.claims import Claim
from vmsandbox.devices import NO_DEVICES, DeviceRequest
from vmsandbox.errors import CannotFit
from vmsandbox.host import HostInventory
from vmsandbox.host_pools import FreeState, HostPools
from vmsandbox.placement import DEFAULT_PACKING, Packing, Placement, decide
from vmsandbox.profile import Profile
from vmsandbox.resources import hugepage_resource
from vmsandbox.sizing import VmShape

log = logging.getLogger(__name__)

ATTEMPTS = 3  # a claim refused by the ledger (another process claimed meanwhile): resync and try again


@dataclass(frozen=True)
class PoolUsage:
    """One pool on one NUMA node: how much there is to hand out and how much is held."""

    node: int
    resource: str  # "cpu" (exclusive CPUs), "hugepages-2Mi", "memory" (bytes)
    capacity: int
    held: int

    @property
    def free(self) -> int:
        return self.capacity - self.held


class ResourceManager:
    def __init__(
        self,
        policy: HostPolicy,
        pools: HostPools,
        held: Mapping[str, Claim],
        ledger: Ledger | None = None,
        *,
        packing: Packing = DEFAULT_PACKING,
    ) -> None:
        self.policy = policy
        self.pools = pools
        self.packing = packing
        self._ledger = ledger
        self._lock = threading.Lock()
        self._held: dict[str, Claim] = {sid: c for sid, c in held.items() if not c.empty}
        self._page_limits = {k: b.pages for k, b in pools.budgets.items()}
        self._state = FreeState.from_claims(pools, self._held.values())

    @classmethod
    def open(
        cls,
        config: ShimConfig,
        inventory: HostInventory,
        ledger: Ledger | None = None,
        *,
        held: Mapping[str, Claim] | None = None,
        label: str = "this host",
        packing: Packing | None = None,
    ) -> ResourceManager:
        """The manager of ``inventory`` under ``config``, its free state rebuilt from ``ledger``'s claims
        (or, read-only, from ``held``: ``vmsandbox plan --state-dir``; nothing can be reserved then)."""
        policy = HostPolicy(config, inventory, label=label)
        claims = ledger.held() if ledger is not None else dict(held or {})
        pools = policy.pools(inventory, claims.values())
        return cls(policy, pools, claims, ledger, packing=packing or config.packing)

    # -- decisions ----------------------------------------------------------------------------------
    def place(self, shape: VmShape, profile: Profile, devices: DeviceRequest = NO_DEVICES) -> Placement:
        """Where the VM would go now (``CannotFit`` naming the shortfalls); nothing is claimed."""
        with self._lock:
            return self._decide(shape, profile, devices)

    def _decide(self, shape: VmShape, profile: Profile, devices: DeviceRequest) -> Placement:
        return decide(
            shape,
            self.pools,
            self._state,
            policy=profile.numa_policy,
            emulator=profile.emulator,
            devices=devices,
            packing=self.packing,
        )

    def reserve(
        self, sandbox_id: str, shape: VmShape, profile: Profile, devices: DeviceRequest = NO_DEVICES
    ) -> Placement:
        """Place the VM and hold what it needs for ``sandbox_id``, atomically: the ledger records the
        claim (one transaction) before the free state changes. ``CannotFit`` when it does not fit."""
        if self._ledger is None:
            raise RuntimeError("this ResourceManager is read-only (opened without a ledger)")
        with self._lock:
            for attempt in range(ATTEMPTS):
                placement = self._decide(shape, profile, devices)
                claim = placement.claim
                try:
                    self._ledger.claim(
                        sandbox_id,
                        claim,
                        page_limits=self._page_limits,
                        memory_limits=self.pools.memory_capacity,
                    )
                except ClaimConflict as exc:
                    log.warning(
                        "claim conflict for %s (attempt %d): %s; re-reading the ledger", sandbox_id, attempt, exc
                    )
                    self._resync_locked()
                    continue
                self._state.take_claim(claim)
                self._held[sandbox_id] = self._held[sandbox_id] + claim if sandbox_id in self._held else claim
                return placement
        raise CannotFit(f"host resources are changing under us; no consistent placement after {ATTEMPTS} attempts")

    def release(self, sandbox_id: str) -> int:
        """Free everything ``sandbox_id`` holds (ledger first, then the free state); the number of
        ledger rows released (0 when it held nothing)."""
        if self._ledger is None:
            raise RuntimeError("this ResourceManager is read-only (opened without a ledger)")
        with self._lock:
            released = self._ledger.release(sandbox_id)
            claim = self._held.pop(sandbox_id, None)
            if claim is not None:
                self._state.release_claim(claim)
            return released

    def resync(self) -> None:
        """Rebuild the free state from the ledger (start-up reconciliation; after a claim conflict)."""
        with self._lock:
            self._resync_locked()

    def _resync_locked(self) -> None:
        if self._ledger is None:
            return
        self._held = {sid: c for sid, c in self._ledger.held().items() if not c.empty}
        self._state = FreeState.from_claims(self.pools, self._held.values())

    # -- what is held -------------------------------------------------------------------------------
    def held(self, sandbox_id: str) -> Claim:
        with self._lock:
            return self._held.get(sandbox_id, Claim())

    def pci_holder(self, addresses: Sequence[str]) -> str | None:
        """The sandbox holding one of these PCI functions, or None (the DRA driver's check at prepare)."""
        wanted = set(addresses)
        with self._lock:
            for sandbox_id, claim in sorted(self._held.items()):
                if wanted & set(claim.pci):
                    return sandbox_id
        return None

    def owners(self) -> frozenset[str]:
        """The sandboxes holding anything."""
        with self._lock:
            return frozenset(self._held)

    def holds(self, sandbox_id: str, expected: Claim) -> str | None:
        """Why what ``sandbox_id`` holds does not match ``expected`` (its record), or None when it holds
        every CPU and PCI function of it and exactly its hugepages and memory (reconciliation)."""
        got = self.held(sandbox_id)
        cpus = set(expected.cpus)
        same_memory = not expected.memory or got.memory == expected.memory
        if cpus <= set(got.cpus) and set(expected.pci) <= set(got.pci) and got.pages == expected.pages and same_memory:
            return None
        return (
            f"its claims do not match its record (CPUs {sorted(cpus)}, {expected.page_count} pages; "
            f"held: {len(cpus & set(got.cpus))} of those CPUs, {got.page_count} pages)"
        )

    def snapshot(self) -> tuple[object, ...]:
        """A comparable picture of the free state (tests and the benchmark: in place == rebuilt)."""
        with self._lock:
            return self._state.snapshot()

    def usage(self) -> list[PoolUsage]:
        """Every pool per node: exclusive CPUs, hugepages per size, ordinary memory; capacity and held."""
        with self._lock:
            state, pools = self._state, self.pools
            out = [
                PoolUsage(n, "cpu", pools.cpu_capacity.get(n, 0), pools.cpu_capacity.get(n, 0) - state.ncpu[n])
                for n in pools.nodes
            ]
            for (node, size), budget in sorted(pools.budgets.items()):
                free = state.npages.get((node, size), 0)
                out.append(PoolUsage(node, hugepage_resource(size), budget.pages, budget.pages - free))
            for node, capacity in sorted(pools.memory_capacity.items()):
                out.append(PoolUsage(node, "memory", capacity, capacity - state.memory.get(node, 0)))
            return out
