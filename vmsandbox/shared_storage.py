"""How much host storage a sandbox's guest may write, and how its use is told to the kubelet (pure).

Everything a guest can write on the host lives in the sandbox's directory, which is a file system
of its own (an ext4 image, ``vmsandbox.adapters.share_image``): the guest's writes stop there with
``ENOSPC`` and never reach the host's disk beyond it. Its capacity is the pod's
``ephemeral-storage`` limit when the pod declares one (``pod_resources``, Kubernetes' rule for a
pod's limit: the containers' limits added up, init containers by KEP-753, containers without a
limit adding nothing, as the kubelet's eviction computes it), else the profile's
``shared_storage``; never below ``MIN_CAPACITY`` (the host writes a few files there for each
container). The image is made a little larger than the capacity so that what the guest can write
is at least the capacity: ext4 keeps inode tables and a reserve for delayed allocation out of
what it reports free.

The kubelet sees the file system's use as part of the containers' writable layers (the CRI has no
pod-level file system): ``split`` divides it among the pod's running containers in proportion to
their ``ephemeral-storage`` limits (evenly when none has one), so the pod's sum is exact and no
container is pushed past its own limit before the pod is past its total.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vmsandbox.profile import SHARED_STORAGE_MAX, SHARED_STORAGE_MIN
from vmsandbox.resources import EPHEMERAL_STORAGE, ContainerResources, PodDeclaration
from vmsandbox.sizing import effective_amount

MIB = 1024 * 1024
MIN_CAPACITY = SHARED_STORAGE_MIN
"""The least a sandbox's file system holds, whatever the pod declares."""
MAX_CAPACITY = SHARED_STORAGE_MAX
"""The most (8 TiB), whatever the pod declares: the image stays a file the host's ext4 can hold."""
BLOCK = 4096
BYTES_PER_INODE = 16384
"""mkfs's ``-i``: one inode per 16 KiB of the image (65,536 per GiB), so the guest runs out of
inodes (``ENOSPC`` too) only with files of 16 KiB on average."""
INODE_SIZE = 256
_GROUP_BYTES = 8 * BLOCK * BLOCK
"""An ext4 block group: as many blocks as one bitmap block has bits (128 MiB)."""
_RESERVE_MAX = 4096 * BLOCK
"""ext4 keeps min(2 %, 4096 blocks) free for delayed allocation (``s_resv_clusters``)."""


def _limit(resources: ContainerResources) -> int:
    q = resources.limits.get(EPHEMERAL_STORAGE)
    return q.value_int() if q is not None else 0


def declared_limit(decl: PodDeclaration | None, sidecars: frozenset[str] = frozenset()) -> int | None:
    """The pod's ``ephemeral-storage`` limit in bytes, or None when no container declares one.

    Kubernetes' pod limit: the app containers' and sidecars' limits added up, or an init
    container's with the sidecars before it when larger (``effective_amount``); a container
    without a limit adds nothing (as the kubelet's ``PodLimits``)."""
    if decl is None or not any(c.resources.limits.get(EPHEMERAL_STORAGE) for c in decl.all_containers()):
        return None
    return effective_amount(
        ((_limit(c.resources), c.name in sidecars) for c in decl.init_containers),
        (_limit(c.resources) for c in decl.containers),
    )


def capacity(decl: PodDeclaration | None, sidecars: frozenset[str], default: int) -> int:
    """What the sandbox's guest may write on the host, in bytes: the pod's declared limit, else
    ``default`` (the profile's ``shared_storage``), within [MIN_CAPACITY, MAX_CAPACITY]."""
    declared = declared_limit(decl, sidecars)
    wanted = declared if declared is not None else default
    return min(max(wanted, MIN_CAPACITY), MAX_CAPACITY)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _copies(groups: int) -> int:
    """How many block groups hold a superblock and the group descriptors (``sparse_super``: group
    0 and 1 and the powers of 3, 5 and 7)."""
    count = min(groups, 2)
    for base in (3, 5, 7):
        power = base
        while power < groups:
            count += 1
            power *= base
    return count


def image_bytes(capacity_bytes: int) -> int:
    """The size of the sparse image file whose ext4 (made as ``share_image.make`` does) leaves at
    least ``capacity_bytes`` free to an unprivileged writer: the capacity, 1 MiB for the root and
    slack, and what ext4 keeps out of its free count, which grows with the whole image: inode
    tables (256 bytes per 16 KiB), block and inode bitmaps (two blocks per 128 MiB group), the
    copies of the superblock and group descriptors, and the delayed-allocation reserve (2 %, at
    most 16 MiB). The image's own share
    of those is found by iterating to the fixed point (each round adds ~4 % of the last)."""
    size = capacity_bytes + MIB
    for _ in range(8):
        grown = (
            capacity_bytes
            + MIB
            + size * INODE_SIZE // BYTES_PER_INODE
            + size // _GROUP_BYTES * 2 * BLOCK
            + _copies(size // _GROUP_BYTES + 1) * (_round_up((size // _GROUP_BYTES + 1) * 64, BLOCK) + BLOCK)
            + min(size // 50 + BLOCK, _RESERVE_MAX)
        )
        if grown <= size:
            break
        size = grown
    return _round_up(size, MIB)


def split(total: int, weights: Sequence[int]) -> tuple[int, ...]:
    """``total`` divided among ``len(weights)`` parts in proportion to ``weights`` (equally when
    they are all 0); the parts add up to ``total`` exactly (the remainder goes to the first ones)."""
    if not weights:
        return ()
    shares = list(weights) if any(w > 0 for w in weights) else [1] * len(weights)
    shares = [max(w, 0) for w in shares]
    whole = sum(shares)
    parts = [total * w // whole for w in shares]
    left = total - sum(parts)
    for i in (i for i, w in enumerate(shares) if w > 0):
        if left <= 0:
            break
        parts[i] += 1
        left -= 1
    return tuple(parts)


def container_weights(resources: Iterable[ContainerResources]) -> list[int]:
    """Each container's ``ephemeral-storage`` limit (0 without one): the weights of ``split``."""
    return [_limit(r) for r in resources]
