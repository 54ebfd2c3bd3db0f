"""``vmsandbox profile validate`` and ``profile runtimeclass``: check profile files, derive RuntimeClasses.

Validation is the schema of ``vmsandbox.profile`` (every key, type and range; ``min <= max``;
handlers that are DNS-1123 labels), every problem of every profile, plus what only the shim's
configuration and a host can tell: the config's ``cpu_pool`` is online, a shared profile has
``shared_cpus`` to float over, an exclusive profile has CPUs left that are neither shared nor
housekeeping, the vCPU bounds fit those exclusive CPUs (on one NUMA node under
``numa_policy: single-numa-node``), the page size is reserved, ``accel: kvm`` has hardware
virtualisation, extended resources name device pools that resolve, the guest image exists, and
each sandbox's unprivileged QEMU can pass every directory above the state directory and the guest
image (``reach_problems``: the shim refuses to start otherwise). Each problem is
``file:line: key: problem``, in the profile file or, for the pools and the state directory, the
config file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from cli import textout
from vmsandbox.adapters.profile_loader import _key_lines
from vmsandbox.devices import DevicePools
from vmsandbox.host import HostInventory, format_cpulist
from vmsandbox.passable import Reach, reach_problems
from vmsandbox.profile import PAGE_4K, Profile, profile_problems

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    key: str
    problem: str
    severity: Severity = "error"

    def __str__(self) -> str:
        prefix = "warning: " if self.severity == "warning" else ""
        return f"{self.file}:{self.line}: {self.key}: {prefix}{self.problem}"


@dataclass(frozen=True)
class Checked:
    """One profile that passed the schema, with where its keys are."""

    profile: Profile
    file: str
    lines: Mapping[str, int]
    start: int

    def line(self, key: str) -> int:
        return self.lines.get(key, self.start)


@dataclass(frozen=True)
class CpuPools:
    """The shim configuration's CPU pools, and where in its file each key is (``file`` empty: the
    built-in defaults, no file)."""

    owned: frozenset[int] | None = None  # None: every online CPU
    shared: frozenset[int] = frozenset()
    housekeeping: frozenset[int] = frozenset()
    file: str = ""
    lines: Mapping[str, int] = field(default_factory=dict)

    def where(self, key: str) -> tuple[str, int]:
        return (self.file or "(config)", self.lines.get(key, 1 if self.file else 0))

    def described(self) -> str:
        return f"the shim's configuration {self.file}" if self.file else "the shim's built-in configuration"


def config_key_lines(path: str) -> dict[str, int]:
    """Line of each top-level key of a YAML config file (nothing when it cannot be read)."""
    try:
        node = yaml.compose(Path(path).read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return {}
    return _key_lines(node) if node is not None else {}


def parse_files(paths: Iterable[str]) -> tuple[list[Checked], list[Problem]]:
    """Every profile of every file, and every schema problem of each document."""
    checked: list[Checked] = []
    problems: list[Problem] = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            problems.append(Problem(path, 0, "(file)", f"cannot read: {exc.strerror}"))
            continue
        try:
            nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = mark.line + 1 if mark is not None else 0
            problems.append(Problem(path, line, "(syntax)", str(getattr(exc, "problem", exc))))
            continue
        found = 0
        for node, doc in zip(nodes, docs, strict=True):
            if doc is None:
                continue
            found += 1
            lines = _key_lines(node)
            start = node.start_mark.line + 1
            profile, errors = profile_problems(doc, source=path)
            problems += [Problem(path, lines.get(e.key, start), e.key, e.problem) for e in errors]
            if profile is not None:
                checked.append(Checked(profile, path, lines, start))
        if not found:
            problems.append(Problem(path, 1, "(file)", "holds no profile"))
    return checked, problems


def host_problems(
    checked: list[Checked],
    inventory: HostInventory | None,
    cpus: CpuPools | None = None,
    *,
    check_images: bool,
    device_pools: DevicePools | None = None,
) -> list[Problem]:
    """Semantic checks across files and against the host (``inventory`` None: host checks skipped;
    ``cpus``: the config's CPU pools, None for the defaults; ``device_pools``: the shim's pools
    resolved on that host, None to skip pool checks)."""
    cpus = cpus if cpus is not None else CpuPools()
    problems: list[Problem] = []
    if inventory is not None:
        problems += _cpu_pool_problems(checked, inventory, cpus)
    handlers: dict[str, Checked] = {}
    names: dict[str, Checked] = {}
    defined = {c.profile.name for c in checked}
    for c in checked:
        p = c.profile
        for other in p.allowed_profiles:
            if other not in defined:
                problems.append(
                    Problem(
                        c.file,
                        c.line("allowed_profiles"),
                        "allowed_profiles",
                        f"profile {other!r} is not defined in these files (defined: {', '.join(sorted(defined))})",
                    )
                )
        if p.handler in handlers:
            first = handlers[p.handler]
            problems.append(
                Problem(
                    c.file,
                    c.line("handler") if "handler" in c.lines else c.line("name"),
                    "handler",
                    f"{p.handler!r} is already served by profile {first.profile.name!r} ({first.file}:{first.start})",
                )
            )
        handlers.setdefault(p.handler, c)
        if p.name in names and names[p.name] is not c:
            problems.append(Problem(c.file, c.line("name"), "name", f"profile {p.name!r} is defined twice"))
        names.setdefault(p.name, c)
        pools = device_pools.pools if device_pools is not None else {}
        for resource, pool in sorted(p.extended_resources.items()) if device_pools is not None else ():
            key = f"extended_resources.{resource}"
            if pool not in pools:
                configured = ", ".join(sorted(pools)) or "none"
                problems.append(
                    Problem(
                        c.file,
                        c.line(key),
                        key,
                        f"device pool {pool!r} is not in the shim's device_pools (configured: {configured}), "
                        f"so pods asking for {resource} are refused",
                    )
                )
            elif not pools[pool]:
                problems.append(
                    Problem(
                        c.file,
                        c.line(key),
                        key,
                        f"device pool {pool!r} holds no whole IOMMU group on this host, so pods asking for "
                        f"{resource} will be refused",
                        "warning",
                    )
                )
        if check_images:
            image = Path(p.image_dir)
            missing = [f for f in ("vmlinux", "initramfs.img") if not (image / f).is_file()]
            if missing:
                problems.append(
                    Problem(
                        c.file,
                        c.line("guest.image_dir") if "guest.image_dir" in c.lines else c.start,
                        "guest.image_dir",
                        f"{image} has no {' or '.join(missing)} (build it with scripts/setup-host.sh)",
                        "warning",
                    )
                )
        if inventory is not None:
            problems.extend(_against_host(c, inventory, cpus))
    return problems


def reach_problem_list(reaches: list[Reach], checked: list[Checked], cpus: CpuPools) -> list[Problem]:
    """What the shim's start-up check would refuse (``vmsandbox.passable``), at the config file's
    ``state_dir`` or, for a guest image only, the first profile naming it."""
    out = []
    for reach in reaches:
        for problem in reach_problems([reach]):
            if reach.key == "state_dir":
                out.append(Problem(*cpus.where("state_dir"), "state_dir", problem))
                continue
            c = next((c for c in checked if c.profile.image_dir.rstrip("/") == reach.path), None)
            if c is not None:
                out.append(Problem(c.file, c.line("guest.image_dir"), "guest.image_dir", problem))
    return out


def _online_owned(inv: HostInventory, cpus: CpuPools) -> frozenset[int]:
    online = frozenset(cpu.id for cpu in inv.cpus)
    return online if cpus.owned is None else cpus.owned & online


def _cpu_pool_problems(checked: list[Checked], inv: HostInventory, cpus: CpuPools) -> list[Problem]:
    """What is wrong with the config's CPU pools on this host: once, against the config file."""
    out: list[Problem] = []
    if cpus.owned is not None:
        offline = cpus.owned - {cpu.id for cpu in inv.cpus}
        if offline:
            out.append(
                Problem(
                    *cpus.where("cpu_pool"),
                    "cpu_pool",
                    f"names CPUs that are not online on this host: {format_cpulist(offline)} (the shim refuses to "
                    "start; they are left out of the checks below)",
                )
            )
    owned = _online_owned(inv, cpus)
    exclusive_profiles = [c.profile.name for c in checked if c.profile.cpu_policy == "exclusive"]
    if owned and exclusive_profiles and not owned - cpus.shared - cpus.housekeeping:
        key = "shared_cpus" if owned <= cpus.shared else "housekeeping_cpus"
        out.append(
            Problem(
                *cpus.where(key),
                key,
                f"every CPU of cpu_pool ({format_cpulist(owned)}) is in shared_cpus or housekeeping_cpus: no CPU is "
                f"left for exclusive pods, so profile{'s' if len(exclusive_profiles) > 1 else ''} "
                f"{', '.join(exclusive_profiles)} (cpu_policy exclusive) would refuse every pod",
            )
        )
    return out


def _against_host(c: Checked, inv: HostInventory, cpus: CpuPools) -> list[Problem]:
    p = c.profile
    out: list[Problem] = []
    if p.page_size_bytes > PAGE_4K:
        label = textout.page_label(p.page_size_bytes)
        pools = [pool for pool in inv.hugepages if pool.page_size == p.page_size_bytes]
        key = "page_size"
        line = c.line(key)
        if not pools:
            out.append(Problem(c.file, line, key, f"the host kernel offers no {label} pages"))
        elif not any(pool.total for pool in pools):
            nodes = ", ".join(f"node{pool.node}" for pool in pools)
            out.append(
                Problem(
                    c.file,
                    line,
                    key,
                    f"no {label} hugepages are reserved on this host (nr_hugepages is 0 on {nodes}); "
                    f"reserve some or use page_size: 4Ki",
                )
            )
    if p.accel == "kvm" and not inv.hw_virt:
        out.append(Problem(c.file, c.line("accel"), "accel", "kvm, but the host CPU has no vmx/svm (use auto or tcg)"))
    if p.cpu_policy == "shared":
        if not cpus.shared:
            out.append(
                Problem(
                    c.file,
                    c.line("cpu_policy"),
                    "cpu_policy",
                    f"shared, but {cpus.described()} sets no shared_cpus: every pod of this profile would be refused "
                    "(set shared_cpus, a subset of cpu_pool)",
                )
            )
        return out
    # exclusive pods get the owned CPUs that are neither shared nor housekeeping
    exclusive = _online_owned(inv, cpus) - cpus.shared - cpus.housekeeping
    if not exclusive:
        return out  # reported once against the config (_cpu_pool_problems)
    if p.numa_policy == "single-numa-node":
        per_node = {n: sum(1 for cpu in inv.cpus if cpu.node == n and cpu.id in exclusive) for n in inv.nodes}
        largest, where = max(per_node.values(), default=0), "exclusive CPUs on one NUMA node"
    else:
        largest, where = len(exclusive), "exclusive CPUs"
    if p.vcpu_min > largest:
        out.append(
            Problem(
                c.file,
                c.line("vcpu.min"),
                "vcpu.min",
                f"{p.vcpu_min} exceeds the shim's {largest} {where}: no pod could be placed",
            )
        )
    elif p.vcpu_max > largest:
        out.append(
            Problem(
                c.file,
                c.line("vcpu.max"),
                "vcpu.max",
                f"{p.vcpu_max} exceeds the shim's {largest} {where}: pods needing more than {largest} vCPUs "
                "will be refused",
                "warning",
            )
        )
    return out


def problem_doc(p: Problem) -> dict[str, Any]:
    return {"file": p.file, "line": p.line, "key": p.key, "problem": p.problem, "severity": p.severity}


# -- RuntimeClass ---------------------------------------------------------------------------------
NODE_LABEL = "vmsandbox.dev/runtime"


def runtime_class(profile: Profile) -> dict[str, Any]:
    """The RuntimeClass for a profile's handler; ``overhead.podFixed`` is the profile's guest overhead.

    The guest's RAM is the pod's memory plus ``memory.overhead``; its vCPUs are ceil(cpu) plus
    ``vcpu.extra``. Declaring those as pod overhead lets the scheduler count them.
    """
    pod_fixed: dict[str, str] = {}
    if profile.vcpu_extra:
        pod_fixed["cpu"] = str(profile.vcpu_extra)
    pod_fixed["memory"] = textout.size(profile.memory_overhead_bytes)
    return {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": profile.handler, "labels": {"app.kubernetes.io/part-of": "vmsandbox"}},
        "handler": profile.handler,
        "overhead": {"podFixed": pod_fixed},
        "scheduling": {"nodeSelector": {NODE_LABEL: "true"}},
    }


def runtime_classes_yaml(profiles: Iterable[Profile], source: str) -> str:
    header = (
        f"# Generated by `vmsandbox profile runtimeclass {source}`: one RuntimeClass per profile handler.\n"
        "# overhead.podFixed = the profile's guest overhead (memory.overhead; vcpu.extra when set), so the\n"
        "# scheduler counts the guest's RAM beyond the containers'. QEMU's own memory is not included.\n"
        f"# Label the nodes that run the shim: kubectl label node NODE {NODE_LABEL}=true\n"
    )
    docs = [runtime_class(p) for p in profiles]
    return header + yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True)
