"""VM sizing profiles: the admin's knobs, validated into a frozen value.

One profile per RuntimeClass handler. This module is pure: it turns an already-parsed mapping
(from YAML, see ``profile_loader``) into a ``Profile`` and says precisely which key is wrong.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vmsandbox.errors import InvalidArgument
from vmsandbox.quantity import parse_nonnegative_quantity
from vmsandbox.resources import HUGEPAGE_SIZES

Accel = Literal["auto", "kvm", "tcg"]
CpuPolicy = Literal["exclusive", "shared"]
# NUMA alignment of CPUs, hugepages and devices, after the kubelet Topology Manager's policies
NumaPolicy = Literal["none", "best-effort", "restricted", "single-numa-node"]
# where QEMU's emulator threads run: with the vCPUs, or on the shim's housekeeping CPUs
EmulatorPolicy = Literal["vcpus", "housekeeping"]

PAGE_4K = 4096
#: Pod annotation choosing one of the profiles the handler's profile lists in ``allowed_profiles``.
PROFILE_ANNOTATION = "io.vmsandbox/profile"
#: Pod annotation naming the init containers that are sidecars (read by ``vmsandbox.sizing``).
SIDECARS_ANNOTATION = "io.vmsandbox/sidecars"
PAGE_SIZES: Mapping[str, int] = {"4Ki": PAGE_4K, **HUGEPAGE_SIZES}
#: Bounds of what a sandbox's guest may write on the host (``shared_storage``, ``vmsandbox.shared_storage``).
SHARED_STORAGE_MIN = 8 * 1024 * 1024
SHARED_STORAGE_MAX = 8 << 40  # its image stays below ext4's largest file (16 TiB)
#: The guest kernel's memory block (x86-64, guests below 64 GiB): hot-plugged memory comes in these.
HOTPLUG_BLOCK = 128 * 1024 * 1024
#: At most this many vCPUs or memory blocks of resize headroom (one DIMM slot per block at most).
HEADROOM_VCPUS_MAX = 64
HEADROOM_BLOCKS_MAX = 64


class ProfileError(InvalidArgument):
    """A profile key is missing, of the wrong type or out of range."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        super().__init__(f"{source}: {key}: {problem}")
        self.source = source
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class Profile:
    name: str
    handler: str
    vcpu_min: int = 1
    vcpu_max: int = 16
    vcpu_extra: int = 0
    memory_overhead_bytes: int = 64 * 1024 * 1024
    memory_min_bytes: int = 128 * 1024 * 1024
    page_size_bytes: int = HUGEPAGE_SIZES["2Mi"]
    cpu_policy: CpuPolicy = "exclusive"
    machine: str = "q35"
    accel: Accel = "auto"
    default_cpu_millis: int = 1000
    default_memory_bytes: int = 256 * 1024 * 1024
    kernel_cmdline: str = ""
    image_dir: str = "/var/lib/vmsandbox/images/default"
    boot_timeout_s: float = 60.0
    # TCG's translation cache, which fills to its cap in a cold boot: QEMU's largest cost per pod
    # beyond guest RAM (docs/benchmarks.md "VMM memory"). 16 MiB: about 36 MiB beyond guest RAM
    # against 54 MiB at 32, its cold boot 6 % slower; 10 MiB would hold QEMU within 32 MiB but boot
    # a fifth slower (up to 3 s under load), which every cold-booted pod pays. A guest with vCPU
    # headroom gets it too: its vCPUs' threads all exist from QEMU's start
    tcg_tb_cache_mib: int = 16
    extended_resources: Mapping[str, str] = field(default_factory=dict)
    # other profiles (by name) a pod of this handler may choose with the io.vmsandbox/profile annotation
    allowed_profiles: tuple[str, ...] = ()
    numa_policy: NumaPolicy = "single-numa-node"
    emulator: EmulatorPolicy = "vcpus"
    # restore pods from per-shape snapshots (made on first use); false: every pod cold-boots
    snapshots: bool = True
    # what a sandbox's guest may write on the host when its pod declares no ephemeral-storage limit
    shared_storage_bytes: int = 1 << 30
    # reserved at RunPodSandbox beyond the pod's shape, plugged into the running VM by a resize
    resize_headroom_vcpus: int = 0
    resize_headroom_memory_bytes: int = 0

    @property
    def pinning(self) -> bool:
        return self.cpu_policy == "exclusive"


_KEYS = {
    "name",
    "handler",
    "vcpu",
    "memory",
    "page_size",
    "cpu_policy",
    "machine",
    "accel",
    "defaults",
    "guest",
    "extended_resources",
    "allowed_profiles",
    "numa_policy",
    "emulator",
    "snapshots",
    "shared_storage",
    "resize_headroom",
}
#: keys earlier versions read, and why they are refused now
RETIRED_KEYS: Mapping[str, str] = {
    "init_containers": (
        "no longer supported: sidecars (init containers with restartPolicy: Always) are sized by Kubernetes' "
        f"rule; name them with the pod annotation {SIDECARS_ANNOTATION} (vmsandbox plan reads restartPolicy "
        "from the manifest); remove this key"
    ),
}
_SECTION_KEYS: Mapping[str, frozenset[str]] = {
    "vcpu": frozenset({"min", "max", "extra"}),
    "memory": frozenset({"overhead", "min"}),
    "defaults": frozenset({"cpu", "memory"}),
    "guest": frozenset({"kernel_cmdline", "image_dir", "boot_timeout_s", "tcg_tb_cache_mib"}),
    "resize_headroom": frozenset({"vcpus", "memory"}),
}
# a RuntimeClass handler is a DNS-1123 label: lower-case alphanumerics and '-', at most 63 characters
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class _Invalid(Exception):
    """One key failed; the value it would have had is not used."""


def profile_from_mapping(data: Mapping[str, Any], *, source: str) -> Profile:
    """Build a Profile from a mapping (one YAML document); the first error names source and key."""
    profile, problems = profile_problems(data, source=source)
    if problems:
        raise problems[0]
    assert profile is not None
    return profile


def profile_problems(data: Mapping[str, Any], *, source: str) -> tuple[Profile | None, list[ProfileError]]:
    """The Profile of a mapping, or every problem in it (each naming source and key), in key order."""
    problems: list[ProfileError] = []

    def fail(key: str, problem: str) -> _Invalid:
        problems.append(ProfileError(source, key, problem))
        return _Invalid()

    if not isinstance(data, Mapping):
        return None, [ProfileError(source, "(document)", "a profile must be a mapping")]
    for key in sorted(str(k) for k in set(data) - _KEYS):
        if key in RETIRED_KEYS:
            fail(key, RETIRED_KEYS[key])
        else:
            fail(key, f"unknown key (known: {', '.join(sorted(_KEYS))})")

    def section(key: str) -> Mapping[str, Any]:
        value = data.get(key, {})
        if not isinstance(value, Mapping):
            fail(key, "must be a mapping")
            return {}
        known = _SECTION_KEYS[key]
        for unknown in sorted(str(k) for k in set(value) - known):
            fail(f"{key}.{unknown}", f"unknown key (known: {', '.join(sorted(known))})")
        return value

    def string(key: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise fail(key, "must be a non-empty string")
        return value

    def integer(key: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(key, f"must be an integer, got {value!r}")
        if not low <= value <= high:
            raise fail(key, f"must be between {low} and {high}, got {value}")
        return value

    def quantity(key: str, value: Any, *, milli: bool = False, positive: bool = False) -> int:
        try:
            q = parse_nonnegative_quantity(str(value))
        except InvalidArgument as exc:
            raise fail(key, str(exc)) from None
        amount = q.milli_value() if milli else q.value_int()
        if positive and amount == 0:
            raise fail(key, f"must be more than 0, got {value!r}")
        return amount

    def choice(key: str, value: Any, options: tuple[str, ...]) -> str:
        if value not in options:
            raise fail(key, f"must be one of {', '.join(options)}, got {value!r}")
        return str(value)

    values: dict[str, Any] = {}

    def read(field_name: str, compute: Callable[[], Any]) -> None:
        """Compute one field; a failure is recorded and the field left out."""
        with contextlib.suppress(_Invalid):
            values[field_name] = compute()

    vcpu = section("vcpu")
    memory = section("memory")
    defaults = section("defaults")
    guest = section("guest")
    read("name", lambda: string("name", data.get("name")))

    def handler() -> str:
        value = string("handler", data.get("handler", data.get("name")))
        if len(value) > 63 or not _DNS_LABEL.fullmatch(value):
            key = "handler" if "handler" in data else "name"
            raise fail(
                key,
                f"{value!r} is not a valid RuntimeClass handler (a DNS-1123 label: at most 63 lower-case letters, "
                "digits and '-', starting and ending with a letter or digit)",
            )
        return value

    if "name" in values or "handler" in data:
        read("handler", handler)
    read("vcpu_min", lambda: integer("vcpu.min", vcpu.get("min", 1), 1, 1024))
    read("vcpu_max", lambda: integer("vcpu.max", vcpu.get("max", 16), 1, 1024))
    if "vcpu_min" in values and "vcpu_max" in values and values["vcpu_min"] > values["vcpu_max"]:
        fail("vcpu.min", f"{values['vcpu_min']} is greater than vcpu.max {values['vcpu_max']}")
    read("vcpu_extra", lambda: integer("vcpu.extra", vcpu.get("extra", 0), 0, 64))

    def page_size() -> int:
        page_key = str(data.get("page_size", "2Mi"))
        if page_key not in PAGE_SIZES:
            raise fail("page_size", f"must be one of {', '.join(PAGE_SIZES)}, got {page_key!r}")
        return PAGE_SIZES[page_key]

    def extended() -> dict[str, str]:
        value = data.get("extended_resources", {})
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise fail("extended_resources", "must map resource names to device pool names")
        return dict(value)

    def allowed() -> tuple[str, ...]:
        value = data.get("allowed_profiles", [])
        if not isinstance(value, list) or not all(isinstance(a, str) and a for a in value):
            raise fail("allowed_profiles", f"must be a list of profile names, got {value!r}")
        if len(set(value)) != len(value):
            raise fail("allowed_profiles", f"names a profile twice: {value!r}")
        return tuple(value)

    def timeout() -> float:
        value = guest.get("boot_timeout_s", 60)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= 3600:
            raise fail("guest.boot_timeout_s", f"must be a number of seconds between 1 and 3600, got {value!r}")
        return float(value)

    def cmdline() -> str:
        value = guest.get("kernel_cmdline", "")
        if not isinstance(value, str):
            raise fail("guest.kernel_cmdline", "must be a string")
        return value

    read("memory_overhead_bytes", lambda: quantity("memory.overhead", memory.get("overhead", "64Mi")))
    read("memory_min_bytes", lambda: quantity("memory.min", memory.get("min", "128Mi"), positive=True))
    read("page_size_bytes", page_size)
    read("cpu_policy", lambda: choice("cpu_policy", data.get("cpu_policy", "exclusive"), ("exclusive", "shared")))
    read("machine", lambda: choice("machine", data.get("machine", "q35"), ("q35", "pc")))
    read("accel", lambda: choice("accel", data.get("accel", "auto"), ("auto", "kvm", "tcg")))
    read("default_cpu_millis", lambda: quantity("defaults.cpu", defaults.get("cpu", "1"), milli=True))
    read("default_memory_bytes", lambda: quantity("defaults.memory", defaults.get("memory", "256Mi")))
    read("kernel_cmdline", cmdline)
    read(
        "image_dir",
        lambda: string("guest.image_dir", guest.get("image_dir", "/var/lib/vmsandbox/images/default")),
    )
    read("boot_timeout_s", timeout)
    read(
        "tcg_tb_cache_mib",
        lambda: integer("guest.tcg_tb_cache_mib", guest.get("tcg_tb_cache_mib", Profile.tcg_tb_cache_mib), 8, 4096),
    )
    read("extended_resources", extended)
    read("allowed_profiles", allowed)
    read(
        "numa_policy",
        lambda: choice(
            "numa_policy",
            data.get("numa_policy", "single-numa-node"),
            ("none", "best-effort", "restricted", "single-numa-node"),
        ),
    )
    read("emulator", lambda: choice("emulator", data.get("emulator", "vcpus"), ("vcpus", "housekeeping")))

    def snapshots() -> bool:
        value = data.get("snapshots", True)
        if not isinstance(value, bool):
            raise fail("snapshots", f"must be true or false, got {value!r}")
        return value

    read("snapshots", snapshots)

    def shared_storage() -> int:
        amount = quantity("shared_storage", data.get("shared_storage", "1Gi"))
        if not SHARED_STORAGE_MIN <= amount <= SHARED_STORAGE_MAX:
            raise fail("shared_storage", f"must be between 8Mi and 8Ti, got {amount} bytes")
        return amount

    read("shared_storage_bytes", shared_storage)
    headroom = section("resize_headroom")
    read(
        "resize_headroom_vcpus",
        lambda: integer("resize_headroom.vcpus", headroom.get("vcpus", 0), 0, HEADROOM_VCPUS_MAX),
    )

    def headroom_memory() -> int:
        amount = quantity("resize_headroom.memory", headroom.get("memory", "0"))
        block = HOTPLUG_BLOCK * max(1, values.get("page_size_bytes", HOTPLUG_BLOCK) // HOTPLUG_BLOCK)
        if amount % block or amount > HEADROOM_BLOCKS_MAX * block:
            raise fail(
                "resize_headroom.memory",
                f"must be a multiple of {block >> 20}Mi (the guest's hot-plug block, or the page size if larger) "
                f"of at most {HEADROOM_BLOCKS_MAX} blocks, got {amount} bytes",
            )
        return amount

    read("resize_headroom_memory_bytes", headroom_memory)
    if problems:
        return None, problems
    return Profile(**values), []


def select_profile(
    by_handler: Mapping[str, Profile],
    by_name: Mapping[str, Profile],
    handler: str,
    annotations: Mapping[str, str],
) -> Profile:
    """The profile of a RuntimeClass handler, or the one its pod chose with ``PROFILE_ANNOTATION``.

    An unknown handler is refused with containerd's words; a chosen profile must be the handler's own
    or one it lists in ``allowed_profiles``, and must exist.
    """
    profile = by_handler.get(handler)
    if profile is None:
        raise InvalidArgument(
            f'failed to get sandbox runtime: no runtime for "{handler}" is configured '
            f"(configured handlers: {', '.join(sorted(by_handler))})"
        )
    chosen = annotations.get(PROFILE_ANNOTATION)
    if chosen is None or chosen == profile.name:
        return profile
    allowed = ", ".join(f'"{a}"' for a in (profile.name, *profile.allowed_profiles))
    if chosen not in profile.allowed_profiles:
        raise InvalidArgument(
            f'annotation {PROFILE_ANNOTATION}: profile "{chosen}" is not allowed for runtime handler '
            f'"{handler}" (allowed: {allowed})'
        )
    target = by_name.get(chosen)
    if target is None:
        raise InvalidArgument(
            f'annotation {PROFILE_ANNOTATION}: profile "{chosen}" is allowed for runtime handler "{handler}" '
            f"but is not defined (defined profiles: {', '.join(sorted(by_name))})"
        )
    return target
