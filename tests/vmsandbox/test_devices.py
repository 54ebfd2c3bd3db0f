"""Tests of vmsandbox.devices: pool selectors, IOMMU group closure on the VFIO fixture host, and the
resolution of a pod's extended resources, devices and CDI devices to groups of configured pools."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import yaml

from shim.config import ShimConfig
from shim.model import PodMeta, RunPodSandbox, SandboxSpec
from shim.rpc.run_pod_sandbox import run_pod_sandbox
from shim.sandboxes import Sandboxes
from tests.cri_server import pods_for
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.cdi import build_registry
from vmsandbox.devices import (
    DeviceGroup,
    DevicePools,
    DeviceRequest,
    parse_pool_config,
    parse_selector,
    request_devices,
    resolve_pools,
    vfio_group,
)
from vmsandbox.domain_xml import read_hostdevs
from vmsandbox.errors import CannotFit, InfrastructureError, InvalidArgument
from vmsandbox.host import HostInventory, PciFunction
from vmsandbox.profile import Profile
from vmsandbox.resources import (
    CdiDevice,
    ContainerDeclaration,
    ContainerResources,
    Device,
    PodDeclaration,
    ResourceList,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "sysfs"
VFIO = read_inventory(FIXTURES / "vfio-two-node" / "sys", FIXTURES / "vfio-two-node" / "proc")
CONFIG = {
    "gpu": ("10de:2330", "10de:22a3"),
    "nic": ("0000:86:00.0",),
    "accel": ("8086:0b25",),
    "hostnic": ("5e:00.0", "5e:00.1"),
    "ghost": ("0000:99:00.0",),
}
POOLS = resolve_pools(CONFIG, VFIO)


def f(address: str) -> PciFunction:
    found = VFIO.pci_function(address)
    assert found is not None
    return found


# -- selectors and the configuration -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        pytest.param("10DE:2330", ("ids", "10de:2330"), id="ids"),
        pytest.param("3b:00.0", ("address", "0000:3b:00.0"), id="short-address"),
        pytest.param("0000:af:00.1", ("address", "0000:af:00.1"), id="address"),
    ],
)
def test_parse_selector(text: str, parsed: tuple[str, str]) -> None:
    assert parse_selector(text) == parsed


@pytest.mark.parametrize("text", ["10de", "10de:23300", "gpu", "3b:00", ""])
def test_parse_selector_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="neither a PCI address"):
        parse_selector(text)


def test_parse_pool_config() -> None:
    assert parse_pool_config({"gpu": ["10DE:2330", "3b:00.1", "10de:2330"], "a.b-c_1": ["86:00.0"]}) == {
        "gpu": ("10de:2330", "0000:3b:00.1"),
        "a.b-c_1": ("0000:86:00.0",),
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(["gpu"], "must map pool names to lists of PCI addresses or vendor:device ids", id="list"),
        pytest.param({"GPU": ["10de:2330"]}, "'GPU': a pool name is lower-case", id="upper-case-name"),
        pytest.param({"gpu": []}, "gpu: must be a non-empty list", id="empty"),
        pytest.param({"gpu": "10de:2330"}, "gpu: must be a non-empty list", id="not-a-list"),
        pytest.param({"gpu": [1]}, "gpu: 1 is not a string", id="not-a-string"),
        pytest.param({"gpu": ["/dev/vfio/12"]}, "gpu: '/dev/vfio/12' is neither a PCI address", id="path"),
    ],
)
def test_parse_pool_config_rejects(data: object, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_pool_config(data)
    assert str(exc.value).startswith(message)


# -- IOMMU group closure ------------------------------------------------------------------------------------
def test_pools_of_the_vfio_host() -> None:
    assert POOLS.pools == {
        "accel": (DeviceGroup(7, "accel", -1, (f("0000:17:00.0"),)),),
        "ghost": (),
        "gpu": (
            DeviceGroup(12, "gpu", 0, (f("0000:3b:00.0"), f("0000:3b:00.1"))),
            DeviceGroup(40, "gpu", 1, (f("0000:af:00.0"), f("0000:af:00.1"))),
            DeviceGroup(41, "gpu", 1, (f("0000:d8:00.0"),)),  # the bridge 0000:d7:00.0 stays with the host
        ),
        # the admin's choice: the host NIC's whole group (both ports) is in a pool
        "hostnic": (DeviceGroup(20, "hostnic", 0, (f("0000:5e:00.0"), f("0000:5e:00.1"))),),
        "nic": (),
    }
    assert POOLS.problems == (
        "device_pools.ghost: 0000:99:00.0 matches no PCI function on this host",
        "device_pools.nic: IOMMU group 30 also holds 0000:86:00.1 (8086:1592, driver ice), which no pool selects; "
        "a group is passed through whole, so it is left out",
    )
    assert POOLS.host_groups == frozenset({0, 7, 12, 20, 30, 40, 41})
    assert POOLS.by_address["0000:3b:00.1"].group == 12
    group = POOLS.group(12)
    assert group is not None
    assert group.addresses == ("0000:3b:00.0", "0000:3b:00.1")
    assert group.describe() == "IOMMU group 12 (0000:3b:00.0 10de:2330 + 1 more, pool gpu, node 0)"
    assert POOLS.pools["accel"][0].describe() == "IOMMU group 7 (0000:17:00.0 8086:0b25, pool accel, no NUMA node)"


@pytest.mark.parametrize(
    ("config", "groups", "problem"),
    [
        pytest.param(
            {"a": ("0000:3b:00.0",), "b": ("0000:3b:00.1",)},
            {"a": (), "b": ()},
            "IOMMU group 12 has functions in pools a, b: a group is passed through whole, to one pool only; it is "
            "left out",
            id="group-split-over-pools",
        ),
        pytest.param(
            {"a": ("0000:3b:00.0", "0000:3b:00.1"), "b": ("10de:22a3", "0000:af:00.0")},
            {"a": (), "b": (40,)},
            "IOMMU group 12 has functions in pools a, b: a group is passed through whole, to one pool only; it is "
            "left out",
            id="function-in-two-pools",
        ),
        pytest.param(
            {"gpu": ("0000:3b:00.0",)},
            {"gpu": ()},
            "device_pools.gpu: IOMMU group 12 also holds 0000:3b:00.1 (10de:22a3, driver vfio-pci), which no pool "
            "selects; a group is passed through whole, so it is left out",
            id="half-a-group",
        ),
        pytest.param(
            {"br": ("0000:d7:00.0",)},
            {"br": ()},
            "device_pools.br: IOMMU group 41 also holds 0000:d8:00.0 (10de:2330, driver vfio-pci), which no pool "
            "selects; a group is passed through whole, so it is left out",
            id="bridge-with-a-device-behind-it",
        ),
    ],
)
def test_group_closure_refusals(
    config: dict[str, tuple[str, ...]], groups: dict[str, tuple[int, ...]], problem: str
) -> None:
    pools = resolve_pools(config, VFIO)
    assert {name: tuple(g.group for g in gs) for name, gs in pools.pools.items()} == groups
    assert problem in pools.problems


def test_without_iommu_nothing_can_be_passed() -> None:
    inv = HostInventory(cpus=VFIO.cpus, pci=(PciFunction("0000:00:02.0", "1af4", "1042", -1, None, "virtio-pci"),))
    pools = resolve_pools({"disk": ("1af4:1042",)}, inv)
    assert pools.pools == {"disk": ()}
    assert pools.problems == (
        "device_pools.disk: 0000:00:02.0 (1af4:1042, driver virtio-pci) has no IOMMU group (is the IOMMU on? "
        "intel_iommu=on or amd_iommu=on): it cannot be passed through",
    )


def test_a_group_of_bridges_only() -> None:
    inv = HostInventory(cpus=VFIO.cpus, pci=(PciFunction("0000:00:1c.0", "8086", "a110", 0, 3, "pcieport", "060400"),))
    pools = resolve_pools({"br": ("8086:a110",)}, inv)
    assert pools.pools == {"br": ()}
    assert pools.problems == ("device_pools.br: IOMMU group 3 holds only PCI bridges; left out",)


# -- what a pod asks for ------------------------------------------------------------------------------------


def cdi_device(name: str, *paths: str) -> dict[str, object]:
    return {"name": name, "containerEdits": {"deviceNodes": [{"path": p} for p in paths]}}


CDI = build_registry(
    [
        (
            0,
            "/etc/cdi/gpu.yaml",
            {
                "cdiVersion": "0.6.0",
                "kind": "example.com/gpu",
                "devices": [
                    cdi_device("af", "/dev/vfio/40"),
                    cdi_device("both", "/dev/vfio/12", "/dev/vfio/41"),
                    cdi_device("render", "/dev/dri/renderD128"),
                    cdi_device("nic", "/dev/vfio/30"),
                ],
                "containerEdits": {"deviceNodes": [{"path": "/dev/vfio/vfio"}]},
            },
        ),
    ],
    ["/etc/cdi", "/var/run/cdi"],
)
MAPPING = {"nvidia.com/gpu": "gpu", "example.com/nic": "nic", "example.com/fpga": "fpga"}


def container(
    name: str,
    limits: dict[str, str] | None = None,
    devices: tuple[str, ...] = (),
    cdi: tuple[str, ...] = (),
) -> ContainerDeclaration:
    return ContainerDeclaration(
        name,
        ContainerResources(
            limits=ResourceList.parse(limits or {}, where=name),
            devices=frozenset(Device("/dev/x" + p, p) for p in devices),
            cdi_devices=frozenset(CdiDevice(c) for c in cdi),
        ),
    )


def request(*containers: ContainerDeclaration, extended: tuple[tuple[str, int], ...] = ()) -> DeviceRequest:
    return request_devices(PodDeclaration(containers=containers), extended, MAPPING, "gpu-profile", POOLS, CDI)


REQUESTS = [
    pytest.param(request(container("app")), DeviceRequest(), id="nothing"),
    pytest.param(
        request(container("app", {"nvidia.com/gpu": "2"}), extended=(("nvidia.com/gpu", 2),)),
        DeviceRequest(counts=(("gpu", 2),)),
        id="extended-resource",
    ),
    pytest.param(request(container("app", devices=("/dev/vfio/12",))), DeviceRequest(named=(12,)), id="vfio-device"),
    pytest.param(
        request(container("app", devices=("/dev/vfio/vfio", "/dev/vfio/40"))),
        DeviceRequest(named=(40,)),
        id="vfio-container-node-ignored",
    ),
    pytest.param(request(container("app", cdi=("example.com/gpu=af",))), DeviceRequest(named=(40,)), id="cdi-device"),
    pytest.param(
        request(container("app", cdi=("example.com/gpu=both",)), container("side", devices=("/dev/vfio/12",))),
        DeviceRequest(named=(12, 41)),
        id="cdi-two-groups-and-a-shared-one",
    ),
    # a device plugin's allocation arrives as the extended resource *and* its device: counted once
    pytest.param(
        request(
            container("app", {"nvidia.com/gpu": "2"}, cdi=("example.com/gpu=af",)), extended=(("nvidia.com/gpu", 2),)
        ),
        DeviceRequest(named=(40,), counts=(("gpu", 1),)),
        id="named-groups-count-towards-the-resource",
    ),
    pytest.param(
        request(container("app", {"nvidia.com/gpu": "1"}, devices=("/dev/vfio/7",)), extended=(("nvidia.com/gpu", 1),)),
        DeviceRequest(named=(7,), counts=(("gpu", 1),)),
        id="named-group-of-another-pool",
    ),
]


@pytest.mark.parametrize(("got", "want"), REQUESTS)
def test_request_devices(got: DeviceRequest, want: DeviceRequest) -> None:
    assert got == want
    assert got.empty == (want == DeviceRequest())


REFUSALS = [
    pytest.param(
        container("app", {"example.com/gpu": "1"}),
        "container \"app\": extended resource example.com/gpu is not mapped to a device pool by profile 'gpu-profile'",
        id="unmapped-extended-resource",
    ),
    pytest.param(
        container("app", {"example.com/fpga": "1"}),
        "container \"app\": extended resource example.com/fpga maps to device pool 'fpga', which is not configured "
        "on this node (device_pools: accel, ghost, gpu, hostnic, nic)",
        id="pool-not-configured",
    ),
    pytest.param(
        container("app", devices=("/dev/fuse",)),
        'container "app": device /dev/fuse cannot be passed into a VM: only VFIO groups (/dev/vfio/<group>) of a '
        "configured device pool can",
        id="not-a-vfio-device",
    ),
    pytest.param(
        container("app", devices=("/dev/vfio/30",)),
        'container "app": device /dev/vfio/30: IOMMU group 30 is not in a configured device pool '
        "(device_pools: accel, ghost, gpu, hostnic, nic)",
        id="group-not-in-a-pool",
    ),
    pytest.param(
        container("app", devices=("/dev/vfio/99",)),
        'container "app": device /dev/vfio/99: IOMMU group 99 is not in a configured device pool (this host has no '
        "IOMMU group 99) (device_pools: accel, ghost, gpu, hostnic, nic)",
        id="no-such-group",
    ),
    pytest.param(
        container("app", cdi=("example.com/gpu=missing",)),
        'container "app": CDI device "example.com/gpu=missing" is not defined by any CDI spec '
        "(searched /etc/cdi, /var/run/cdi)",
        id="unknown-cdi-device",
    ),
    pytest.param(
        container("app", cdi=("gpu0",)),
        "container \"app\": CDI device: 'gpu0' is not a qualified CDI device name (vendor.com/class=name)",
        id="unqualified-cdi-name",
    ),
    pytest.param(
        container("app", cdi=("example.com/gpu=render",)),
        'container "app": CDI device "example.com/gpu=render" (/etc/cdi/gpu.yaml) has no VFIO group node '
        "(/dev/vfio/<group>); only VFIO devices can be passed into a VM",
        id="cdi-device-without-vfio",
    ),
    pytest.param(
        container("app", cdi=("example.com/gpu=nic",)),
        'container "app": CDI device "example.com/gpu=nic": IOMMU group 30 is not in a configured device pool '
        "(device_pools: accel, ghost, gpu, hostnic, nic)",
        id="cdi-group-not-in-a-pool",
    ),
]


@pytest.mark.parametrize(("decl", "message"), REFUSALS)
def test_request_devices_refusals(decl: ContainerDeclaration, message: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        request(container("ok"), decl)
    assert str(exc.value) == message


def test_cdi_devices_without_a_registry() -> None:
    decl = PodDeclaration(containers=(container("app", cdi=("example.com/gpu=af",)),))
    with pytest.raises(InvalidArgument, match="is not defined by any CDI spec \\(searched no CDI spec directories\\)"):
        request_devices(decl, (), {}, "p", DevicePools(), None)


@pytest.mark.parametrize(
    ("path", "group"),
    [("/dev/vfio/12", 12), ("/dev/vfio/vfio", None), ("/dev/vfio/", None), ("/dev/vfio12", None), ("/dev/x", None)],
)
def test_vfio_group(path: str, group: int | None) -> None:
    assert vfio_group(path) == group


# -- RunPodSandbox with passthrough, through the shim's Sandboxes (no guest: start fails on purpose) ---------
class RecordingHypervisor:
    """Checks each domain with libvirt's test driver (never a real host device), then refuses to start it."""

    uri = "test:///default"

    def __init__(self) -> None:
        self.defined: list[str] = []

    def daemon_pid(self) -> int | None:
        return None  # no daemon: guests see this process's mounts

    def define(self, xml: str) -> None:
        libvirt = pytest.importorskip("libvirt")
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        conn = libvirt.open("test:///default")
        try:
            conn.defineXMLFlags(xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE).undefine()
        finally:
            conn.close()
        self.defined.append(xml)

    def start(self, name: str) -> None:
        raise InfrastructureError(f"{name}: unit tests start no guest")

    def teardown(self, name: str) -> bool:
        return True


@pytest.fixture
def gpu_shim(tmp_path: Path) -> Iterator[tuple[Sandboxes, RecordingHypervisor]]:
    images = tmp_path / "image"
    images.mkdir()
    for name in ("vmlinux", "initramfs.img"):
        (images / name).write_text("")
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    (cdi_dir / "gpu.yaml").write_text(
        yaml.safe_dump(
            {"cdiVersion": "0.6.0", "kind": "example.com/gpu", "devices": [cdi_device("af", "/dev/vfio/40")]}
        )
    )
    config = ShimConfig(
        state_dir=str(tmp_path),
        console_dir="",
        shared_cpus=(3, 7),
        device_pools={"gpu": CONFIG["gpu"], "nic": CONFIG["nic"]},
        cdi_spec_dirs=(str(cdi_dir),),
        packing="best-fit",  # the tables below follow the tightest node first
        pod_network="none",
    )
    profile = Profile(
        name="gpu", handler="vmsandbox", image_dir=str(images), accel="kvm", extended_resources=dict(MAPPING)
    )
    ledger = Ledger(tmp_path / "state.db")
    hypervisor = RecordingHypervisor()
    sb = Sandboxes(
        config,
        ledger,
        cast(Hypervisor, hypervisor),
        {"vmsandbox": profile},
        inventory=lambda: VFIO,
    )
    try:
        yield sb, hypervisor
    finally:
        ledger.close()


def pod_spec(*containers: ContainerDeclaration) -> SandboxSpec:
    return SandboxSpec(meta=PodMeta("train", "ml", "uid-1"), declaration=PodDeclaration(containers=containers))


def run(sb: Sandboxes, spec: SandboxSpec) -> str:
    return run_pod_sandbox(pods_for(sb), RunPodSandbox(spec))


@pytest.mark.parametrize(
    ("decl", "hostdevs"),
    [
        pytest.param(
            container("app", {"cpu": "1", "memory": "64Mi", "nvidia.com/gpu": "1"}),
            ("0000:3b:00.0", "0000:3b:00.1"),
            id="extended-resource",
        ),
        pytest.param(
            container("app", {"cpu": "1", "memory": "64Mi"}, devices=("/dev/vfio/41",)),
            ("0000:d8:00.0",),
            id="vfio-group",
        ),
        pytest.param(
            container("app", {"cpu": "1", "memory": "64Mi"}, cdi=("example.com/gpu=af",)),
            ("0000:af:00.0", "0000:af:00.1"),
            id="cdi-device",
        ),
    ],
)
def test_run_pod_sandbox_passes_whole_groups_and_rolls_back(
    gpu_shim: tuple[Sandboxes, RecordingHypervisor], decl: ContainerDeclaration, hostdevs: tuple[str, ...]
) -> None:
    sb, hypervisor = gpu_shim
    with pytest.raises(InfrastructureError, match=r"unit tests start no guest .*rolled back"):
        run(sb, pod_spec(decl))
    [xml] = hypervisor.defined
    assert read_hostdevs(xml) == hostdevs
    assert sb.ledger.held() == {}  # the rollback released CPUs, pages and PCI functions
    assert sb.resources.owners() == frozenset() and all(u.held == 0 for u in sb.resources.usage())


def test_claims_hold_pci_functions_until_the_pool_is_exhausted(gpu_shim: tuple[Sandboxes, RecordingHypervisor]) -> None:
    sb, _ = gpu_shim
    profile = sb.profiles["vmsandbox"]
    one_gpu = pod_spec(container("app", {"cpu": "1", "memory": "64Mi", "nvidia.com/gpu": "1"}))
    plan = sb.plan(one_gpu)
    shape, devices = plan.shape, plan.devices
    got = [sb.resources.reserve(f"s{i}", shape, profile, devices).hostdevs for i in range(3)]
    assert got == [("0000:3b:00.0", "0000:3b:00.1"), ("0000:af:00.0", "0000:af:00.1"), ("0000:d8:00.0",)]
    assert {a for c in sb.ledger.held().values() for a in c.pci} == {a for g in got for a in g}
    with pytest.raises(CannotFit) as exc:
        sb.resources.reserve("s3", shape, profile, devices)
    assert str(exc.value) == (
        "cannot place the VM: device pool gpu on node 0: need 1 IOMMU groups, free 0 (short by 1); "
        # node 1's exclusive CPUs are 2 and 6 (3 and 7 are the shared pool): both held now
        "cpu on node 1: need 1, free 0 (short by 1); "
        "device pool gpu on node 1: need 1 IOMMU groups, free 0 (short by 1)"
    )
    sb.resources.release("s1")
    assert sb.resources.reserve("s4", shape, profile, devices).hostdevs == ("0000:af:00.0", "0000:af:00.1")


def test_unconfigured_groups_are_refused_before_anything_is_claimed(
    gpu_shim: tuple[Sandboxes, RecordingHypervisor],
) -> None:
    sb, hypervisor = gpu_shim
    with pytest.raises(InvalidArgument, match=r'container "app": device /dev/vfio/20: IOMMU group 20 is not in a'):
        run(sb, pod_spec(container("app", devices=("/dev/vfio/20",))))
    with pytest.raises(InvalidArgument, match=r'CDI device "example.com/gpu=0" is not defined by any CDI spec'):
        run(sb, pod_spec(container("app", cdi=("example.com/gpu=0",))))
    assert hypervisor.defined == [] and sb.ledger.held() == {}
