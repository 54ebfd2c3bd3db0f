"""VM sizing profiles: the admin's knobs, validated into a frozen value.

One profile per RuntimeClass handler. This module is pure: it turns an already-parsed mapping
(from YAML, see ``profile_loader``) into a ``Profile`` and says precisely which key is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vmsandbox.errors import InvalidArgument
from vmsandbox.quantity import parse_nonnegative_quantity
from vmsandbox.resources import HUGEPAGE_SIZES

Accel = Literal["auto", "kvm", "tcg"]
InitPolicy = Literal["sequential", "concurrent"]
CpuPolicy = Literal["exclusive", "shared"]
# NUMA alignment of CPUs, hugepages and devices, after the kubelet Topology Manager's policies
NumaPolicy = Literal["none", "best-effort", "restricted", "single-numa-node"]
# where QEMU's emulator threads run: with the vCPUs, or on the shim's housekeeping CPUs
EmulatorPolicy = Literal["vcpus", "housekeeping"]

PAGE_4K = 4096
#: Pod annotation choosing one of the profiles the handler's profile lists in ``allowed_profiles``.
PROFILE_ANNOTATION = "io.vmsandbox/profile"
PAGE_SIZES: Mapping[str, int] = {"4Ki": PAGE_4K, **HUGEPAGE_SIZES}


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
    init_containers: InitPolicy = "sequential"
    default_cpu_millis: int = 1000
    default_memory_bytes: int = 256 * 1024 * 1024
    kernel_cmdline: str = ""
    image_dir: str = "/var/lib/vmsandbox/images/default"
    boot_timeout_s: float = 60.0
    tcg_tb_cache_mib: int = 32
    extended_resources: Mapping[str, str] = field(default_factory=dict)
    # other profiles (by name) a pod of this handler may choose with the io.vmsandbox/profile annotation
    allowed_profiles: tuple[str, ...] = ()
    numa_policy: NumaPolicy = "single-numa-node"
    emulator: EmulatorPolicy = "vcpus"

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
    "init_containers",
    "defaults",
    "guest",
    "extended_resources",
    "allowed_profiles",
    "numa_policy",
    "emulator",
}
_SECTION_KEYS: Mapping[str, frozenset[str]] = {
    "vcpu": frozenset({"min", "max", "extra"}),
    "memory": frozenset({"overhead", "min"}),
    "defaults": frozenset({"cpu", "memory"}),
    "guest": frozenset({"kernel_cmdline", "image_dir", "boot_timeout_s", "tcg_tb_cache_mib"}),
}


def profile_from_mapping(data: Mapping[str, Any], *, source: str) -> Profile:
    """Build a Profile from a mapping (one YAML document); every error names source and key."""

    def fail(key: str, problem: str) -> ProfileError:
        return ProfileError(source, key, problem)

    if not isinstance(data, Mapping):
        raise fail("(document)", "a profile must be a mapping")
    unknown = sorted(str(k) for k in set(data) - _KEYS)
    if unknown:
        raise fail(unknown[0], f"unknown key (known: {', '.join(sorted(_KEYS))})")

    def section(key: str) -> Mapping[str, Any]:
        value = data.get(key, {})
        if not isinstance(value, Mapping):
            raise fail(key, "must be a mapping")
        known = _SECTION_KEYS[key]
        unknown = sorted(str(k) for k in set(value) - known)
        if unknown:
            raise fail(f"{key}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(known))})")
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

    def quantity(key: str, value: Any, *, milli: bool = False) -> int:
        try:
            q = parse_nonnegative_quantity(str(value))
        except InvalidArgument as exc:
            raise fail(key, str(exc)) from None
        return q.milli_value() if milli else q.value_int()

    def choice(key: str, value: Any, options: tuple[str, ...]) -> str:
        if value not in options:
            raise fail(key, f"must be one of {', '.join(options)}, got {value!r}")
        return str(value)

    name = string("name", data.get("name"))
    handler = string("handler", data.get("handler", name))
    vcpu = section("vcpu")
    memory = section("memory")
    defaults = section("defaults")
    guest = section("guest")
    vcpu_min = integer("vcpu.min", vcpu.get("min", 1), 1, 1024)
    vcpu_max = integer("vcpu.max", vcpu.get("max", 16), 1, 1024)
    if vcpu_min > vcpu_max:
        raise fail("vcpu.min", f"{vcpu_min} is greater than vcpu.max {vcpu_max}")
    page_key = str(data.get("page_size", "2Mi"))
    if page_key not in PAGE_SIZES:
        raise fail("page_size", f"must be one of {', '.join(PAGE_SIZES)}, got {page_key!r}")
    extended = data.get("extended_resources", {})
    if not isinstance(extended, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in extended.items()
    ):
        raise fail("extended_resources", "must map resource names to device pool names")
    allowed = data.get("allowed_profiles", [])
    if not isinstance(allowed, list) or not all(isinstance(a, str) and a for a in allowed):
        raise fail("allowed_profiles", f"must be a list of profile names, got {allowed!r}")
    if len(set(allowed)) != len(allowed):
        raise fail("allowed_profiles", f"names a profile twice: {allowed!r}")
    timeout = guest.get("boot_timeout_s", 60)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 1 <= timeout <= 3600:
        raise fail("guest.boot_timeout_s", f"must be a number of seconds between 1 and 3600, got {timeout!r}")
    cmdline = guest.get("kernel_cmdline", "")
    if not isinstance(cmdline, str):
        raise fail("guest.kernel_cmdline", "must be a string")
    return Profile(
        name=name,
        handler=handler,
        vcpu_min=vcpu_min,
        vcpu_max=vcpu_max,
        vcpu_extra=integer("vcpu.extra", vcpu.get("extra", 0), 0, 64),
        memory_overhead_bytes=quantity("memory.overhead", memory.get("overhead", "64Mi")),
        memory_min_bytes=quantity("memory.min", memory.get("min", "128Mi")),
        page_size_bytes=PAGE_SIZES[page_key],
        cpu_policy=choice("cpu_policy", data.get("cpu_policy", "exclusive"), ("exclusive", "shared")),  # type: ignore[arg-type]
        machine=choice("machine", data.get("machine", "q35"), ("q35", "pc")),
        accel=choice("accel", data.get("accel", "auto"), ("auto", "kvm", "tcg")),  # type: ignore[arg-type]
        init_containers=choice(  # type: ignore[arg-type]
            "init_containers", data.get("init_containers", "sequential"), ("sequential", "concurrent")
        ),
        default_cpu_millis=quantity("defaults.cpu", defaults.get("cpu", "1"), milli=True),
        default_memory_bytes=quantity("defaults.memory", defaults.get("memory", "256Mi")),
        kernel_cmdline=cmdline,
        image_dir=string("guest.image_dir", guest.get("image_dir", "/var/lib/vmsandbox/images/default")),
        boot_timeout_s=float(timeout),
        tcg_tb_cache_mib=integer("guest.tcg_tb_cache_mib", guest.get("tcg_tb_cache_mib", 32), 8, 4096),
        extended_resources=dict(extended),
        allowed_profiles=tuple(allowed),
        numa_policy=choice(  # type: ignore[arg-type]
            "numa_policy",
            data.get("numa_policy", "single-numa-node"),
            ("none", "best-effort", "restricted", "single-numa-node"),
        ),
        emulator=choice("emulator", data.get("emulator", "vcpus"), ("vcpus", "housekeeping")),  # type: ignore[arg-type]
    )


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
