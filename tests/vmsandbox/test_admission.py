"""Tests of vmsandbox.admission: what "diverge" means (docs/sizing-and-admission.md, "Admission")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.admission import (
    Existing,
    Usage,
    admit_declared,
    attachment_differences,
    check_envelope,
    check_name,
    differences,
    implied_linux,
    linux_differences,
)
from vmsandbox.errors import AlreadyExists, Diverged
from vmsandbox.quantity import format_quantity
from vmsandbox.resources import (
    CdiDevice,
    ContainerDeclaration,
    ContainerResources,
    Device,
    Mount,
    PodDeclaration,
    ResourceList,
)
from vmsandbox.sizing import LinuxResources, PodDemand

MI, GI = 1024**2, 1024**3
P2M, P1G = 2 * MI, GI


def res(
    requests: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
    mounts: tuple[Mount, ...] = (),
    devices: tuple[Device, ...] = (),
    cdi: tuple[str, ...] = (),
) -> ContainerResources:
    return ContainerResources(
        requests=ResourceList.parse(requests or {}, where="requests"),
        limits=ResourceList.parse(limits or {}, where="limits"),
        mounts=frozenset(mounts),
        devices=frozenset(devices),
        cdi_devices=frozenset(CdiDevice(n) for n in cdi),
    )


DATA = Mount("/data", "/srv/data")
DATA_RO = Mount("/data", "/srv/data", readonly=True)
CACHE = Mount("/cache", "/var/cache/app")
FUSE = Device("/dev/fuse", "/dev/fuse", "rwm")
APP = res(
    {"cpu": "500m", "memory": "256Mi"},
    {"cpu": "1", "memory": "512Mi"},
    mounts=(DATA, CACHE),
    devices=(FUSE,),
    cdi=("vendor.com/gpu=0",),
)

DIFFERENCES = [
    pytest.param(APP, APP, [], id="identical"),
    pytest.param(
        APP,
        res(
            {"cpu": "0.5", "memory": "268435456"},
            {"cpu": "1000m", "memory": "0.5Gi"},
            mounts=(CACHE, DATA),
            devices=(FUSE,),
            cdi=("vendor.com/gpu=0",),
        ),
        [],
        id="same-after-canonicalisation",
    ),
    pytest.param(
        res(limits={"memory": "512Mi"}),
        res(limits={"memory": "1Gi"}),
        ['container "app": limits.memory declared 512Mi, requested 1Gi'],
        id="limit-differs",
    ),
    pytest.param(
        res(requests={"cpu": "500m"}),
        res(requests={"cpu": "501m"}),
        ['container "app": requests.cpu declared 500m, requested 501m'],
        id="request-differs-by-a-milli",
    ),
    pytest.param(
        res(requests={"cpu": "500m"}, limits={"cpu": "1"}),
        res(limits={"cpu": "1"}),
        ['container "app": requests.cpu declared 500m, requested nothing'],
        id="missing-key",
    ),
    pytest.param(
        res(limits={"cpu": "1"}),
        res(limits={"cpu": "1", "ephemeral-storage": "1Gi"}),
        ['container "app": limits.ephemeral-storage declared nothing, requested 1Gi'],
        id="extra-key",
    ),
    pytest.param(
        res(limits={"hugepages-2Mi": "0"}),
        res(),
        ['container "app": limits.hugepages-2Mi declared 0, requested nothing'],
        id="zero-is-not-absent",
    ),
    pytest.param(
        res({"memory": "1Gi", "cpu": "1"}, {"memory": "2Gi"}),
        res({"memory": "2Gi", "cpu": "2"}, {"memory": "1Gi"}),
        [
            'container "app": requests.cpu declared 1, requested 2',
            'container "app": requests.memory declared 1Gi, requested 2Gi',
            'container "app": limits.memory declared 2Gi, requested 1Gi',
        ],
        id="every-difference-requests-first-keys-sorted",
    ),
    pytest.param(
        res(mounts=(DATA,)),
        res(),
        ['container "app": mount /srv/data:/data:rw declared, not requested'],
        id="mount-missing",
    ),
    pytest.param(
        res(mounts=(DATA,)),
        res(mounts=(DATA_RO,)),
        [
            'container "app": mount /srv/data:/data:rw declared, not requested',
            'container "app": mount /srv/data:/data:ro requested, not declared',
        ],
        id="mount-mode-differs",
    ),
    pytest.param(
        res(),
        res(devices=(FUSE,)),
        ['container "app": device /dev/fuse:/dev/fuse:rwm requested, not declared'],
        id="device-extra",
    ),
    pytest.param(
        res(cdi=("vendor.com/gpu=0",)),
        res(cdi=("vendor.com/gpu=1",)),
        [
            'container "app": CDI device vendor.com/gpu=0 declared, not requested',
            'container "app": CDI device vendor.com/gpu=1 requested, not declared',
        ],
        id="cdi-differs",
    ),
]


@pytest.mark.parametrize(("declared", "requested", "expected"), DIFFERENCES)
def test_differences(declared: ContainerResources, requested: ContainerResources, expected: list[str]) -> None:
    assert differences("app", declared, requested) == expected


def test_attachment_differences_ignore_resources() -> None:
    assert (
        attachment_differences("app", APP, res(mounts=(DATA, CACHE), devices=(FUSE,), cdi=("vendor.com/gpu=0",))) == []
    )
    assert attachment_differences("app", APP, res()) == [
        'container "app": mount /var/cache/app:/cache:rw declared, not requested',
        'container "app": mount /srv/data:/data:rw declared, not requested',
        'container "app": device /dev/fuse:/dev/fuse:rwm declared, not requested',
        'container "app": CDI device vendor.com/gpu=0 declared, not requested',
    ]


# -- admit_declared / check_name --------------------------------------------------------------
POD = PodDeclaration(
    init_containers=(ContainerDeclaration("init", res(limits={"cpu": "2"})),),
    containers=(ContainerDeclaration("app", APP), ContainerDeclaration("sidecar", res())),
)
BIGGER = res(
    {"cpu": "500m", "memory": "256Mi"},
    {"cpu": "1", "memory": "1Gi"},
    mounts=(DATA, CACHE),
    devices=(FUSE,),
    cdi=("vendor.com/gpu=0",),
)


@pytest.mark.parametrize(
    ("name", "attempt", "requested", "existing"),
    [
        pytest.param("app", 0, APP, [], id="first-create"),
        pytest.param("init", 0, res(limits={"cpu": "2000m"}), [], id="init-container"),
        pytest.param("app", 1, APP, [Existing("app", 0)], id="retry-with-higher-attempt"),
        pytest.param("sidecar", 0, res(), [Existing("app", 0)], id="other-name-exists"),
    ],
)
def test_admit_declared_accepts(
    name: str, attempt: int, requested: ContainerResources, existing: list[Existing]
) -> None:
    admit_declared(POD, name, attempt, requested, existing)  # raises on refusal


@pytest.mark.parametrize(
    ("name", "attempt", "requested", "existing", "error", "message"),
    [
        pytest.param(
            "debug",
            0,
            APP,
            [],
            Diverged,
            "container \"debug\" was not declared at RunPodSandbox (declared: 'init', 'app', 'sidecar')",
            id="undeclared",
        ),
        pytest.param(
            "app",
            0,
            APP,
            [Existing("app", 0)],
            AlreadyExists,
            'container "app" (attempt 0) already exists in this sandbox; a retry must carry a higher attempt',
            id="same-attempt",
        ),
        pytest.param(
            "app",
            0,
            BIGGER,
            [],
            Diverged,
            "resources diverge from the pod's declaration: "
            'container "app": limits.memory declared 512Mi, requested 1Gi',
            id="grown-memory",
        ),
        pytest.param(
            "app",
            1,
            BIGGER,
            [Existing("app", 0)],
            Diverged,
            "resources diverge from the pod's declaration: "
            'container "app": limits.memory declared 512Mi, requested 1Gi',
            id="retry-must-be-identical",
        ),
        pytest.param(
            "sidecar",
            0,
            res(limits={"cpu": "1"}, cdi=("x.io/y=1",)),
            [],
            Diverged,
            "resources diverge from the pod's declaration: "
            'container "sidecar": limits.cpu declared nothing, requested 1; '
            'container "sidecar": CDI device x.io/y=1 requested, not declared',
            id="names-every-difference",
        ),
    ],
)
def test_admit_declared_rejects(
    name: str,
    attempt: int,
    requested: ContainerResources,
    existing: list[Existing],
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error) as exc:
        admit_declared(POD, name, attempt, requested, existing)
    assert type(exc.value) is error
    assert str(exc.value) == message


def test_check_name_alone() -> None:
    check_name(POD, "sidecar", 3, [Existing("sidecar", 2)])
    with pytest.raises(AlreadyExists):
        check_name(POD, "sidecar", 2, [Existing("sidecar", 2)])


# -- implied_linux: the kubelet's conventions ----------------------------------------------------
IMPLIED = [
    pytest.param(
        res({"cpu": "500m"}, {"cpu": "1", "memory": "512Mi"}),
        LinuxResources(cpu_period=100000, cpu_quota=100000, cpu_shares=512, memory_limit_bytes=512 * MI),
        id="request-and-limit",
    ),
    pytest.param(
        res(limits={"cpu": "250m"}),
        LinuxResources(cpu_period=100000, cpu_quota=25000, cpu_shares=256),
        id="request-defaults-to-limit",
    ),
    pytest.param(
        res({"cpu": "1.5"}, {"cpu": "1.5"}),
        LinuxResources(cpu_period=100000, cpu_quota=150000, cpu_shares=1536),
        id="fractional-cpus",
    ),
    pytest.param(res({"cpu": "1m"}), LinuxResources(cpu_shares=2), id="shares-floor-2"),
    pytest.param(res({"cpu": "3m"}), LinuxResources(cpu_shares=3), id="shares-3m"),
    pytest.param(res(), LinuxResources(cpu_shares=2), id="nothing"),
    pytest.param(
        res(limits={"cpu": "5m"}),
        LinuxResources(cpu_period=100000, cpu_quota=1000, cpu_shares=5),
        id="quota-floor-1000",
    ),
    pytest.param(res(limits={"cpu": "0"}), LinuxResources(cpu_shares=2), id="zero-limit-means-no-quota"),
    pytest.param(
        res(limits={"memory": "1Gi", "hugepages-2Mi": "4Mi", "hugepages-1Gi": "1Gi"}),
        LinuxResources(cpu_shares=2, memory_limit_bytes=GI, hugepage_limits=((P2M, 4 * MI), (P1G, GI))),
        id="memory-and-hugepages",
    ),
    pytest.param(res(limits={"hugepages-2Mi": "0"}), LinuxResources(cpu_shares=2), id="zero-hugepages-omitted"),
    pytest.param(res({"memory": "1Gi"}), LinuxResources(cpu_shares=2), id="memory-request-is-no-limit"),
]


@pytest.mark.parametrize(("resources", "expected"), IMPLIED)
def test_implied_linux(resources: ContainerResources, expected: LinuxResources) -> None:
    assert implied_linux(resources) == expected


DECL = res({"cpu": "500m", "memory": "256Mi"}, {"cpu": "500m", "memory": "512Mi", "hugepages-2Mi": "4Mi"})
KUBELET = LinuxResources(
    cpu_period=100000,
    cpu_quota=50000,
    cpu_shares=512,
    memory_limit_bytes=512 * MI,
    hugepage_limits=((P2M, 4 * MI), (P1G, 0)),
)

LINUX_DIFFS = [
    pytest.param(DECL, KUBELET, [], id="what-the-kubelet-sends"),
    pytest.param(
        DECL,
        LinuxResources(
            cpu_period=50000,
            cpu_quota=25000,
            cpu_shares=512,
            memory_limit_bytes=512 * MI,
            hugepage_limits=((P2M, 4 * MI),),
        ),
        [],
        id="custom-cfs-period",
    ),
    pytest.param(
        DECL,
        LinuxResources(
            cpu_period=100000, cpu_quota=50000, memory_limit_bytes=512 * MI, hugepage_limits=((P2M, 4 * MI),)
        ),
        [],
        id="shares-unset-ignored",
    ),
    pytest.param(
        res({"cpu": "1"}),
        LinuxResources(cpu_period=100000, cpu_quota=0, cpu_shares=1024),
        [],
        id="no-limit-period-without-quota",
    ),
    pytest.param(
        res({"cpu": "1"}),
        LinuxResources(cpu_period=100000, cpu_quota=-1, cpu_shares=1024),
        [],
        id="no-limit-unlimited-quota",
    ),
    pytest.param(
        DECL,
        LinuxResources(
            cpu_period=100000,
            cpu_quota=50000,
            cpu_shares=1024,
            memory_limit_bytes=512 * MI,
            hugepage_limits=((P2M, 4 * MI),),
        ),
        ['container "app": requests.cpu declared 500m (cpu shares 512), requested cpu shares 1024'],
        id="shares-differ",
    ),
    pytest.param(
        DECL,
        LinuxResources(
            cpu_period=100000,
            cpu_quota=100000,
            cpu_shares=512,
            memory_limit_bytes=512 * MI,
            hugepage_limits=((P2M, 4 * MI),),
        ),
        ['container "app": limits.cpu declared 500m, requested 1 (cpu quota 100000/100000)'],
        id="quota-differs",
    ),
    pytest.param(
        DECL,
        LinuxResources(
            cpu_period=30000,
            cpu_quota=10000,
            cpu_shares=512,
            memory_limit_bytes=512 * MI,
            hugepage_limits=((P2M, 4 * MI),),
        ),
        ['container "app": limits.cpu declared 500m, requested 334m (cpu quota 10000/30000)'],
        id="quota-not-a-decimal-fraction",
    ),
    pytest.param(
        res(limits={"cpu": "1"}),
        LinuxResources(cpu_period=100000, cpu_shares=1024),
        ['container "app": limits.cpu declared 1, requested nothing (cpu quota 0/100000)'],
        id="quota-missing",
    ),
    pytest.param(
        res({"cpu": "1"}),
        LinuxResources(cpu_period=100000, cpu_quota=50000, cpu_shares=1024),
        ['container "app": limits.cpu declared nothing, requested 500m (cpu quota 50000/100000)'],
        id="quota-undeclared",
    ),
    pytest.param(
        DECL,
        LinuxResources(
            cpu_period=100000, cpu_quota=50000, cpu_shares=512, memory_limit_bytes=GI, hugepage_limits=((P2M, 4 * MI),)
        ),
        ['container "app": limits.memory declared 512Mi, requested 1Gi'],
        id="memory-differs",
    ),
    pytest.param(
        DECL,
        LinuxResources(cpu_period=100000, cpu_quota=50000, cpu_shares=512, hugepage_limits=((P2M, 4 * MI),)),
        ['container "app": limits.memory declared 512Mi, requested nothing'],
        id="memory-missing",
    ),
    pytest.param(
        res(),
        LinuxResources(cpu_shares=2, memory_limit_bytes=256 * MI),
        ['container "app": limits.memory declared nothing, requested 256Mi'],
        id="memory-undeclared",
    ),
    pytest.param(
        DECL,
        LinuxResources(
            cpu_period=100000,
            cpu_quota=50000,
            cpu_shares=512,
            memory_limit_bytes=512 * MI,
            hugepage_limits=((P2M, 8 * MI), (P1G, GI)),
        ),
        [
            'container "app": limits.hugepages-2Mi declared 4Mi, requested 8Mi',
            'container "app": limits.hugepages-1Gi declared nothing, requested 1Gi',
        ],
        id="hugepages-differ",
    ),
    pytest.param(
        DECL,
        LinuxResources(cpu_period=100000, cpu_quota=50000, cpu_shares=512, memory_limit_bytes=512 * MI),
        ['container "app": limits.hugepages-2Mi declared 4Mi, requested nothing'],
        id="hugepages-missing",
    ),
]


@pytest.mark.parametrize(("declared", "requested", "expected"), LINUX_DIFFS)
def test_linux_differences(declared: ContainerResources, requested: LinuxResources, expected: list[str]) -> None:
    assert linux_differences("app", declared, requested) == expected


# -- check_envelope: pods sized without a declaration ------------------------------------------
VM = PodDemand(cpu_millis=2000, memory_bytes=GI, hugepages=((P2M, 64 * MI),), mode="linux-resources")


@pytest.mark.parametrize(
    ("others", "new"),
    [
        pytest.param([], Usage(), id="nothing"),
        pytest.param([Usage(500, 256 * MI)], Usage(1000, 512 * MI), id="within"),
        pytest.param(
            [Usage(1000, 512 * MI, ((P2M, 32 * MI),))], Usage(1000, 512 * MI, ((P2M, 32 * MI),)), id="exactly-full"
        ),
        pytest.param([Usage(2000, GI)], Usage(), id="unlimited-newcomer"),
    ],
)
def test_check_envelope_accepts(others: list[Usage], new: Usage) -> None:
    check_envelope(VM, others, new, who='container "app"')  # raises on refusal


@pytest.mark.parametrize(
    ("others", "new", "message"),
    [
        pytest.param(
            [Usage(1500, 0)],
            Usage(1000, 0),
            'container "app" does not fit in the VM, which cannot grow: '
            "cpu: 2500m in all > VM's 2 (it would have to grow by 500m)",
            id="cpu",
        ),
        pytest.param(
            [],
            Usage(0, GI + MI),
            'container "app" does not fit in the VM, which cannot grow: '
            "memory: 1025Mi in all > VM's 1Gi (it would have to grow by 1Mi)",
            id="memory",
        ),
        pytest.param(
            [Usage(hugepages=((P2M, 62 * MI),))],
            Usage(hugepages=((P2M, 4 * MI),)),
            'container "app" does not fit in the VM, which cannot grow: '
            "hugepages-2Mi: 66Mi in all > VM's 64Mi (it would have to grow by 2Mi)",
            id="hugepages-2Mi",
        ),
        pytest.param(
            [],
            Usage(hugepages=((P1G, GI),)),
            'container "app" does not fit in the VM, which cannot grow: '
            "hugepages-1Gi: 1Gi in all > VM's nothing (it would have to grow by 1Gi)",
            id="hugepages-1Gi",
        ),
        pytest.param(
            [Usage(1999, GI - 1)],
            Usage(2, 2),
            'container "app" does not fit in the VM, which cannot grow: '
            "cpu: 2001m in all > VM's 2 (it would have to grow by 1m); "
            "memory: 1073741825 in all > VM's 1Gi (it would have to grow by 1)",
            id="cpu-and-memory",
        ),
        pytest.param(
            [Usage(2000, GI)],
            Usage(2001, 0),
            'container "app" does not fit in the VM, which cannot grow: '
            "cpu: 2001m in all > VM's 2 (it would have to grow by 1m)",
            id="more-than-the-pod-it-shares",
        ),
    ],
)
def test_check_envelope_rejects_growth(others: list[Usage], new: Usage, message: str) -> None:
    with pytest.raises(Diverged) as exc:
        check_envelope(VM, others, new, who='container "app"')
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("others", "new", "fits_kubelet_model", "fits_declared"),
    [
        # KEP-2837: two containers without limits of their own, each given the pod-level limit
        pytest.param([Usage(2000, GI)], Usage(2000, GI), True, False, id="both-inherit"),
        # one with its own limits beside one that inherits the pod's
        pytest.param([Usage(2000, GI)], Usage(500, 256 * MI), True, False, id="own-beside-inherited"),
        pytest.param([Usage(500, 256 * MI)], Usage(2000, GI), True, False, id="inherited-beside-own"),
        # those with limits of their own still add up, whoever shares
        pytest.param(
            [Usage(2000, GI), Usage(1500, 512 * MI)], Usage(1000, 512 * MI), False, False, id="own-ones-overflow"
        ),
        # only the pod's own figure is shared, per resource
        pytest.param([Usage(2000, 512 * MI)], Usage(2000, 768 * MI), False, False, id="memory-of-their-own"),
        pytest.param(
            [Usage(hugepages=((P2M, 64 * MI),))], Usage(hugepages=((P2M, 64 * MI),)), True, False, id="hugepages"
        ),
    ],
)
def test_the_pod_level_limit_is_shared_in_a_pod_sized_from_what_the_kubelet_sends(
    others: list[Usage], new: Usage, fits_kubelet_model: bool, fits_declared: bool
) -> None:
    """Sized from LinuxPodSandboxConfig, a container whose limit equals the pod's shares it (the
    kubelet hands the pod-level limit to a container without its own); a declared pod sums them."""
    for demand, fits in ((VM, fits_kubelet_model), (replace(VM, mode="declared"), fits_declared)):
        if fits:
            check_envelope(demand, others, new, who='container "app"')
        else:
            with pytest.raises(Diverged, match="does not fit in the VM"):
                check_envelope(demand, others, new, who='container "app"')


@pytest.mark.parametrize(
    ("linux", "usage"),
    [
        pytest.param(
            LinuxResources(
                cpu_period=100000, cpu_quota=150000, memory_limit_bytes=GI, hugepage_limits=((P2M, 4 * MI),)
            ),
            Usage(1500, GI, ((P2M, 4 * MI),)),
            id="limits",
        ),
        pytest.param(LinuxResources(cpu_period=100000, cpu_quota=-1, cpu_shares=1024), Usage(), id="unlimited"),
    ],
)
def test_usage_of_linux(linux: LinuxResources, usage: Usage) -> None:
    assert Usage.of_linux(linux) == usage


def test_usage_of_resources_follows_the_kubelet() -> None:
    assert Usage.of_resources(res({"cpu": "100m"}, {"cpu": "250m", "memory": "64Mi"})) == Usage(250, 64 * MI)
    assert Usage.of_resources(res({"cpu": "100m", "memory": "64Mi"})) == Usage()


# -- property: accept iff identical ---------------------------------------------------------------
VALUES = {
    "cpu": [Fraction(0), Fraction(1, 10), Fraction(1, 2), Fraction(1), Fraction(3, 2)],
    "memory": [Fraction(0), Fraction(MI), Fraction(64 * MI), Fraction(GI), Fraction(1000)],
    "hugepages-2Mi": [Fraction(0), Fraction(2 * MI), Fraction(4 * MI)],
}


def spellings(value: Fraction) -> list[str]:
    """Different strings for the same quantity."""
    out = [format_quantity(value, "DecimalSI"), f"{value * 1000}m" if (value * 1000).denominator == 1 else ""]
    if value.denominator == 1:
        out.append(str(value.numerator))
        out.append(f"{value.numerator}e0")
        if value.numerator % 1024 == 0:
            out.append(f"{value.numerator // 1024}Ki")
    return [s for s in out if s]


@st.composite
def resource_lists(draw: st.DrawFn) -> dict[str, Fraction]:
    names = draw(st.sets(st.sampled_from(sorted(VALUES))))
    return {n: draw(st.sampled_from(VALUES[n])) for n in names}


@st.composite
def container_resources(
    draw: st.DrawFn,
) -> tuple[dict[str, Fraction], dict[str, Fraction], frozenset[Mount], frozenset[Device], frozenset[str]]:
    return (
        draw(resource_lists()),
        draw(resource_lists()),
        draw(st.frozensets(st.sampled_from([DATA, DATA_RO, CACHE]))),
        draw(st.frozensets(st.sampled_from([FUSE, Device("/dev/net/tun", "/dev/net/tun", "rw")]))),
        draw(st.frozensets(st.sampled_from(["vendor.com/gpu=0", "vendor.com/gpu=1"]))),
    )


def spelled(draw: Callable[[st.SearchStrategy[str]], str], values: dict[str, Fraction]) -> ResourceList:
    return ResourceList.parse({k: draw(st.sampled_from(spellings(v))) for k, v in values.items()}, where="x")


@settings(max_examples=150, deadline=None)
@given(data=st.data(), a=container_resources(), b=container_resources(), same=st.booleans())
def test_accept_iff_identical(
    data: st.DataObject,
    a: tuple[dict[str, Fraction], dict[str, Fraction], frozenset[Mount], frozenset[Device], frozenset[str]],
    b: tuple[dict[str, Fraction], dict[str, Fraction], frozenset[Mount], frozenset[Device], frozenset[str]],
    same: bool,
) -> None:
    if same:
        b = a  # the same declaration, spelled differently below
    declared = ContainerResources(
        spelled(data.draw, a[0]), spelled(data.draw, a[1]), a[2], a[3], frozenset(CdiDevice(n) for n in a[4])
    )
    requested = ContainerResources(
        spelled(data.draw, b[0]), spelled(data.draw, b[1]), b[2], b[3], frozenset(CdiDevice(n) for n in b[4])
    )
    diffs = differences("c", declared, requested)
    assert (diffs == []) == (a == b)
    expected_count = (
        sum(1 for k in a[0].keys() | b[0].keys() if a[0].get(k) != b[0].get(k))
        + sum(1 for k in a[1].keys() | b[1].keys() if a[1].get(k) != b[1].get(k))
        + len(a[2] ^ b[2])
        + len(a[3] ^ b[3])
        + len(a[4] ^ b[4])
    )
    assert len(diffs) == expected_count
    pod = PodDeclaration(containers=(ContainerDeclaration("c", declared),))
    if a == b:
        admit_declared(pod, "c", 0, requested, [])
    else:
        with pytest.raises(Diverged):
            admit_declared(pod, "c", 0, requested, [])
