"""NRI's rules as vmsandbox applies them (vmsandbox.nri_rules): configuration, names, event masks, what
an adjustment does to a VM pod's container, and the divergence admission of its resources."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gen.nri import api_pb2 as api
from shim.nri import codec
from vmsandbox import admission, nri_rules
from vmsandbox.errors import Diverged, InvalidArgument
from vmsandbox.quantity import parse_quantity
from vmsandbox.resources import ContainerResources, ResourceList
from vmsandbox.sizing import LinuxResources, PodDemand

MI = 1 << 20


def _apply(target: nri_rules.Target, plugin: str, adj: api.ContainerAdjustment) -> nri_rules.Target:
    return nri_rules.apply_adjustment(target, plugin, codec.adjustment(adj))


def _res(cpu: str, memory: str) -> ContainerResources:
    rl = ResourceList.of({"cpu": parse_quantity(cpu), "memory": parse_quantity(memory)})
    return ContainerResources(requests=rl, limits=rl)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (None, nri_rules.NriConfig()),
        ({}, nri_rules.NriConfig()),
        ({"enable": True}, nri_rules.NriConfig(enable=True)),
        (
            {"enable": True, "socket_path": "/run/nri.sock", "plugin_path": "", "request_timeout_s": 0.5},
            nri_rules.NriConfig(enable=True, socket_path="/run/nri.sock", plugin_path="", request_timeout_s=0.5),
        ),
    ],
)
def test_config(data: object, expected: nri_rules.NriConfig) -> None:
    assert nri_rules.parse_config(data, "c.yaml") == expected


def test_config_defaults_are_containerds() -> None:
    c = nri_rules.NriConfig()
    assert (c.enable, c.socket_path, c.plugin_path, c.plugin_config_path) == (
        False,
        "/var/run/nri/nri.sock",
        "/opt/nri/plugins",
        "/etc/nri/conf.d",
    )
    assert (c.registration_timeout_s, c.request_timeout_s) == (5.0, 2.0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "nri: must be a mapping"),
        ({"enabled": True}, "nri.enabled: unknown key"),
        ({"enable": "yes"}, "nri.enable: must be true or false"),
        ({"socket_path": "nri.sock"}, "nri.socket_path: must be an absolute path"),
        ({"request_timeout_s": 0}, "nri.request_timeout_s: must be a number of seconds"),
        ({"registration_timeout_s": True}, "nri.registration_timeout_s: must be a number"),
    ],
)
def test_config_refusals(data: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        nri_rules.parse_config(data, "c.yaml")


@pytest.mark.parametrize(
    ("filename", "expected"),
    [
        ("10-logger", ("10", "logger")),
        ("05-device-injector", ("05", "device-injector")),
        ("logger", None),
        ("1-logger", None),
        ("ab-logger", None),
        ("10-", None),
        ("10-bad/name", None),
        ("10-bad name", None),
    ],
)
def test_plugin_files(filename: str, expected: tuple[str, str] | None) -> None:
    assert nri_rules.split_plugin_file(filename) == expected


@pytest.mark.parametrize(
    ("events", "expected"),
    [(0, nri_rules.VALID_EVENTS), (1, 1), (0x7FF, 0x7FF), (nri_rules.VALID_EVENTS, nri_rules.VALID_EVENTS)],
)
def test_event_masks(events: int, expected: int) -> None:
    assert nri_rules.event_mask(events) == expected


def test_event_mask_refuses_unknown_bits() -> None:
    with pytest.raises(InvalidArgument, match="invalid plugin events: 0x4000"):
        nri_rules.event_mask(1 << 14)
    assert (nri_rules.CREATE_CONTAINER, nri_rules.RUN_POD_SANDBOX, nri_rules.EVENT_LAST) == (
        api.CREATE_CONTAINER,
        api.RUN_POD_SANDBOX,
        api.LAST,
    )
    assert nri_rules.subscribed(1 << (api.CREATE_CONTAINER - 1), api.CREATE_CONTAINER)
    assert not nri_rules.subscribed(1 << (api.CREATE_CONTAINER - 1), api.RUN_POD_SANDBOX)


# -- adjustments ------------------------------------------------------------------------------
def _adjust(**kw: object) -> api.ContainerAdjustment:
    return api.ContainerAdjustment(**kw)  # type: ignore[arg-type]


START = nri_rules.Target(name="app", annotations={"a": "1"}, env=(("PATH", "/bin"), ("KEEP", "x")))


def test_env_annotations_args_rlimits() -> None:
    adj = _adjust(
        annotations={"b": "2", "-a": ""},
        env=[api.KeyValue(key="NEW", value="v"), api.KeyValue(key="-KEEP")],
        args=["/bin/sh", "-c", "true"],
        rlimits=[api.POSIXRlimit(type="RLIMIT_NOFILE", hard=2048, soft=1024)],
    )
    got = _apply(START, "10-p", adj)
    assert got.annotations == {"b": "2"}
    assert got.env == (("PATH", "/bin"), ("NEW", "v"))
    assert got.args == ("/bin/sh", "-c", "true")
    assert got.rlimits == (("RLIMIT_NOFILE", 2048, 1024),)
    assert got.owners["env NEW"] == "10-p"
    assert got.resource_plugins == ()


def test_mounts_are_binds_of_host_paths() -> None:
    adj = _adjust(mounts=[api.Mount(destination="/data", source="/srv/data", type="bind", options=["ro"])])
    assert _apply(START, "10-p", adj).mounts == (("/data", "/srv/data", True),)
    with pytest.raises(InvalidArgument, match="only bind mounts"):
        _apply(START, "10-p", _adjust(mounts=[api.Mount(destination="/t", type="tmpfs", source="t")]))


def test_two_plugins_may_not_own_one_field() -> None:
    first = _apply(START, "10-a", _adjust(env=[api.KeyValue(key="X", value="1")]))
    with pytest.raises(InvalidArgument, match='NRI plugins "10-a" and "20-b" both adjust env X of container "app"'):
        _apply(first, "20-b", _adjust(env=[api.KeyValue(key="X", value="2")]))


def _linux(**kw: object) -> api.ContainerAdjustment:
    adj = api.ContainerAdjustment()
    adj.linux.CopyFrom(api.LinuxContainerAdjustment(**kw))  # type: ignore[arg-type]
    return adj


@pytest.mark.parametrize(
    ("adj", "what"),
    [
        (_linux(devices=[api.LinuxDevice(path="/dev/fuse", type="c", major=10, minor=229)]), "devices"),
        (_adjust(CDI_devices=[api.CDIDevice(name="vendor.com/gpu=0")]), "CDI devices"),
        (_linux(resources=api.LinuxResources(cpu=api.LinuxCPU(cpus="2-3"))), "cpuset.cpus"),
        (_linux(resources=api.LinuxResources(memory=api.LinuxMemory(swap=api.OptionalInt64(value=1)))), "memory.swap"),
        (_linux(namespaces=[api.LinuxNamespace(type="network", path="/proc/1/ns/net")]), "namespaces"),
        (_linux(sysctl={"net.core.somaxconn": "1024"}), "sysctls"),
        (_linux(resources=api.LinuxResources(pids=api.LinuxPids(limit=10))), "the pids limit"),
        (_adjust(hooks=api.Hooks(prestart=[api.Hook(path="/bin/true")])), "OCI hooks"),
        (_linux(cgroups_path="/x"), "the cgroup path"),
    ],
)
def test_what_a_vm_pod_cannot_take_is_refused_naming_the_plugin(adj: api.ContainerAdjustment, what: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        _apply(START, "10-topology", adj)
    assert f'NRI plugin "10-topology" adjusts {what} of container "app"' in str(err.value)


def _mem(limit: int) -> api.ContainerAdjustment:
    return _linux(resources=api.LinuxResources(memory=api.LinuxMemory(limit=api.OptionalInt64(value=limit))))


def test_resources_are_applied_and_their_plugins_recorded() -> None:
    adj = _linux(
        resources=api.LinuxResources(
            cpu=api.LinuxCPU(quota=api.OptionalInt64(value=50000), period=api.OptionalUInt64(value=100000)),
            hugepage_limits=[api.HugepageLimit(page_size="2MB", limit=4 * MI)],
        )
    )
    got = _apply(START, "10-p", adj)
    assert (got.linux.cpu_quota, got.linux.cpu_period, got.linux.hugepage_limits) == (
        50000,
        100000,
        ((2 * MI, 4 * MI),),
    )
    assert got.resource_plugins == ("10-p",)


DECLARED = _res("250m", "32Mi")
BEFORE = admission.implied_linux(DECLARED)
DEMAND = PodDemand(cpu_millis=1000, memory_bytes=256 * MI)


def _fits(others: list[admission.Usage]) -> Callable[[admission.Usage, str], None]:
    return lambda usage, who: admission.check_envelope(DEMAND, others, usage, who=who)


@pytest.mark.parametrize(
    ("limit", "refused"),
    [
        (32 * MI, False),  # what was declared: no divergence
        (64 * MI, True),
        (1 << 30, True),
        (16 * MI, True),  # a declared pod admits exactly its declaration, as CreateContainer does
    ],
)
def test_declared_pod_divergence(limit: int, refused: bool) -> None:
    target = _apply(nri_rules.Target(name="app", linux=BEFORE), "20-grow", _mem(limit))
    if not refused:
        nri_rules.resource_divergence(target, BEFORE, DECLARED, _fits([]))
        return
    with pytest.raises(Diverged) as err:
        nri_rules.resource_divergence(target, BEFORE, DECLARED, _fits([]))
    assert str(err.value).startswith('NRI plugin "20-grow" adjusted resources that diverge from the pod\'s declaration')
    assert 'container "app": limits.memory declared 32Mi, requested' in str(err.value)


def test_undeclared_pod_must_stay_inside_the_vm() -> None:
    before = LinuxResources(memory_limit_bytes=64 * MI)
    others = [admission.Usage(memory_bytes=128 * MI)]
    fits = _apply(nri_rules.Target(name="app", linux=before), "20-grow", _mem(128 * MI))
    nri_rules.resource_divergence(fits, before, None, _fits(others))
    grows = _apply(nri_rules.Target(name="app", linux=before), "20-grow", _mem(256 * MI))
    with pytest.raises(Diverged, match=r'container "app" as NRI plugin "20-grow" adjusted it does not fit in the VM'):
        nri_rules.resource_divergence(grows, before, None, _fits(others))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 34))
def test_no_plugin_grows_a_declared_container(limit: int) -> None:
    """Whatever memory limit a plugin sets, the container ends within its declaration or is refused."""
    target = _apply(nri_rules.Target(name="app", linux=BEFORE), "20-p", _mem(limit))
    try:
        nri_rules.resource_divergence(target, BEFORE, DECLARED, _fits([]))
    except Diverged:
        return
    assert target.linux.memory_limit_bytes == 32 * MI


def test_nri_resources_round_trip_through_an_adjustment() -> None:
    lr = LinuxResources(cpu_period=100000, cpu_quota=25000, cpu_shares=256, memory_limit_bytes=32 * MI)
    adj = api.ContainerAdjustment()
    adj.linux.resources.CopyFrom(codec.resources(lr))
    assert _apply(nri_rules.Target(name="x"), "p", adj).linux == lr
