"""Tests of vmsandbox.sizing: effective pod demand (declared and legacy) and the VM shape
(docs/sizing-and-admission.md, "How a pod is sized")."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.errors import CannotFit, InvalidArgument
from vmsandbox.profile import Profile
from vmsandbox.quantity import format_quantity, parse_quantity
from vmsandbox.resources import ContainerDeclaration, ContainerResources, PodDeclaration, ResourceList
from vmsandbox.sizing import (
    LinuxResources,
    PodDemand,
    VmShape,
    demand_from_declaration,
    demand_from_linux,
    linux_resources_from_annotations,
    running_alongside,
    shape_for,
    sidecars_from_annotations,
)

KI, MI, GI = 1024, 1024**2, 1024**3
P2M, P1G = 2 * MI, GI
PROFILE = Profile(name="test", handler="test")  # 1..16 vCPUs, +64Mi, >=128Mi, 2Mi pages, 1 cpu / 256Mi defaults
NONE: frozenset[str] = frozenset()


def container(
    name: str, requests: dict[str, str] | None = None, limits: dict[str, str] | None = None
) -> ContainerDeclaration:
    return ContainerDeclaration(
        name,
        ContainerResources(
            requests=ResourceList.parse(requests or {}, where=f"{name}: requests"),
            limits=ResourceList.parse(limits or {}, where=f"{name}: limits"),
        ),
    )


def pod(*apps: ContainerDeclaration, init: tuple[ContainerDeclaration, ...] = ()) -> PodDeclaration:
    return PodDeclaration(init_containers=init, containers=apps)


# -- demand_from_declaration -------------------------------------------------------------------
DECLARED = [
    pytest.param(
        pod(container("app", limits={"cpu": "500m", "memory": "512Mi"})),
        NONE,
        PodDemand(500, 512 * MI),
        id="limits",
    ),
    pytest.param(
        pod(container("app", requests={"cpu": "250m", "memory": "64Mi"}, limits={"cpu": "2", "memory": "1Gi"})),
        NONE,
        PodDemand(2000, GI),
        id="limit-wins-over-request",
    ),
    pytest.param(
        pod(container("app", requests={"cpu": "300m", "memory": "100Mi"})),
        NONE,
        PodDemand(300, 100 * MI),
        id="request-when-no-limit",
    ),
    pytest.param(pod(container("app")), NONE, PodDemand(1000, 256 * MI), id="profile-default-when-neither"),
    pytest.param(pod(container("a"), container("b")), NONE, PodDemand(2000, 512 * MI), id="default-per-container"),
    pytest.param(
        pod(container("app", requests={"cpu": "1000m"}, limits={"memory": "1073741824"})),
        NONE,
        PodDemand(1000, GI),
        id="canonicalised-spellings",
    ),
    pytest.param(
        pod(container("app", limits={"cpu": "0.0001", "memory": "129M"})),
        NONE,
        PodDemand(1, 129_000_000),
        id="millicores-round-up-decimal-memory",
    ),
    pytest.param(
        pod(
            container("a", limits={"cpu": "500m", "memory": "100Mi"}),
            container("b", limits={"cpu": "700m", "memory": "200Mi"}),
        ),
        NONE,
        PodDemand(1200, 300 * MI),
        id="apps-sum",
    ),
    pytest.param(
        pod(
            container("a", limits={"cpu": "1", "memory": "128Mi"}),
            container("b", limits={"cpu": "1", "memory": "128Mi"}),
            init=(container("init", limits={"cpu": "3", "memory": "64Mi"}),),
        ),
        NONE,
        PodDemand(3000, 256 * MI),
        id="init-larger-cpu-apps-larger-memory",
    ),
    pytest.param(
        pod(
            container("a", limits={"cpu": "1", "memory": "128Mi"}),
            init=(
                container("i1", limits={"cpu": "2", "memory": "1Gi"}),
                container("i2", limits={"cpu": "3", "memory": "64Mi"}),
            ),
        ),
        NONE,
        PodDemand(3000, GI),
        id="max-over-init-containers",
    ),
    pytest.param(
        pod(
            container("a", limits={"cpu": "1", "memory": "128Mi"}),
            container("b", limits={"cpu": "1", "memory": "128Mi"}),
            init=(container("init", limits={"cpu": "3", "memory": "64Mi"}),),
        ),
        frozenset({"init"}),
        PodDemand(5000, 320 * MI),
        id="sidecar-adds-to-apps",
    ),
    pytest.param(
        pod(container("app", limits={"cpu": "200m", "memory": "64Mi"}), init=(container("init"),)),
        NONE,
        PodDemand(1000, 256 * MI),
        id="init-default-counts",
    ),
    pytest.param(
        pod(container("app", limits={"cpu": "1", "memory": "64Mi", "hugepages-2Mi": "64Mi"})),
        NONE,
        PodDemand(1000, 64 * MI, hugepages=((P2M, 64 * MI),)),
        id="hugepages-2Mi",
    ),
    pytest.param(
        pod(
            container("a", limits={"hugepages-1Gi": "2Gi", "hugepages-2Mi": "4Mi"}),
            container("b", requests={"hugepages-2Mi": "6Mi"}, limits={"hugepages-2Mi": "6Mi"}),
        ),
        NONE,
        PodDemand(2000, 512 * MI, hugepages=((P2M, 10 * MI), (P1G, 2 * GI))),
        id="hugepages-both-sizes-sorted",
    ),
    pytest.param(
        pod(container("app", limits={"hugepages-2Mi": "0"})),
        NONE,
        PodDemand(1000, 256 * MI),
        id="zero-hugepages-dropped",
    ),
    pytest.param(
        pod(container("app", requests={"ephemeral-storage": "1Gi"}, limits={"ephemeral-storage": "2Gi"})),
        NONE,
        PodDemand(1000, 256 * MI, ephemeral_storage_bytes=2 * GI),
        id="ephemeral-storage",
    ),
    pytest.param(
        pod(
            container("a", limits={"vendor.com/gpu": "1", "example.org/nic": "2"}),
            container("b", limits={"vendor.com/gpu": "2"}),
        ),
        NONE,
        PodDemand(2000, 512 * MI, extended=(("example.org/nic", 2), ("vendor.com/gpu", 3))),
        id="extended-resources",
    ),
]


@pytest.mark.parametrize(("declaration", "sidecars", "expected"), DECLARED)
def test_demand_from_declaration(declaration: PodDeclaration, sidecars: frozenset[str], expected: PodDemand) -> None:
    assert demand_from_declaration(declaration, PROFILE, sidecars=sidecars) == expected


# -- sidecars (KEP-753) ------------------------------------------------------------------------------
def limits(name: str, cpu: str, memory: str, **more: str) -> ContainerDeclaration:
    return container(name, limits={"cpu": cpu, "memory": memory, **{k.replace("_", "-"): v for k, v in more.items()}})


# Kubernetes' effective amount: max(max_i (init_i + sidecars declared before i), sidecars + apps),
# with the figures Kubernetes computes for these pods (kubectl describe node: Requests)
KEP_753 = [
    pytest.param(
        (limits("log", "100m", "64Mi"),),
        (limits("app", "1", "192Mi"),),
        {"log"},
        (1100, 256 * MI),
        (1000, 192 * MI),
        id="sidecar-beside-the-app",
    ),
    pytest.param(
        (limits("migrate", "2", "1Gi"), limits("proxy", "200m", "128Mi")),
        (limits("app", "500m", "256Mi"),),
        {"proxy"},
        (2000, GI),
        (2000, GI),
        id="sidecar-after-a-plain-init",
    ),
    pytest.param(
        (limits("proxy", "200m", "128Mi"), limits("migrate", "2", "1Gi")),
        (limits("app", "500m", "256Mi"),),
        {"proxy"},
        (2200, GI + 128 * MI),
        (2000, GI),
        id="sidecar-before-a-plain-init-order-matters",
    ),
    pytest.param(
        (
            limits("s1", "100m", "16Mi"),
            limits("i1", "2", "64Mi"),
            limits("s2", "300m", "32Mi"),
            limits("i2", "1500m", "256Mi"),
        ),
        (limits("app", "500m", "100Mi"),),
        {"s1", "s2"},
        (2100, 304 * MI),  # cpu: i1 + s1; memory: i2 + s1 + s2
        (2000, 256 * MI),
        id="two-sidecars-around-two-inits",
    ),
    pytest.param(
        (limits("s1", "250m", "64Mi"), limits("s2", "250m", "64Mi")),
        (limits("a", "1", "128Mi"), limits("b", "1", "128Mi")),
        {"s1", "s2"},
        (2500, 384 * MI),
        (2000, 256 * MI),
        id="all-init-containers-are-sidecars",
    ),
    pytest.param(
        (limits("setup", "2", "2Gi"),),
        (limits("app", "1", "1Gi"),),
        set(),
        (2000, 2 * GI),  # a plain init container ends before the app starts: not 3 cpus, 3Gi
        (2000, 2 * GI),
        id="plain-init-is-not-summed",
    ),
    pytest.param(
        (container("agent"),),
        (limits("app", "500m", "64Mi"),),
        {"agent"},
        (1500, 320 * MI),  # the sidecar declares nothing: the profile's 1 cpu / 256Mi
        (1000, 256 * MI),
        id="sidecar-takes-profile-defaults",
    ),
]


@pytest.mark.parametrize(("inits", "apps", "sidecars", "kubernetes", "without_sidecars"), KEP_753)
def test_sidecars_follow_kubernetes(
    inits: tuple[ContainerDeclaration, ...],
    apps: tuple[ContainerDeclaration, ...],
    sidecars: set[str],
    kubernetes: tuple[int, int],
    without_sidecars: tuple[int, int],
) -> None:
    decl = pod(*apps, init=inits)
    got = demand_from_declaration(decl, PROFILE, sidecars=frozenset(sidecars))
    assert (got.cpu_millis, got.memory_bytes) == kubernetes
    plain = demand_from_declaration(decl, PROFILE)  # what the shim computes when nobody names the sidecars
    assert (plain.cpu_millis, plain.memory_bytes) == without_sidecars


def test_sidecar_hugepages_add_to_the_apps() -> None:
    decl = pod(
        limits("app", "1", "64Mi", hugepages_2Mi="8Mi"),
        init=(limits("dpdk-helper", "100m", "16Mi", hugepages_2Mi="4Mi"),),
    )
    assert demand_from_declaration(decl, PROFILE, sidecars=frozenset({"dpdk-helper"})).hugepages == ((P2M, 12 * MI),)
    assert demand_from_declaration(decl, PROFILE).hugepages == ((P2M, 8 * MI),)


def test_sidecar_must_be_an_init_container() -> None:
    with pytest.raises(InvalidArgument) as exc:
        demand_from_declaration(pod(container("app")), PROFILE, sidecars=frozenset({"app"}))
    assert str(exc.value) == "sidecar 'app' is not an init container of pod_resources"


SIDECAR_POD = pod(container("app"), init=(container("setup"), container("proxy"), container("log")))
ANNOTATED = [
    pytest.param({}, frozenset(), id="absent-none"),
    pytest.param({"io.vmsandbox/sidecars": "proxy"}, frozenset({"proxy"}), id="one"),
    pytest.param({"io.vmsandbox/sidecars": " proxy , log "}, frozenset({"proxy", "log"}), id="two-with-spaces"),
    pytest.param({"other": "x"}, frozenset(), id="other-annotations"),
]


@pytest.mark.parametrize(("annotations", "expected"), ANNOTATED)
def test_sidecars_from_annotations(annotations: dict[str, str], expected: frozenset[str]) -> None:
    assert sidecars_from_annotations(annotations, SIDECAR_POD) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param(
            "app",
            "annotation io.vmsandbox/sidecars: 'app' is not an init container of pod_resources (init containers: "
            "'setup', 'proxy', 'log')",
            id="app-container",
        ),
        pytest.param(
            "ghost",
            "annotation io.vmsandbox/sidecars: 'ghost' is not an init container of pod_resources (init containers: "
            "'setup', 'proxy', 'log')",
            id="undeclared",
        ),
        pytest.param(
            "proxy,,log",
            "annotation io.vmsandbox/sidecars: an empty name (expected init container names separated by commas)",
            id="empty-entry",
        ),
        pytest.param("", "annotation io.vmsandbox/sidecars: an empty name", id="empty-value"),
        pytest.param("proxy,proxy", "annotation io.vmsandbox/sidecars: 'proxy' is named twice", id="twice"),
        pytest.param(
            "x" * 5000,
            f"annotation io.vmsandbox/sidecars: '{'x' * 64}...' is not an init container",
            id="long-name-bounded",
        ),
    ],
)
def test_sidecar_annotation_rejects(value: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        sidecars_from_annotations({"io.vmsandbox/sidecars": value}, SIDECAR_POD)
    assert str(exc.value).startswith(message)
    assert len(str(exc.value)) < 300


INIT_ORDER = ("s1", "i1", "s2", "i2")
ALONGSIDE = [
    pytest.param("i1", {"s1", "s2"}, {"a", "b"}, [{"s1"}], id="plain-init-beside-earlier-sidecars"),
    pytest.param("i2", {"s1", "s2"}, {"a", "b"}, [{"s1", "s2"}], id="later-plain-init"),
    pytest.param("i1", set(), {"a"}, [set()], id="plain-init-alone-without-sidecars"),
    pytest.param(
        "s1",
        {"s1", "s2"},
        {"a", "b"},
        [{"s2", "a", "b"}, {"i1"}, {"s2", "i2"}],
        id="sidecar-beside-apps-and-every-later-init",
    ),
    pytest.param("s2", {"s1", "s2"}, {"a"}, [{"s1", "a"}, {"s1", "i2"}], id="later-sidecar"),
    pytest.param("a", {"s1", "s2"}, {"a", "b", "i1"}, [{"s1", "s2", "b"}], id="app-beside-sidecars-and-apps"),
    pytest.param("a", set(), {"a", "b", "i1", "s1"}, [{"b"}], id="app-without-sidecars-skips-init"),
]


@pytest.mark.parametrize(("name", "sidecars", "others", "phases"), ALONGSIDE)
def test_running_alongside(name: str, sidecars: set[str], others: set[str], phases: list[set[str]]) -> None:
    got = running_alongside(name, INIT_ORDER, frozenset(sidecars), others)
    assert got == [frozenset(p) for p in phases]


# -- RuntimeClass overhead (LinuxPodSandboxConfig.overhead) -----------------------------------------
def test_overhead_is_carried_by_both_ways_in() -> None:
    overhead = LinuxResources(cpu_period=100000, cpu_quota=25000, memory_limit_bytes=160 * MI)
    declared = demand_from_declaration(pod(limits("app", "1", "512Mi")), PROFILE, overhead=overhead)
    assert declared == PodDemand(1000, 512 * MI, overhead_cpu_millis=250, overhead_memory_bytes=160 * MI)
    legacy = demand_from_linux(
        LinuxResources(cpu_period=100000, cpu_quota=100000, memory_limit_bytes=512 * MI), {}, PROFILE, overhead=overhead
    )
    assert legacy == PodDemand(
        1000, 512 * MI, mode="linux-resources", overhead_cpu_millis=250, overhead_memory_bytes=160 * MI
    )
    assert demand_from_linux(LinuxResources(), {}, PROFILE, overhead=LinuxResources()) == PodDemand(
        1000, 256 * MI, mode="defaults"
    )


OVERHEAD = [
    # (pod cpu, pod memory, overhead cpu, overhead memory, profile overrides, vcpus, guest RAM)
    pytest.param(2000, 512 * MI, 0, 0, {}, 2, 576 * MI, id="no-overhead-profile-only"),
    pytest.param(2000, 512 * MI, 0, 32 * MI, {}, 2, 576 * MI, id="smaller-than-profile-overhead"),
    pytest.param(2000, 512 * MI, 0, 256 * MI, {}, 2, 768 * MI, id="larger-replaces-profile-overhead"),
    pytest.param(2000, 512 * MI, 500, 0, {}, 3, 576 * MI, id="cpu-overhead-adds-a-vcpu"),
    pytest.param(1500, 512 * MI, 250, 0, {}, 2, 576 * MI, id="cpu-overhead-within-the-ceil"),
    pytest.param(1500, 512 * MI, 600, 0, {}, 3, 576 * MI, id="cpu-overhead-past-the-ceil"),
    # the RuntimeClass `vmsandbox profile runtimeclass` derives: podFixed = vcpu.extra, memory.overhead
    pytest.param(
        1500,
        512 * MI,
        1000,
        96 * MI,
        {"vcpu_extra": 1, "memory_overhead_bytes": 96 * MI},
        3,
        608 * MI,
        id="derived-runtimeclass-not-counted-twice",
    ),
    pytest.param(100, 16 * MI, 0, 64 * MI, {"memory_min_bytes": 256 * MI}, 1, 256 * MI, id="memory-min-still-applies"),
]


@pytest.mark.parametrize(("cpu", "memory", "ocpu", "omemory", "overrides", "vcpus", "ram"), OVERHEAD)
def test_shape_counts_the_runtimeclass_overhead(
    cpu: int, memory: int, ocpu: int, omemory: int, overrides: dict[str, int], vcpus: int, ram: int
) -> None:
    d = PodDemand(cpu, memory, overhead_cpu_millis=ocpu, overhead_memory_bytes=omemory)
    shape = shape_for(d, replace(PROFILE, **overrides))  # type: ignore[arg-type]
    assert (shape.vcpus, shape.memory_bytes) == (vcpus, ram)
    # Kubernetes counts the pod as its containers plus the overhead: the VM is never smaller
    assert shape.memory_bytes >= memory + omemory and shape.vcpus * 1000 >= cpu + ocpu


def test_overhead_past_vcpu_max_is_named() -> None:
    with pytest.raises(CannotFit) as exc:
        shape_for(PodDemand(16000, MI, overhead_cpu_millis=500), PROFILE)
    assert str(exc.value) == (
        "pod needs 17 vCPUs (16000m cpu + 500m RuntimeClass overhead) but profile 'test' allows at most 16"
    )


def test_profile_defaults_are_used() -> None:
    profile = replace(PROFILE, default_cpu_millis=250, default_memory_bytes=32 * MI)
    assert demand_from_declaration(pod(container("app")), profile) == PodDemand(250, 32 * MI)


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        pytest.param(
            pod(container("app", limits={"hugepages-2Mi": "3Mi"})),
            'pod_resources: container "app": limits.hugepages-2Mi 3Mi is not a whole number of 2Mi pages',
            id="2Mi-limit",
        ),
        pytest.param(
            pod(container("app", requests={"hugepages-1Gi": "1.5Gi"})),
            'pod_resources: container "app": requests.hugepages-1Gi 1536Mi is not a whole number of 1Gi pages',
            id="1Gi-request",
        ),
        # 1Mi + 1Mi is one page in all, but no container's cgroup can hold half a page
        pytest.param(
            pod(container("a", limits={"hugepages-2Mi": "1Mi"}), container("b", limits={"hugepages-2Mi": "1Mi"})),
            'pod_resources: container "a": limits.hugepages-2Mi 1Mi is not a whole number of 2Mi pages',
            id="per-container-even-when-sum-is-whole",
        ),
        pytest.param(
            pod(
                container("app", limits={"hugepages-2Mi": "4Mi"}), init=(container("i", limits={"hugepages-2Mi": "1"}),)
            ),
            'pod_resources: container "i": limits.hugepages-2Mi 1 is not a whole number of 2Mi pages',
            id="init-container-hidden-by-max",
        ),
    ],
)
def test_hugepages_must_be_whole_pages(declaration: PodDeclaration, message: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        demand_from_declaration(declaration, PROFILE)
    assert str(exc.value) == message


# -- shape_for -----------------------------------------------------------------------------------
def demand(cpu: int, memory: int, hugepages: tuple[tuple[int, int], ...] = ()) -> PodDemand:
    return PodDemand(cpu_millis=cpu, memory_bytes=memory, hugepages=hugepages)


SHAPES = [
    # (demand, profile overrides, vcpus, memory, backing page, guest hugepages)
    pytest.param(demand(500, 256 * MI), {}, 1, 320 * MI, P2M, (), id="half-cpu-plus-overhead"),
    pytest.param(demand(1500, 256 * MI), {}, 2, 320 * MI, P2M, (), id="cpu-ceil"),
    pytest.param(demand(2000, 256 * MI), {}, 2, 320 * MI, P2M, (), id="whole-cpus"),
    pytest.param(demand(1500, 256 * MI), {"vcpu_extra": 1}, 3, 320 * MI, P2M, (), id="vcpu-extra"),
    pytest.param(demand(500, 256 * MI), {"vcpu_min": 2}, 2, 320 * MI, P2M, (), id="vcpu-min"),
    pytest.param(demand(0, 256 * MI), {}, 1, 320 * MI, P2M, (), id="zero-cpu-gets-min"),
    pytest.param(demand(16000, 256 * MI), {}, 16, 320 * MI, P2M, (), id="exactly-max"),
    pytest.param(demand(1000, 10 * MI), {}, 1, 128 * MI, P2M, (), id="memory-min"),
    pytest.param(demand(1000, 10 * MI), {"memory_min_bytes": 129 * MI}, 1, 130 * MI, P2M, (), id="min-rounded-to-page"),
    # 99M + 64Mi = 158.4Mi -> 159Mi -> 160Mi (2Mi pages)
    pytest.param(demand(1000, 99_000_000), {}, 1, 160 * MI, P2M, (), id="round-to-MiB-then-page"),
    pytest.param(demand(1000, 99_000_000), {"page_size_bytes": 4096}, 1, 159 * MI, 4096, (), id="4Ki-rounds-to-MiB"),
    pytest.param(demand(1000, 256 * MI), {"page_size_bytes": P1G}, 1, GI, P1G, (), id="1Gi-profile-page"),
    pytest.param(demand(1000, 256 * MI), {"memory_overhead_bytes": 0}, 1, 256 * MI, P2M, (), id="no-overhead"),
    pytest.param(
        demand(1000, 256 * MI, ((P2M, 64 * MI),)),
        {"page_size_bytes": 4096},
        1,
        384 * MI,
        P2M,
        ((P2M, 32),),
        id="hugepages-choose-backing-and-add-memory",
    ),
    pytest.param(
        demand(1000, 256 * MI, ((P2M, 4 * MI), (P1G, GI))),
        {},
        1,
        2 * GI,
        P1G,
        ((P2M, 2), (P1G, 1)),
        id="largest-requested-page-backs",
    ),
    pytest.param(
        demand(1000, 256 * MI, ((P2M, 2 * MI),)),
        {"page_size_bytes": P1G},
        1,
        322 * MI,
        P2M,
        ((P2M, 1),),
        id="requested-page-overrides-profile",
    ),
]


@pytest.mark.parametrize(("pod_demand", "overrides", "vcpus", "memory", "backing", "guest_pages"), SHAPES)
def test_shape_for(
    pod_demand: PodDemand,
    overrides: dict[str, int],
    vcpus: int,
    memory: int,
    backing: int,
    guest_pages: tuple[tuple[int, int], ...],
) -> None:
    profile = replace(PROFILE, **overrides)  # type: ignore[arg-type]
    shape = shape_for(pod_demand, profile)
    assert shape == VmShape(
        vcpus=vcpus,
        memory_bytes=memory,
        backing_page_size=backing,
        guest_hugepages=guest_pages,
        cpu_policy="exclusive",
        demand=pod_demand,
    )
    assert shape.hugepage_backed is (backing > 4096)
    assert shape.backing_pages == (memory // backing if backing > 4096 else 0)


def test_shape_takes_cpu_policy_from_profile() -> None:
    assert shape_for(demand(1000, MI), replace(PROFILE, cpu_policy="shared")).cpu_policy == "shared"


@pytest.mark.parametrize(
    ("pod_demand", "overrides", "message"),
    [
        pytest.param(
            demand(16001, MI),
            {},
            "pod needs 17 vCPUs (16001m cpu + 0 extra) but profile 'test' allows at most 16",
            id="over-max",
        ),
        pytest.param(
            demand(16000, MI),
            {"vcpu_extra": 1},
            "pod needs 17 vCPUs (16000m cpu + 1 extra) but profile 'test' allows at most 16",
            id="extra-pushes-over",
        ),
        pytest.param(
            demand(500, MI),
            {"vcpu_min": 4, "vcpu_max": 2},
            "pod needs 4 vCPUs (500m cpu + 0 extra) but profile 'test' allows at most 2",
            id="min-above-max",
        ),
    ],
)
def test_shape_refuses_more_than_profile_allows(pod_demand: PodDemand, overrides: dict[str, int], message: str) -> None:
    with pytest.raises(CannotFit) as exc:
        shape_for(pod_demand, replace(PROFILE, **overrides))  # type: ignore[arg-type]
    assert str(exc.value) == message


# -- demand_from_linux (kubelets without KEP-4112) --------------------------------------------------
A_PERIOD = "io.kubernetes.cri.sandbox-cpu-period"
A_QUOTA = "io.kubernetes.cri.sandbox-cpu-quota"
A_SHARES = "io.kubernetes.cri.sandbox-cpu-shares"
A_MEMORY = "io.kubernetes.cri.sandbox-memory"

LEGACY = [
    pytest.param(
        LinuxResources(cpu_period=100000, cpu_quota=50000, memory_limit_bytes=512 * MI),
        {},
        PodDemand(500, 512 * MI, mode="linux-resources"),
        id="quota-and-memory",
    ),
    pytest.param(
        LinuxResources(cpu_period=100000, cpu_quota=33333, memory_limit_bytes=GI),
        {},
        PodDemand(334, GI, mode="linux-resources"),
        id="quota-ceil-to-millis",
    ),
    pytest.param(
        LinuxResources(cpu_period=50000, cpu_quota=75000),
        {},
        PodDemand(1500, 256 * MI, mode="linux-resources"),
        id="other-period-default-memory",
    ),
    pytest.param(
        LinuxResources(cpu_period=100000, cpu_quota=-1, memory_limit_bytes=GI),
        {},
        PodDemand(1000, GI, mode="linux-resources"),
        id="unlimited-quota-default-cpu",
    ),
    pytest.param(
        LinuxResources(hugepage_limits=((P2M, 8 * MI),)),
        {},
        PodDemand(1000, 256 * MI, hugepages=((P2M, 8 * MI),), mode="linux-resources"),
        id="hugepages-only",
    ),
    pytest.param(
        LinuxResources(memory_limit_bytes=GI, hugepage_limits=((P1G, GI), (P2M, 0))),
        {},
        PodDemand(1000, GI, hugepages=((P1G, GI),), mode="linux-resources"),
        id="zero-hugepage-limits-dropped",
    ),
    pytest.param(
        LinuxResources(),
        {A_PERIOD: "100000", A_QUOTA: "200000", A_MEMORY: "1073741824"},
        PodDemand(2000, GI, mode="annotations"),
        id="annotations",
    ),
    pytest.param(
        LinuxResources(),
        {A_MEMORY: "536870912"},
        PodDemand(1000, 512 * MI, mode="annotations"),
        id="annotation-memory-only",
    ),
    pytest.param(
        LinuxResources(),
        {A_PERIOD: "100000", A_QUOTA: "-1", A_MEMORY: "536870912"},
        PodDemand(1000, 512 * MI, mode="annotations"),
        id="annotation-unlimited-quota",
    ),
    pytest.param(
        LinuxResources(),
        {A_SHARES: "1024"},
        PodDemand(1000, 256 * MI, mode="defaults"),
        id="annotation-shares-only-is-defaults",
    ),
    pytest.param(LinuxResources(), {}, PodDemand(1000, 256 * MI, mode="defaults"), id="nothing-is-defaults"),
    pytest.param(
        LinuxResources(cpu_shares=512, cpu_period=100000),
        {A_MEMORY: "268435456"},
        PodDemand(1000, 256 * MI, mode="annotations"),
        id="shares-alone-fall-back-to-annotations",
    ),
    pytest.param(
        LinuxResources(cpu_period=100000, cpu_quota=100000),
        {A_QUOTA: "900000", A_PERIOD: "100000"},
        PodDemand(1000, 256 * MI, mode="linux-resources"),
        id="resources-win-over-annotations",
    ),
]


@pytest.mark.parametrize(("resources", "annotations", "expected"), LEGACY)
def test_demand_from_linux(resources: LinuxResources, annotations: dict[str, str], expected: PodDemand) -> None:
    assert demand_from_linux(resources, annotations, PROFILE) == expected


@pytest.mark.parametrize(
    ("resources", "annotations", "message"),
    [
        pytest.param(
            LinuxResources(),
            {A_QUOTA: "abc"},
            'annotation io.kubernetes.cri.sandbox-cpu-quota: "abc" is not an integer',
            id="quota-junk",
        ),
        pytest.param(
            LinuxResources(),
            {A_PERIOD: "1.5"},
            'annotation io.kubernetes.cri.sandbox-cpu-period: "1.5" is not an integer',
            id="period-fraction",
        ),
        pytest.param(
            LinuxResources(),
            {A_MEMORY: "512Mi"},
            'annotation io.kubernetes.cri.sandbox-memory: "512Mi" is not an integer',
            id="memory-quantity",
        ),
        pytest.param(
            LinuxResources(),
            {A_MEMORY: "-5"},
            'annotation io.kubernetes.cri.sandbox-memory: "-5" is negative',
            id="memory-negative",
        ),
        pytest.param(
            LinuxResources(),
            {A_QUOTA: "-2"},
            'annotation io.kubernetes.cri.sandbox-cpu-quota: "-2" is negative',
            id="quota-below-minus-one",
        ),
        pytest.param(
            LinuxResources(),
            {A_SHARES: "-1"},
            'annotation io.kubernetes.cri.sandbox-cpu-shares: "-1" is negative',
            id="shares-minus-one",
        ),
        pytest.param(
            LinuxResources(hugepage_limits=((P2M, 3 * MI),)),
            {},
            "hugepage limit of 3145728 bytes is not a whole number of 2097152 byte pages",
            id="hugepage-limit-not-whole-pages",
        ),
    ],
)
def test_demand_from_linux_rejects(resources: LinuxResources, annotations: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        demand_from_linux(resources, annotations, PROFILE)
    assert str(exc.value) == message


def test_annotations_parse_to_linux_resources() -> None:
    got = linux_resources_from_annotations({A_PERIOD: "100000", A_QUOTA: "250000", A_SHARES: "2560", A_MEMORY: "1024"})
    assert got == LinuxResources(cpu_period=100000, cpu_quota=250000, cpu_shares=2560, memory_limit_bytes=1024)
    assert got.cpu_millis() == 2500


@pytest.mark.parametrize(
    ("quota", "period", "millis"),
    [
        pytest.param(0, 100000, 0, id="no-quota"),
        pytest.param(-1, 100000, 0, id="unlimited"),
        pytest.param(50000, 0, 0, id="no-period"),
        pytest.param(1, 100000, 1, id="tiny-rounds-up"),
        pytest.param(10000, 30000, 334, id="non-decimal-ratio"),
        pytest.param(200000, 100000, 2000, id="two-cpus"),
    ],
)
def test_cpu_millis(quota: int, period: int, millis: int) -> None:
    assert LinuxResources(cpu_period=period, cpu_quota=quota).cpu_millis() == millis


# -- property: same input, same shape ----------------------------------------------------------
CPU_MILLIS = st.sampled_from([0, 1, 100, 250, 500, 999, 1000, 1500, 2000, 3333])
MEM_MIB = st.sampled_from([0, 1, 64, 100, 128, 256, 513])
PAGES_2M = st.sampled_from([0, 1, 3, 32])


def spell_cpu(millis: int, style: int) -> str:
    if style == 0:
        return f"{millis}m"
    if style == 1:
        return format_quantity(parse_quantity(f"{millis}m").value)
    return f"{millis}e-3"


def spell_bytes(amount: int, style: int) -> str:
    if style == 0:
        return str(amount)
    if style == 1 and amount % KI == 0:
        return f"{amount // KI}Ki"
    return format_quantity(amount, "BinarySI")


@st.composite
def raw_containers(draw: st.DrawFn, prefix: str, min_size: int) -> list[tuple[str, dict[str, int]]]:
    n = draw(st.integers(min_size, 3))
    out = []
    for i in range(n):
        amounts: dict[str, int] = {}
        if draw(st.booleans()):
            amounts["cpu"] = draw(CPU_MILLIS)
        if draw(st.booleans()):
            amounts["memory"] = draw(MEM_MIB) * MI
        if draw(st.booleans()):
            amounts["hugepages-2Mi"] = draw(PAGES_2M) * P2M
        out.append((f"{prefix}{i}", amounts))
    return out


def build(
    raw_init: list[tuple[str, dict[str, int]]], raw_apps: list[tuple[str, dict[str, int]]], style: int
) -> PodDeclaration:
    def one(name: str, amounts: dict[str, int]) -> ContainerDeclaration:
        spelled = {k: spell_cpu(v, style) if k == "cpu" else spell_bytes(v, style) for k, v in amounts.items()}
        return container(name, limits=spelled)

    return PodDeclaration(
        init_containers=tuple(one(n, a) for n, a in raw_init),
        containers=tuple(one(n, a) for n, a in raw_apps),
    )


@settings(max_examples=150, deadline=None)
@given(
    raw_init=raw_containers("init", 0),
    raw_apps=raw_containers("app", 1),
    mask=st.integers(0, 7),
    page=st.sampled_from([4096, P2M, P1G]),
    style=st.integers(0, 2),
    order=st.randoms(use_true_random=False),
)
def test_same_input_same_shape(
    raw_init: list[tuple[str, dict[str, int]]],
    raw_apps: list[tuple[str, dict[str, int]]],
    mask: int,
    page: int,
    style: int,
    order: object,
) -> None:
    """Re-spelling every quantity and reordering the app containers changes nothing."""
    profile = replace(PROFILE, page_size_bytes=page)
    sidecars = frozenset(name for i, (name, _) in enumerate(raw_init) if mask >> i & 1)
    shuffled = list(raw_apps)
    order.shuffle(shuffled)  # type: ignore[attr-defined]
    first = _outcome(build(raw_init, raw_apps, 0), profile, sidecars)
    again = _outcome(build(raw_init, shuffled, style), profile, sidecars)
    assert again == first
    if isinstance(first, str):  # refused, and for the same reason both times
        assert first.startswith("pod needs ") and first.endswith("allows at most 16")
        return
    # and the shape honours the profile and the pod
    d = first.demand
    assert profile.vcpu_min <= first.vcpus <= profile.vcpu_max
    assert first.vcpus * 1000 >= d.cpu_millis
    assert first.memory_bytes % first.backing_page_size == 0
    assert first.memory_bytes % MI == 0
    assert first.memory_bytes >= max(
        d.memory_bytes + sum(b for _, b in d.hugepages) + profile.memory_overhead_bytes, profile.memory_min_bytes
    )
    assert first.memory_bytes - first.backing_page_size < max(
        _round_mib(d.memory_bytes + sum(b for _, b in d.hugepages) + profile.memory_overhead_bytes),
        _round_mib(profile.memory_min_bytes),
    )


def _outcome(decl: PodDeclaration, profile: Profile, sidecars: frozenset[str]) -> VmShape | str:
    try:
        return shape_for(demand_from_declaration(decl, profile, sidecars=sidecars), profile)
    except CannotFit as exc:
        return str(exc)


def _round_mib(n: int) -> int:
    return -(-n // MI) * MI


@settings(max_examples=150, deadline=None)
@given(raw_init=raw_containers("init", 0), raw_apps=raw_containers("app", 1), mask=st.integers(0, 7))
def test_sidecars_lie_between_sequential_and_all_concurrent(
    raw_init: list[tuple[str, dict[str, int]]], raw_apps: list[tuple[str, dict[str, int]]], mask: int
) -> None:
    """Naming sidecars never shrinks a pod, never makes it larger than running every container at
    once, and making every init container a sidecar is exactly that sum."""
    decl = build(raw_init, raw_apps, 0)
    names = [n for n, _ in raw_init]
    some = frozenset(n for i, n in enumerate(names) if mask >> i & 1)
    low, mid, high = (demand_from_declaration(decl, PROFILE, sidecars=s) for s in (frozenset(), some, frozenset(names)))
    for a, b, c in zip(_amounts(low), _amounts(mid), _amounts(high), strict=True):
        assert a <= b <= c
    summed = demand_from_declaration(pod(*decl.init_containers, *decl.containers), PROFILE)
    assert (high.cpu_millis, high.memory_bytes, high.hugepages) == (
        summed.cpu_millis,
        summed.memory_bytes,
        summed.hugepages,
    )


def _amounts(d: PodDemand) -> tuple[int, int, int]:
    return d.cpu_millis, d.memory_bytes, d.hugepage_bytes(P2M)
