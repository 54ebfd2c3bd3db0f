"""A Kubernetes manifest as the kubelet would declare it to us (pure): pod template -> PodDeclaration.

``pod_from_manifest`` takes one parsed YAML document (a v1 Pod, or a workload whose pod template
it reads: Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, ReplicationController,
PodTemplate) and builds what a KEP-4112 kubelet would send as ``PodSandboxConfig.pod_resources``:

* init containers first (native sidecars, ``restartPolicy: Always``, stay init containers: this
  KEP revision cannot mark them; ``sidecars`` lists them), then app containers, in manifest order;
* requests and limits after the API server's defaulting (a resource with a limit and no request
  gets request = limit) and validation (request <= limit; hugepages and extended resources are not
  overcommitable, so their request equals their limit; extended resources are integers;
  hugepages need cpu or memory);
* ``volumeMounts`` as mounts with their container path only: the host path the kubelet would send
  (``/var/lib/kubelet/pods/<uid>/volumes/...``) is not derivable from a manifest; no devices.
* ``spec.overhead`` (set by the RuntimeClass admission controller), which the kubelet sends as
  ``LinuxPodSandboxConfig.overhead``.

``workloads`` unwraps ``kind: List`` documents (what ``kubectl get -o yaml`` prints) into their items.

Errors are ``InvalidArgument`` naming the manifest path (``spec.containers[1].resources...``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vmsandbox.admission import DEFAULT_PERIOD, cfs_quota
from vmsandbox.errors import InvalidArgument
from vmsandbox.quantity import Quantity
from vmsandbox.resources import (
    CPU,
    MEMORY,
    ContainerDeclaration,
    ContainerResources,
    Mount,
    PodDeclaration,
    ResourceList,
    hugepage_size,
    is_extended,
)
from vmsandbox.sizing import LinuxResources, declared_amount

#: kind -> (accepted apiVersions, path from the document to the pod template; () = the document is the pod)
WORKLOAD_KINDS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "Pod": (("v1",), ()),
    "PodTemplate": (("v1",), ("template",)),
    "ReplicationController": (("v1",), ("spec", "template")),
    "Deployment": (("apps/v1",), ("spec", "template")),
    "StatefulSet": (("apps/v1",), ("spec", "template")),
    "DaemonSet": (("apps/v1",), ("spec", "template")),
    "ReplicaSet": (("apps/v1",), ("spec", "template")),
    "Job": (("batch/v1",), ("spec", "template")),
    "CronJob": (("batch/v1",), ("spec", "jobTemplate", "spec", "template")),
}

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_KUBELET_MOUNTS_NOTE = (
    "mounts list container paths only: the kubelet sends host paths under /var/lib/kubelet/pods/<uid>/ "
    "and adds its own (/etc/hosts, /dev/termination-log, the service-account token), which a manifest "
    "cannot tell; they do not change the VM's size"
)


@dataclass(frozen=True)
class PodManifest:
    """What ``plan`` needs from a manifest: who the pod is and what it declares."""

    kind: str
    name: str
    namespace: str
    runtime_class: str
    labels: tuple[tuple[str, str], ...]
    annotations: tuple[tuple[str, str], ...]
    declaration: PodDeclaration
    sidecars: tuple[str, ...] = ()  # init containers with restartPolicy: Always
    notes: tuple[str, ...] = ()
    overhead_cpu_millis: int = 0  # spec.overhead (RuntimeClass overhead)
    overhead_memory_bytes: int = 0
    pod_limits: ResourceList = field(default_factory=ResourceList)  # spec.resources.limits (KEP-2837)
    # spec.resourceClaims: (name, resourceClaimTemplateName, resourceClaimName), one of the last two set
    resource_claims: tuple[tuple[str, str, str], ...] = ()

    @property
    def pod_level(self) -> bool:
        """Whether the pod sets pod-level cpu or memory limits (``spec.resources``)."""
        return self.pod_limits.get(CPU) is not None or self.pod_limits.get(MEMORY) is not None

    def kubelet_sandbox_resources(self) -> LinuxResources:
        """``LinuxPodSandboxConfig.resources`` as a kubelet without pod_resources computes them
        (``calculateSandboxResources``): the pod's cpu and memory limits, each the pod-level one when
        set, else the containers' limits summed by KEP-753's rule (a container without a limit adds
        nothing); cpu as a CFS quota (``admission.cfs_quota``)."""

        def limit(name: str, *, milli: bool) -> int:
            pod = self.pod_limits.get(name)
            if pod is not None:
                return pod.milli_value() if milli else pod.value_int()

            def of(c: ContainerDeclaration) -> int:
                q = c.resources.limits.get(name)
                return 0 if q is None else (q.milli_value() if milli else q.value_int())

            return declared_amount(self.declaration, self.sidecars, of)

        quota = cfs_quota(limit(CPU, milli=True))
        return LinuxResources(
            cpu_period=DEFAULT_PERIOD if quota else 0,
            cpu_quota=quota,
            memory_limit_bytes=limit(MEMORY, milli=False),
        )

    @property
    def pod(self) -> str:
        return f"{self.namespace}/{self.name}"


def is_workload(doc: object) -> bool:
    return isinstance(doc, Mapping) and doc.get("kind") in WORKLOAD_KINDS


def _is_list(doc: object) -> bool:
    """``kind: List`` (or a typed list such as ``PodList``) holding ``items``."""
    return isinstance(doc, Mapping) and str(doc.get("kind", "")).endswith("List") and "items" in doc


def workloads(docs: Sequence[object]) -> list[Mapping[str, Any]]:
    """The pod-bearing documents, in order, with ``kind: List`` documents unwrapped into their items."""
    found: list[Mapping[str, Any]] = []
    for doc in docs:
        if _is_list(doc):
            assert isinstance(doc, Mapping)
            items = doc["items"]
            if not isinstance(items, list):
                raise InvalidArgument(f"kind {doc.get('kind')}: items must be a list, got {type(items).__name__}")
            found += workloads(items)
        elif is_workload(doc):
            assert isinstance(doc, Mapping)
            found.append(doc)
    return found


def _kinds(docs: Sequence[object]) -> set[str]:
    out: set[str] = set()
    for d in docs:
        if _is_list(d):
            assert isinstance(d, Mapping)
            items = d["items"]
            out |= _kinds(items) if isinstance(items, list) else set()
        elif isinstance(d, Mapping):
            out.add(str(d.get("kind")))
    return out


def select_workload(docs: Sequence[object], index: int | None = None) -> Mapping[str, Any]:
    """The document to plan: the only pod-bearing one, or the ``index``-th of them (0-based)."""
    workloads_ = workloads(docs)
    return pick(workloads_, _kinds(docs), index)


def describe_all(found: Sequence[Mapping[str, Any]]) -> str:
    """``0: Pod/a, 1: Deployment/b``: the pod-bearing documents by index."""
    return ", ".join(f"{index}: {_describe(d)}" for index, d in enumerate(found))


def pick(workloads: Sequence[Mapping[str, Any]], kinds: set[str], index: int | None) -> Mapping[str, Any]:
    """The only one of ``workloads``, or the ``index``-th; ``kinds`` names what was found instead of pods."""
    if not workloads:
        found = f" (found kind {', '.join(sorted(kinds))})" if kinds else ""
        raise InvalidArgument(
            f"no pod in the manifest{found}: expected kind {', '.join(WORKLOAD_KINDS)}",
        )
    if index is None:
        if len(workloads) > 1:
            raise InvalidArgument(
                f"the manifest holds {len(workloads)} pod templates ({describe_all(workloads)}); choose one by index"
            )
        index = 0
    if not 0 <= index < len(workloads):
        raise InvalidArgument(f"document index {index} is out of range: the manifest holds {len(workloads)} pods")
    chosen = workloads[index]
    assert isinstance(chosen, Mapping)
    return chosen


def _describe(doc: object) -> str:
    if not isinstance(doc, Mapping):
        return "?"
    meta = doc.get("metadata")
    name = meta.get("name", "?") if isinstance(meta, Mapping) else "?"
    return f"{doc.get('kind')}/{name}"


def _mapping(value: object, path: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        what = "missing" if value is None else f"must be a mapping, got {type(value).__name__}"
        raise InvalidArgument(f"{path}: {what}")
    return value


def _list(value: object, path: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidArgument(f"{path}: must be a list, got {type(value).__name__}")
    return value


def _string(value: object, path: str, *, default: str | None = None) -> str:
    if value is None and default is not None:
        return default
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{path}: must be a non-empty string")
    return value


def _quantity_text(value: object, path: str) -> str:
    """YAML gives ``cpu: 1`` as an int and ``cpu: 0.5`` as a float; Kubernetes reads both as quantities."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise InvalidArgument(f"{path}: a quantity must be a string or a number, got {value!r}")
    if isinstance(value, float):
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    return str(value)


def _resource_list(value: object, path: str) -> ResourceList:
    raw = _mapping(value, path)
    texts = {}
    for name, amount in raw.items():
        if not isinstance(name, str):
            raise InvalidArgument(f"{path}: resource names must be strings, got {name!r}")
        texts[name] = _quantity_text(amount, f"{path}.{name}")
    return ResourceList.parse(texts, where=path)


def _resources(container: Mapping[str, Any], path: str) -> tuple[ResourceList, ResourceList]:
    """Requests and limits after defaulting (request := limit) and the API server's validation."""
    res = _mapping(container.get("resources"), f"{path}.resources")
    unknown = sorted(str(k) for k in set(res) - {"requests", "limits", "claims"})
    if unknown:
        raise InvalidArgument(f"{path}.resources.{unknown[0]}: unknown field (known: claims, limits, requests)")
    limits = _resource_list(res.get("limits"), f"{path}.resources.limits")
    requests = _resource_list(res.get("requests"), f"{path}.resources.requests")
    merged: dict[str, Quantity] = dict(requests)
    for name, limit in limits:
        request = requests.get(name)
        if request is None:
            merged[name] = limit  # the API server defaults a missing request to the limit
            continue
        overcommitable = hugepage_size(name) is None and not is_extended(name)
        if overcommitable and request > limit:
            raise InvalidArgument(
                f"{path}.resources.requests.{name}: {request.canonical()} must be less than or equal to "
                f"{name} limit of {limit.canonical()}"
            )
        if not overcommitable and request != limit:
            raise InvalidArgument(
                f"{path}.resources.requests.{name}: {request.canonical()} must be equal to {name} limit of "
                f"{limit.canonical()} ({name} is not overcommitable)"
            )
    for name, request in requests:
        if (hugepage_size(name) is not None or is_extended(name)) and limits.get(name) is None:
            raise InvalidArgument(
                f"{path}.resources.limits.{name}: a limit must be set for non-overcommitable resource {name} "
                f"(requested {request.canonical()})"
            )
    for name, q in merged.items():
        if is_extended(name) and q.value != q.value_int():
            raise InvalidArgument(f"{path}.resources.{name}: {q.canonical()} must be an integer")
        page = hugepage_size(name)
        if page is not None and q.value_int() % page:
            raise InvalidArgument(
                f"{path}.resources.{name}: {q.canonical()} is not a whole number of {name.removeprefix('hugepages-')} "
                "pages"
            )
    if any(hugepage_size(n) is not None for n in merged) and CPU not in merged and MEMORY not in merged:
        raise InvalidArgument(f"{path}.resources: HugePages require cpu or memory")
    return ResourceList.of(merged), limits


def _mounts(container: Mapping[str, Any], path: str) -> frozenset[Mount]:
    mounts = set()
    for i, item in enumerate(_list(container.get("volumeMounts"), f"{path}.volumeMounts")):
        where = f"{path}.volumeMounts[{i}]"
        entry = _mapping(item, where, required=True)
        _string(entry.get("name"), f"{where}.name")
        mount_path = _string(entry.get("mountPath"), f"{where}.mountPath")
        readonly = entry.get("readOnly", False)
        if not isinstance(readonly, bool):
            raise InvalidArgument(f"{where}.readOnly: must be true or false")
        mounts.add(Mount(container_path=mount_path, readonly=readonly))
    return frozenset(mounts)


def _container(item: object, path: str) -> ContainerDeclaration:
    container = _mapping(item, path, required=True)
    name = _string(container.get("name"), f"{path}.name")
    if len(name) > 63 or not _DNS_LABEL.fullmatch(name):
        raise InvalidArgument(f"{path}.name: {name!r} is not a valid container name (a DNS-1123 label)")
    where = f'{path} ("{name}")'
    requests, limits = _resources(container, where)
    return ContainerDeclaration(
        name=name,
        resources=ContainerResources(requests=requests, limits=limits, mounts=_mounts(container, where)),
    )


def pod_from_manifest(doc: Mapping[str, Any]) -> PodManifest:
    """The pod a kubelet would run for ``doc`` and the KEP-4112 declaration it would send."""
    kind = doc.get("kind")
    if kind not in WORKLOAD_KINDS:
        raise InvalidArgument(f"kind: {kind!r} is not a pod or a workload with a pod template")
    versions, template_path = WORKLOAD_KINDS[str(kind)]
    api_version = doc.get("apiVersion")
    if api_version not in versions:
        raise InvalidArgument(f"apiVersion: {api_version!r} is not a version of {kind} (expected {versions[0]})")
    meta = _mapping(doc.get("metadata"), "metadata", required=True)
    name = meta.get("name") or meta.get("generateName")
    name = _string(name, "metadata.name")
    namespace = _string(meta.get("namespace"), "metadata.namespace", default="default")
    template: Mapping[str, Any] = doc
    path = ""
    for key in template_path:
        path = f"{path}.{key}" if path else key
        template = _mapping(template.get(key), path, required=True)
    prefix = f"{path}." if path else ""
    template_meta = _mapping(template.get("metadata"), f"{prefix}metadata")
    labels = _mapping(template_meta.get("labels"), f"{prefix}metadata.labels")
    annotations = _mapping(template_meta.get("annotations"), f"{prefix}metadata.annotations")
    spec = _mapping(template.get("spec"), f"{prefix}spec", required=True)
    spec_path = f"{prefix}spec"

    init = []
    sidecars = []
    for i, item in enumerate(_list(spec.get("initContainers"), f"{spec_path}.initContainers")):
        decl = _container(item, f"{spec_path}.initContainers[{i}]")
        init.append(decl)
        if isinstance(item, Mapping) and item.get("restartPolicy") == "Always":
            sidecars.append(decl.name)
    containers_raw = _list(spec.get("containers"), f"{spec_path}.containers")
    if not containers_raw:
        raise InvalidArgument(f"{spec_path}.containers: a pod needs at least one container")
    apps = [_container(item, f"{spec_path}.containers[{i}]") for i, item in enumerate(containers_raw)]
    try:
        declaration = PodDeclaration(init_containers=tuple(init), containers=tuple(apps))
    except InvalidArgument as exc:
        raise InvalidArgument(f"{spec_path}: {exc}") from None

    notes = []
    if any(c.resources.mounts for c in declaration.all_containers()):
        notes.append(_KUBELET_MOUNTS_NOTE)
    _, pod_limits = _resources(spec, spec_path)
    if pod_limits.get(CPU) is not None or pod_limits.get(MEMORY) is not None:
        notes.append(
            f"{spec_path}.resources (pod-level resources) has no place in pod_resources: the kubelet sends the "
            "pod-level limits as LinuxPodSandboxConfig.resources instead, and hands them to each container "
            "without limits of its own; this plan sizes the VM from them, as the shim does"
        )
    overhead = _resource_list(spec.get("overhead"), f"{spec_path}.overhead")
    overhead_cpu, overhead_memory = overhead.get(CPU), overhead.get(MEMORY)
    if any(isinstance(c, Mapping) and c.get("volumeDevices") for c in (*_init_raw(spec), *containers_raw)):
        notes.append("volumeDevices are not declared: raw block devices need passthrough, not available yet")
    runtime_class = spec.get("runtimeClassName") or ""
    if not isinstance(runtime_class, str):
        raise InvalidArgument(f"{spec_path}.runtimeClassName: must be a string")
    return PodManifest(
        kind=str(kind),
        name=name,
        namespace=namespace,
        runtime_class=runtime_class,
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        annotations=tuple(sorted((str(k), str(v)) for k, v in annotations.items())),
        declaration=declaration,
        sidecars=tuple(sidecars),
        notes=tuple(notes),
        overhead_cpu_millis=overhead_cpu.milli_value() if overhead_cpu is not None else 0,
        overhead_memory_bytes=overhead_memory.value_int() if overhead_memory is not None else 0,
        pod_limits=pod_limits,
        resource_claims=_resource_claims(spec, spec_path),
    )


def _resource_claims(spec: Mapping[str, Any], spec_path: str) -> tuple[tuple[str, str, str], ...]:
    out = []
    for i, item in enumerate(_list(spec.get("resourceClaims"), f"{spec_path}.resourceClaims")):
        path = f"{spec_path}.resourceClaims[{i}]"
        entry = _mapping(item, path, required=True)
        name = _string(entry.get("name"), f"{path}.name")
        template = _string(entry.get("resourceClaimTemplateName"), f"{path}.resourceClaimTemplateName", default="")
        claim = _string(entry.get("resourceClaimName"), f"{path}.resourceClaimName", default="")
        if bool(template) == bool(claim):
            raise InvalidArgument(f"{path}: exactly one of resourceClaimTemplateName and resourceClaimName")
        out.append((name, template, claim))
    return tuple(out)


def _init_raw(spec: Mapping[str, Any]) -> Sequence[Any]:
    raw = spec.get("initContainers")
    return raw if isinstance(raw, list) else ()
