"""``vmsandbox profile validate`` and ``profile runtimeclass``: check profile files, derive RuntimeClasses.

Validation is the schema of ``vmsandbox.profile`` (every key, type and range; ``min <= max``) plus
what only a host can tell: the page size is reserved there, the vCPU bounds fit a NUMA node of the
CPUs the shim owns, ``accel: kvm`` has hardware virtualisation, extended resources name device pools
that resolve, the guest image exists. Each problem is ``file:line: key: problem``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from shim import textout
from vmsandbox.adapters.profile_loader import _key_lines
from vmsandbox.devices import DevicePools
from vmsandbox.host import HostInventory
from vmsandbox.profile import PAGE_4K, Profile, ProfileError, profile_from_mapping

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


def parse_files(paths: Iterable[str]) -> tuple[list[Checked], list[Problem]]:
    """Every profile of every file, and the schema problems (one per document: the first found)."""
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
            try:
                profile = profile_from_mapping(doc, source=path)
            except ProfileError as exc:
                problems.append(Problem(path, lines.get(exc.key, start), exc.key, exc.problem))
                continue
            checked.append(Checked(profile, path, lines, start))
        if not found:
            problems.append(Problem(path, 1, "(file)", "holds no profile"))
    return checked, problems


def host_problems(
    checked: list[Checked],
    inventory: HostInventory | None,
    owned: frozenset[int] | None,
    *,
    check_images: bool,
    device_pools: DevicePools | None = None,
) -> list[Problem]:
    """Semantic checks across files and against the host (``inventory`` None: host checks skipped;
    ``device_pools``: the shim's pools resolved on that host, None to skip pool checks)."""
    problems: list[Problem] = []
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
            problems.extend(_against_host(c, inventory, owned))
    return problems


def _against_host(c: Checked, inv: HostInventory, owned: frozenset[int] | None) -> list[Problem]:
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
    mine = owned if owned is not None else frozenset(cpu.id for cpu in inv.cpus)
    per_node = {n: sum(1 for cpu in inv.cpus if cpu.node == n and cpu.id in mine) for n in inv.nodes}
    largest = max(per_node.values(), default=0)
    if p.cpu_policy == "exclusive":
        if p.vcpu_min > largest:
            out.append(
                Problem(
                    c.file,
                    c.line("vcpu.min"),
                    "vcpu.min",
                    f"{p.vcpu_min} exceeds the {largest} CPUs the shim owns on one NUMA node: no pod could be placed",
                )
            )
        elif p.vcpu_max > largest:
            out.append(
                Problem(
                    c.file,
                    c.line("vcpu.max"),
                    "vcpu.max",
                    f"{p.vcpu_max} exceeds the {largest} CPUs the shim owns on one NUMA node: pods needing more "
                    f"than {largest} vCPUs will be refused",
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
