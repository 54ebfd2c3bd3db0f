"""Rules of issue 3 that the core-module tests do not cover: profile choice by annotation, the CRI
translation of bad quantities, mixed 2Mi + 1Gi pods, ContainerStatus.resources, the shim's
envelope bookkeeping (retries, init containers, updates recorded), and "accept iff identical"
as a property, including the canonical-form fast paths admission takes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gen.cri.apimachinery.resource.generated_pb2 import Quantity as PbQuantity
from gen.cri.runtime.v1 import api_pb2 as pb
from shim.config import ShimConfig
from shim.container_admission import ContainerAdmission
from shim.model import (
    CONTAINER_CREATED,
    CONTAINER_EXITED,
    CONTAINER_RUNNING,
    SANDBOX_READY,
    ContainerRecord,
    ContainerSpec,
    PodMeta,
    RemovePodSandbox,
    SandboxRecord,
    UpdatePodSandboxResources,
)
from shim.rpc.remove_pod_sandbox import remove_pod_sandbox
from shim.rpc.update_pod_sandbox_resources import update_pod_sandbox_resources
from shim.sandboxes import Sandboxes
from shim.translate import inbound, outbound
from tests.cri_server import pods_for
from vmsandbox.adapters.hypervisor import Hypervisor
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.adapters.profile_loader import load_profiles
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.admission import Existing, admit_declared, differences
from vmsandbox.domain import SandboxIdentity, build_domain
from vmsandbox.domain_xml import render
from vmsandbox.errors import AlreadyExists, CannotFit, Diverged, InvalidArgument
from vmsandbox.host_pools import HugepageBudget
from vmsandbox.placement import place
from vmsandbox.profile import PROFILE_ANNOTATION, Profile, ProfileError, profile_from_mapping, select_profile
from vmsandbox.quantity import Quantity, parse_quantity
from vmsandbox.resources import (
    CdiDevice,
    ContainerDeclaration,
    ContainerResources,
    Device,
    Mount,
    PodDeclaration,
    ResourceList,
)
from vmsandbox.sizing import LinuxResources, demand_from_declaration, shape_for, sidecars_from_annotations

MI, GI = 1 << 20, 1 << 30
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


# -- profile choice by annotation -------------------------------------------------------------------
BASE = Profile(name="vmsandbox", handler="vmsandbox", allowed_profiles=("small", "ghost"))
SMALL = Profile(name="small", handler="small-vm", vcpu_max=1)
OTHER = Profile(name="other", handler="other")
BY_HANDLER = {p.handler: p for p in (BASE, SMALL, OTHER)}
BY_NAME = {p.name: p for p in (BASE, SMALL, OTHER)}


@pytest.mark.parametrize(
    ("handler", "annotations", "chosen"),
    [
        pytest.param("vmsandbox", {}, "vmsandbox", id="handler-profile"),
        pytest.param("vmsandbox", {PROFILE_ANNOTATION: "small"}, "small", id="allowed-choice"),
        pytest.param("vmsandbox", {PROFILE_ANNOTATION: "vmsandbox"}, "vmsandbox", id="own-name"),
        pytest.param("small-vm", {}, "small", id="other-handler"),
        pytest.param("vmsandbox", {"io.vmsandbox/other": "other"}, "vmsandbox", id="unrelated-annotation"),
    ],
)
def test_select_profile(handler: str, annotations: dict[str, str], chosen: str) -> None:
    assert select_profile(BY_HANDLER, BY_NAME, handler, annotations).name == chosen


@pytest.mark.parametrize(
    ("handler", "annotations", "message"),
    [
        pytest.param(
            "kata",
            {},
            'failed to get sandbox runtime: no runtime for "kata" is configured '
            "(configured handlers: other, small-vm, vmsandbox)",
            id="unknown-handler",
        ),
        pytest.param(
            "vmsandbox",
            {PROFILE_ANNOTATION: "other"},
            'annotation io.vmsandbox/profile: profile "other" is not allowed for runtime handler "vmsandbox" '
            '(allowed: "vmsandbox", "small", "ghost")',
            id="not-allowed",
        ),
        pytest.param(
            "small-vm",
            {PROFILE_ANNOTATION: "vmsandbox"},
            'annotation io.vmsandbox/profile: profile "vmsandbox" is not allowed for runtime handler "small-vm" '
            '(allowed: "small")',
            id="handler-allows-nothing",
        ),
        pytest.param(
            "vmsandbox",
            {PROFILE_ANNOTATION: "ghost"},
            'annotation io.vmsandbox/profile: profile "ghost" is allowed for runtime handler "vmsandbox" but is '
            "not defined (defined profiles: other, small, vmsandbox)",
            id="allowed-but-undefined",
        ),
        pytest.param(
            "vmsandbox",
            {PROFILE_ANNOTATION: ""},
            'annotation io.vmsandbox/profile: profile "" is not allowed for runtime handler "vmsandbox"',
            id="empty-value",
        ),
    ],
)
def test_select_profile_refusals(handler: str, annotations: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        select_profile(BY_HANDLER, BY_NAME, handler, annotations)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        pytest.param("small", "must be a list of profile names, got 'small'", id="not-a-list"),
        pytest.param(["small", ""], "must be a list of profile names, got ['small', '']", id="empty-name"),
        pytest.param(["small", 3], "must be a list of profile names, got ['small', 3]", id="not-a-string"),
        pytest.param(["small", "small"], "names a profile twice: ['small', 'small']", id="duplicate"),
    ],
)
def test_allowed_profiles_validation(value: object, problem: str) -> None:
    with pytest.raises(ProfileError) as err:
        profile_from_mapping({"name": "a", "allowed_profiles": value}, source="p.yaml")
    assert (err.value.source, err.value.key, err.value.problem) == ("p.yaml", "allowed_profiles", problem)


def test_allowed_profiles_parsed() -> None:
    assert profile_from_mapping({"name": "a"}, source="p").allowed_profiles == ()
    assert profile_from_mapping({"name": "a", "allowed_profiles": ["b", "c"]}, source="p").allowed_profiles == (
        "b",
        "c",
    )


@pytest.mark.parametrize(
    ("files", "key", "problem"),
    [
        pytest.param(
            [[{"name": "a", "allowed_profiles": ["b"]}]],
            "allowed_profiles",
            "profile 'a' allows 'b', which is not defined (defined: a)",
            id="allowed-unknown",
        ),
        pytest.param(
            [[{"name": "a"}], [{"name": "a", "handler": "other"}]],
            "name",
            "profile 'a' is already defined in",
            id="name-twice-across-files",
        ),
    ],
)
def test_load_profiles_cross_checks(tmp_path: Path, files: list[list[dict[str, Any]]], key: str, problem: str) -> None:
    paths = []
    for i, docs in enumerate(files):
        path = tmp_path / f"p{i}.yaml"
        path.write_text(yaml.safe_dump_all(docs))
        paths.append(path)
    with pytest.raises(ProfileError) as err:
        load_profiles(paths)
    assert err.value.key == key
    assert err.value.problem.startswith(problem)
    assert str(tmp_path) in err.value.source


def test_load_profiles_accepts_allowed_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"name": "a", "allowed_profiles": ["b"]}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"name": "b"}))
    profiles = load_profiles([tmp_path / "a.yaml", tmp_path / "b.yaml"])
    assert profiles["a"].allowed_profiles == ("b",)


# -- translation of bad quantities ------------------------------------------------------------------
def kres(requests: dict[str, str], limits: dict[str, str] | None = None) -> pb.KubernetesResources:
    return pb.KubernetesResources(
        requests={k: PbQuantity(string=v) for k, v in requests.items()},
        limits={k: PbQuantity(string=v) for k, v in (limits or {}).items()},
    )


def decl_msg(*containers: tuple[str, pb.KubernetesResources], init: tuple[str, ...] = ()) -> pb.PodResourceConfig:
    return pb.PodResourceConfig(
        init_containers=[pb.ContainerResourceConfig(name=n, kubernetes_resources=kres({})) for n in init],
        containers=[pb.ContainerResourceConfig(name=n, kubernetes_resources=r) for n, r in containers],
    )


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        pytest.param(
            decl_msg(("app", kres({}, {"memory": "12XB"}))),
            'pod_resources: container "app": limits.memory: invalid quantity "12XB": unknown suffix "XB"',
            id="unknown-suffix",
        ),
        pytest.param(
            decl_msg(("app", kres({"cpu": "-500m"}))),
            'pod_resources: container "app": requests.cpu: invalid quantity "-500m": must not be negative',
            id="negative",
        ),
        pytest.param(
            decl_msg(("app", kres({"memory": "1e40"}))),
            'pod_resources: container "app": requests.memory: invalid quantity "1e40": too large',
            id="absurd",
        ),
        pytest.param(
            decl_msg(("app", kres({"cpu": ""}))),
            'pod_resources: container "app": requests.cpu: invalid quantity "": empty string',
            id="empty-string",
        ),
        pytest.param(
            decl_msg(("app", pb.KubernetesResources(limits={"cpu": PbQuantity()}))),
            'pod_resources: container "app": limits.cpu: quantity has no value',
            id="unset-quantity",
        ),
        pytest.param(
            decl_msg(("app", kres({"bad name": "1"}))),
            "pod_resources: container \"app\": requests: invalid resource name 'bad name'",
            id="bad-resource-name",
        ),
        pytest.param(
            decl_msg(("app", kres({"memory": "2Gi"}, {"memory": "1Gi"}))),
            'pod_resources: container "app": requests.memory 2Gi is greater than limits.memory 1Gi',
            id="request-above-limit",
        ),
        pytest.param(
            decl_msg(("app", kres({})), ("app", kres({}))),
            "pod_resources: container name 'app' is declared twice",
            id="duplicate-name",
        ),
        pytest.param(
            decl_msg(("app", kres({})), init=("app",)),
            "pod_resources: container name 'app' is declared twice",
            id="init-and-app-share-a-name",
        ),
        pytest.param(decl_msg(("", kres({}))), "pod_resources: an app container has an empty name", id="empty-name"),
        pytest.param(decl_msg(init=("setup",)), "pod_resources: declares no app container", id="no-app"),
    ],
)
def test_bad_declarations_name_the_container_and_resource(msg: pb.PodResourceConfig, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        inbound.declaration(msg)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param(
            pb.ContainerConfig(metadata=pb.ContainerMetadata(name="app"), kubernetes_resources=kres({"cpu": "1x"})),
            'container "app": requests.cpu: invalid quantity "1x"',
            id="kubernetes-resources",
        ),
        pytest.param(
            pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="app"),
                kubernetes_resources=kres({"cpu": "2"}, {"cpu": "1500m"}),
            ),
            'container "app": requests.cpu 2 is greater than limits.cpu 1500m',
            id="request-above-limit",
        ),
        pytest.param(
            pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="app"),
                linux=pb.LinuxContainerConfig(resources=pb.LinuxContainerResources(memory_limit_in_bytes=-1)),
            ),
            'container "app": linux.resources: cpu_period, cpu_shares and memory_limit_in_bytes must not be negative',
            id="negative-linux-memory",
        ),
        pytest.param(
            pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="app"),
                linux=pb.LinuxContainerConfig(
                    resources=pb.LinuxContainerResources(hugepage_limits=[pb.HugepageLimit(page_size="2M", limit=1)])
                ),
            ),
            'container "app": linux.resources.hugepage_limits: invalid hugepage size "2M"',
            id="bad-page-size",
        ),
    ],
)
def test_bad_container_configs(config: pb.ContainerConfig, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        inbound.container_spec(config)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("size", "text"),
    [
        pytest.param(2 * MI, "2MB", id="2M"),
        pytest.param(GI, "1GB", id="1G"),
        pytest.param(64 << 10, "64KB", id="64K"),
        pytest.param(3000, "3000B", id="odd"),
    ],
)
def test_page_size_text_round_trips(size: int, text: str) -> None:
    assert outbound.page_size_text(size) == text
    assert inbound.page_size_bytes(text, "x") == size


def test_container_status_carries_the_recorded_linux_resources() -> None:
    from shim.model import ContainerRecord

    linux = LinuxResources(
        cpu_period=100_000,
        cpu_quota=50_000,
        cpu_shares=512,
        memory_limit_bytes=96 * MI,
        hugepage_limits=((2 * MI, 4 * MI), (GI, GI)),
        cpuset_cpus="1",
    )
    record = ContainerRecord(id="c", sandbox_id="s", name="app", attempt=0, state="CONTAINER_CREATED", created_ns=1)
    # as the ledger gives it back: through JSON (lists, not tuples)
    record = ContainerRecord.from_doc(json.loads(json.dumps(replace(record, linux=linux).to_doc())))
    assert record.linux == linux
    got = outbound.container_status(record).resources.linux
    assert (got.cpu_period, got.cpu_quota, got.cpu_shares, got.memory_limit_in_bytes, got.cpuset_cpus) == (
        100_000,
        50_000,
        512,
        96 * MI,
        "1",
    )
    assert [(h.page_size, h.limit) for h in got.hugepage_limits] == [("2MB", 4 * MI), ("1GB", GI)]
    assert inbound.linux_resources(got, "x") == linux  # and back


# -- pods mixing 2Mi and 1Gi hugepages -----------------------------------------------------------------
def declaration(**containers: dict[str, str]) -> PodDeclaration:
    return PodDeclaration(
        containers=tuple(
            ContainerDeclaration(
                name,
                ContainerResources(
                    requests=ResourceList.parse(amounts, where="r"), limits=ResourceList.parse(amounts, where="l")
                ),
            )
            for name, amounts in containers.items()
        )
    )


MIXED = declaration(
    app={"cpu": "500m", "memory": "64Mi", "hugepages-2Mi": "4Mi"},
    db={"cpu": "500m", "memory": "64Mi", "hugepages-1Gi": "1Gi"},
)
PROFILE = Profile(name="vmsandbox", handler="vmsandbox")


def test_mixed_pod_is_backed_by_the_largest_page_and_reserves_both_in_the_guest() -> None:
    shape = shape_for(demand_from_declaration(MIXED, PROFILE), PROFILE)
    assert shape.backing_page_size == GI
    # 128Mi + 4Mi + 1Gi + 64Mi overhead = 1220Mi, in whole 1Gi pages
    assert shape.memory_bytes == 2 * GI and shape.backing_pages == 2
    assert shape.guest_hugepages == ((2 * MI, 2), (GI, 1))


def test_mixed_pod_domain_reserves_both_sizes_and_asks_tcg_for_1g_pages() -> None:
    shape = shape_for(demand_from_declaration(MIXED, PROFILE), PROFILE)
    identity = SandboxIdentity("a" * 64, "p", "ns", "uid", 0, "vmsandbox")

    tcg = build_domain(**{**_domain_args(identity), "shape": shape, "accel": "tcg"})
    kvm = build_domain(**{**_domain_args(identity), "shape": shape, "accel": "kvm"})
    assert "hugepagesz=2M hugepages=2 hugepagesz=1G hugepages=1" in tcg.boot.cmdline
    assert tcg.memory_backing is not None and tcg.memory_backing.page_size_kib == GI >> 10
    # qemu64 lacks pdpe1gb: without it the guest kernel says "HugeTLB: unsupported hugepagesz=1G"
    assert tcg.cpu_features == ("pdpe1gb",)
    assert '<feature policy="require" name="pdpe1gb"' in render(tcg).replace("'", '"')
    assert kvm.cpu_features == ()  # host-passthrough has it where the host has 1G pages
    two_mi_only = shape_for(demand_from_declaration(declaration(app={"hugepages-2Mi": "4Mi"}), PROFILE), PROFILE)
    assert build_domain(**{**_domain_args(identity), "shape": two_mi_only}).cpu_features == ()


def _domain_args(identity: SandboxIdentity) -> dict[str, Any]:
    return {
        "identity": identity,
        "uuid": "00000000-0000-4000-8000-000000000000",
        "host_cpus": (0,),
        "emulator_cpus": (0,),
        "hugepage_nodes": (0,),
        "accel": "tcg",
        "kernel": "/k",
        "initrd": "/i",
        "machine": "q35",
        "extra_cmdline": "",
        "shape_json": "",
        "console_log": None,
    }


def test_mixed_pod_on_a_host_without_1g_pages_names_the_shortfall() -> None:
    inv = read_inventory(FIXTURES / "one-node-2cpu" / "sys", FIXTURES / "one-node-2cpu" / "proc")
    shape = shape_for(demand_from_declaration(MIXED, PROFILE), PROFILE)
    budgets = {(p.node, p.page_size): HugepageBudget(p.node, p.page_size, p.total, p.free) for p in inv.hugepages}
    with pytest.raises(CannotFit) as err:
        place(shape, inv, {0, 1}, frozenset(), budgets)
    assert "hugepages-1Gi on node 0: need 2 pages, free 0 (short by 2)" in str(err.value)


# -- the shim's bookkeeping (real ledger, fake hypervisor) ----------------------------------------------
class FakeHypervisor:
    uri = "test:///fake"

    def daemon_pid(self) -> int | None:
        return None  # no daemon: guests see this process's mounts

    def destroy(self, name: str) -> None:
        pass

    def teardown(self, name: str) -> None:
        pass


DECLARED = PodDeclaration(
    init_containers=(
        ContainerDeclaration(
            "setup",
            ContainerResources(
                requests=ResourceList.parse({"cpu": "1", "memory": "128Mi"}, where="r"),
                limits=ResourceList.parse({"cpu": "1", "memory": "128Mi"}, where="l"),
            ),
        ),
    ),
    containers=(
        ContainerDeclaration(
            "app",
            ContainerResources(
                requests=ResourceList.parse({"cpu": "500m", "memory": "64Mi"}, where="r"),
                limits=ResourceList.parse({"cpu": "500m", "memory": "64Mi"}, where="l"),
            ),
        ),
        ContainerDeclaration(
            "side",
            ContainerResources(
                requests=ResourceList.parse({"cpu": "500m", "memory": "64Mi"}, where="r"),
                limits=ResourceList.parse({"cpu": "500m", "memory": "64Mi"}, where="l"),
            ),
        ),
    ),
)


@pytest.fixture
def sandboxes(tmp_path: Path) -> Iterator[Sandboxes]:
    ledger = Ledger(tmp_path / "state.db")
    root = FIXTURES / "one-node-2cpu"
    sb = Sandboxes(
        ShimConfig(state_dir=str(tmp_path), console_dir="", pod_network="none"),
        ledger,
        cast(Hypervisor, FakeHypervisor()),
        {"vmsandbox": PROFILE},
        inventory=lambda: read_inventory(root / "sys", root / "proc"),
    )
    try:
        yield sb
    finally:
        ledger.close()


def add_sandbox(
    sb: Sandboxes,
    sandbox_id: str,
    declaration: PodDeclaration | None,
    demand_cpu: str = "1",
    annotations: dict[str, str] | None = None,
) -> None:
    annotations = annotations or {}
    if declaration is not None:
        sidecars = sidecars_from_annotations(annotations, declaration)
        demand = demand_from_declaration(declaration, PROFILE, sidecars=sidecars)
    else:
        demand = replace(demand_from_declaration(declaration_for_cpu(demand_cpu), PROFILE), mode="linux-resources")
    record = SandboxRecord(
        id=sandbox_id,
        meta=PodMeta("p", "ns", "uid"),
        state=SANDBOX_READY,
        created_ns=1,
        runtime_handler="vmsandbox",
        profile="vmsandbox",
        domain="vmsandbox-x",
        annotations=annotations,
        declaration=declaration,
        shape=shape_for(demand, PROFILE),
    )
    sb.ledger.put_sandbox(sandbox_id, SANDBOX_READY, 1, record.to_doc())
    sb.records.reload()


def declaration_for_cpu(cpu: str) -> PodDeclaration:
    return declaration(app={"cpu": cpu, "memory": "256Mi"})


def lin(cpu_millis: int, memory_mib: int) -> LinuxResources:
    return LinuxResources(
        cpu_period=100_000, cpu_quota=cpu_millis * 100, cpu_shares=1024, memory_limit_bytes=memory_mib * MI
    )


def admit_into(sb: Sandboxes, sandbox_id: str, s: ContainerSpec) -> str:
    """CreateContainer's admission step: the id of the container admitted and recorded."""
    return ContainerAdmission(sb.records, sb.locks).admit(sb.records.get(sandbox_id), s).id


def update_limits(
    sb: Sandboxes, container_id: str, resources: ContainerResources | None, linux: LinuxResources
) -> None:
    """UpdateContainerResources' record step."""
    c = sb.records.container(container_id)
    ContainerAdmission(sb.records, sb.locks).update(sb.records.get(c.sandbox_id), c, resources, linux)


def spec(name: str, attempt: int = 0, *, linux: LinuxResources | None = None, declared: bool = False) -> ContainerSpec:
    resources = None
    if declared:
        found = DECLARED.find(name)
        assert found is not None
        resources = found.resources
    return ContainerSpec(name=name, attempt=attempt, resources=resources, linux=linux or LinuxResources())


def test_retries_supersede_earlier_attempts_in_the_envelope(sandboxes: Sandboxes) -> None:
    add_sandbox(sandboxes, "a1" * 32, None, demand_cpu="1")  # 1 cpu, 256Mi
    admit_into(sandboxes, "a1" * 32, spec("a", linux=lin(500, 128)))
    admit_into(sandboxes, "a1" * 32, spec("a", 1, linux=lin(500, 128)))  # retry: replaces attempt 0
    admit_into(sandboxes, "a1" * 32, spec("b", linux=lin(500, 128)))  # fits next to the latest "a" only
    with pytest.raises(Diverged) as err:
        admit_into(sandboxes, "a1" * 32, spec("c", linux=lin(1, 1)))
    assert "cpu: 1001m in all > VM's 1 (it would have to grow by 1m)" in str(err.value)
    with pytest.raises(AlreadyExists):
        admit_into(sandboxes, "a1" * 32, spec("b", linux=lin(500, 128)))


def test_exited_containers_hold_nothing(sandboxes: Sandboxes) -> None:
    add_sandbox(sandboxes, "a1" * 32, None, demand_cpu="1")
    a = admit_into(sandboxes, "a1" * 32, spec("a", linux=lin(1000, 256)))
    sandboxes.records.save_container(
        replace(sandboxes.records.container(a), state=CONTAINER_EXITED, reason="Completed")
    )
    admit_into(sandboxes, "a1" * 32, spec("b", linux=lin(1000, 256)))


def test_declared_containers_record_the_cgroup_their_resources_imply(sandboxes: Sandboxes) -> None:
    add_sandbox(sandboxes, "a2" * 32, DECLARED)
    cid = admit_into(sandboxes, "a2" * 32, spec("app", declared=True))
    linux = sandboxes.records.container(cid).linux
    assert (linux.cpu_quota, linux.memory_limit_bytes) == (50_000, 64 * MI)


@pytest.mark.parametrize(
    ("created", "target", "update", "accepted"),
    [
        # demand: cpu max(1, 0.5 + 0.5) = 1, memory max(128Mi, 128Mi) = 128Mi
        pytest.param(["setup", "app", "side"], "app", lin(500, 64), True, id="unchanged"),
        pytest.param(["setup", "app", "side"], "app", lin(500, 32), True, id="shrink"),
        pytest.param(["app", "side"], "app", lin(500, 65), False, id="app-beyond-with-sidecar"),
        # a sequential init container runs alone: it is not summed with the app containers
        pytest.param(["setup", "app", "side"], "setup", lin(1000, 128), True, id="init-alone-up-to-the-vm"),
        pytest.param(["setup", "app", "side"], "side", lin(500, 64), True, id="init-not-counted-for-apps"),
        pytest.param(["setup"], "setup", lin(1001, 128), False, id="init-beyond-the-vm"),
    ],
)
def test_update_container_envelope(
    sandboxes: Sandboxes, created: list[str], target: str, update: LinuxResources, accepted: bool
) -> None:
    add_sandbox(sandboxes, "a3" * 32, DECLARED)
    ids = {name: admit_into(sandboxes, "a3" * 32, spec(name, declared=True)) for name in created}
    if accepted:
        update_limits(sandboxes, ids[target], None, update)
        assert sandboxes.records.container(ids[target]).linux.memory_limit_bytes == update.memory_limit_bytes
    else:
        before = sandboxes.records.container(ids[target]).linux
        with pytest.raises(Diverged) as err:
            update_limits(sandboxes, ids[target], None, update)
        assert f'update of "{target}" does not fit in the VM, which cannot grow' in str(err.value)
        assert "it would have to grow by" in str(err.value)
        assert sandboxes.records.container(ids[target]).linux == before


def _limits(name: str, cpu: str, memory: str) -> ContainerDeclaration:
    both = ResourceList.parse({"cpu": cpu, "memory": memory}, where=name)
    return ContainerDeclaration(name, ContainerResources(requests=both, limits=both))


# a sidecar started before a plain init container: demand cpu max(250m, 1 + 250m, 250m + 500m) = 1250m,
# memory max(64Mi, 128Mi + 64Mi, 64Mi + 64Mi) = 192Mi
WITH_SIDECAR = PodDeclaration(
    init_containers=(_limits("proxy", "250m", "64Mi"), _limits("setup", "1", "128Mi")),
    containers=(_limits("app", "500m", "64Mi"),),
)
S7 = "57" * 32  # a sandbox id as the shim makes them (64 lowercase hex)


@pytest.mark.parametrize(
    ("target", "update", "accepted"),
    [
        pytest.param("app", lin(500, 128), True, id="app-up-to-the-vm-beside-the-sidecar"),
        pytest.param("app", lin(500, 160), False, id="app-beyond-beside-the-sidecar"),
        pytest.param("setup", lin(1000, 128), True, id="init-beside-the-earlier-sidecar"),
        pytest.param("setup", lin(1000, 160), False, id="init-beyond-beside-the-earlier-sidecar"),
        pytest.param("proxy", lin(250, 64), True, id="sidecar-unchanged"),
        pytest.param("proxy", lin(250, 96), False, id="sidecar-beyond-beside-the-later-init"),
    ],
)
def test_update_container_follows_the_sidecar_rule(
    sandboxes: Sandboxes, target: str, update: LinuxResources, accepted: bool
) -> None:
    add_sandbox(sandboxes, S7, WITH_SIDECAR, annotations={"io.vmsandbox/sidecars": "proxy"})
    assert sandboxes.records.get(S7).sized_shape().demand.memory_bytes == 192 * MI
    ids = {}
    for c in (*WITH_SIDECAR.init_containers, *WITH_SIDECAR.containers):
        ids[c.name] = admit_into(sandboxes, S7, ContainerSpec(name=c.name, resources=c.resources))
    if accepted:
        update_limits(sandboxes, ids[target], None, update)
        assert sandboxes.records.container(ids[target]).linux.memory_limit_bytes == update.memory_limit_bytes
    else:
        with pytest.raises(Diverged) as err:
            update_limits(sandboxes, ids[target], None, update)
        assert f'update of "{target}" does not fit in the VM, which cannot grow' in str(err.value)


def test_update_with_kubernetes_resources_is_recorded(sandboxes: Sandboxes) -> None:
    add_sandbox(sandboxes, "a4" * 32, DECLARED)
    cid = admit_into(sandboxes, "a4" * 32, spec("app", declared=True))
    new = ContainerResources(
        requests=ResourceList.parse({"cpu": "250m"}, where="r"),
        limits=ResourceList.parse({"memory": "32Mi"}, where="l"),
    )
    update_limits(sandboxes, cid, new, LinuxResources())
    c = sandboxes.records.container(cid)
    assert c.resources.requests.as_strings() == {"cpu": "250m"}
    assert c.resources.limits.as_strings() == {"memory": "32Mi"}
    assert (c.linux.cpu_quota, c.linux.cpu_shares, c.linux.memory_limit_bytes) == (0, 256, 32 * MI)


def test_update_pod_sandbox_resources_is_recorded_or_refused(sandboxes: Sandboxes) -> None:
    add_sandbox(sandboxes, "a5" * 32, DECLARED)
    pods = pods_for(sandboxes)
    update_pod_sandbox_resources(pods, UpdatePodSandboxResources("a5" * 32, LinuxResources(), lin(1000, 128)))
    assert sandboxes.records.get("a5" * 32).updated_resources.memory_limit_bytes == 128 * MI
    with pytest.raises(Diverged) as err:
        update_pod_sandbox_resources(pods, UpdatePodSandboxResources("a5" * 32, LinuxResources(), lin(1000, 256)))
    assert "memory: 256Mi in all > VM's 128Mi (it would have to grow by 128Mi)" in str(err.value)
    assert sandboxes.records.get("a5" * 32).updated_resources.memory_limit_bytes == 128 * MI


def test_remove_takes_the_containers_and_the_record(sandboxes: Sandboxes) -> None:
    add_sandbox(sandboxes, "a6" * 32, DECLARED)
    cid = admit_into(sandboxes, "a6" * 32, spec("app", declared=True))
    assert sandboxes.records.get("a6" * 32).declaration == DECLARED
    pods = pods_for(sandboxes)
    remove_pod_sandbox(pods, RemovePodSandbox("a6" * 32))
    remove_pod_sandbox(pods, RemovePodSandbox("a6" * 32))  # idempotent
    assert sandboxes.records.containers("a6" * 32) == []
    assert sandboxes.records.find("a6" * 32) is None
    sandboxes.records.remove_container(cid)  # unknown now: still fine


# -- "accept iff identical", and the fast paths it relies on -----------------------------------------
NAMES = ["cpu", "memory", "ephemeral-storage", "hugepages-2Mi", "example.com/gpu"]


def spellings(value: Fraction) -> list[str]:
    """Different strings of one quantity (value is a whole number of millis)."""
    out = [f"{int(value * 1000)}m"]
    if value.denominator == 1:
        out.append(str(int(value)))
        out.append(f"{int(value)}e0")
        if value % 1024 == 0:
            out.append(f"{int(value // 1024)}Ki")
    return out


values = st.integers(min_value=0, max_value=4096).map(lambda n: Fraction(n * 1024, 1)) | st.integers(
    min_value=1, max_value=8000
).map(lambda m: Fraction(m, 1000))
resource_maps = st.dictionaries(st.sampled_from(NAMES), values, max_size=4)
mount_sets = st.frozensets(
    st.builds(Mount, st.sampled_from(["/a", "/b"]), st.sampled_from(["/h1", "/h2"]), st.booleans()), max_size=2
)
device_sets = st.frozensets(st.builds(Device, st.sampled_from(["/dev/fuse", "/dev/kvm"])), max_size=1)
cdi_sets = st.frozensets(st.builds(CdiDevice, st.sampled_from(["v.com/gpu=0", "v.com/gpu=1"])), max_size=1)


def build(requests: dict[str, Fraction], limits: dict[str, Fraction], pick: int, **attach: Any) -> ContainerResources:
    def spelled(m: dict[str, Fraction]) -> ResourceList:
        return ResourceList.parse({k: spellings(v)[pick % len(spellings(v))] for k, v in m.items()}, where="x")

    return ContainerResources(requests=spelled(requests), limits=spelled(limits), **attach)


@settings(max_examples=300, deadline=None)
@given(
    d_req=resource_maps,
    d_lim=resource_maps,
    r_req=resource_maps,
    r_lim=resource_maps,
    d_mounts=mount_sets,
    r_mounts=mount_sets,
    d_dev=device_sets,
    r_dev=device_sets,
    d_cdi=cdi_sets,
    r_cdi=cdi_sets,
    same=st.booleans(),
    pick_d=st.integers(0, 3),
    pick_r=st.integers(0, 3),
    attempt=st.integers(0, 3),
)
def test_accept_iff_identical(
    d_req: dict[str, Fraction],
    d_lim: dict[str, Fraction],
    r_req: dict[str, Fraction],
    r_lim: dict[str, Fraction],
    d_mounts: frozenset[Mount],
    r_mounts: frozenset[Mount],
    d_dev: frozenset[Device],
    r_dev: frozenset[Device],
    d_cdi: frozenset[CdiDevice],
    r_cdi: frozenset[CdiDevice],
    same: bool,
    pick_d: int,
    pick_r: int,
    attempt: int,
) -> None:
    declared = build(d_req, d_lim, pick_d, mounts=d_mounts, devices=d_dev, cdi_devices=d_cdi)
    if same:  # the same declaration, possibly spelled differently
        r_req, r_lim, r_mounts, r_dev, r_cdi = d_req, d_lim, d_mounts, d_dev, d_cdi
    requested = build(r_req, r_lim, pick_r, mounts=r_mounts, devices=r_dev, cdi_devices=r_cdi)
    pod = PodDeclaration(containers=(ContainerDeclaration("app", declared),))
    identical = (r_req, r_lim, r_mounts, r_dev, r_cdi) == (d_req, d_lim, d_mounts, d_dev, d_cdi)
    existing = [Existing("app", a) for a in range(attempt)]  # earlier attempts exist: this one is a retry
    if identical:
        admit_declared(pod, "app", attempt, requested, existing)
        assert differences("app", declared, requested) == []
    else:
        with pytest.raises(Diverged) as err:
            admit_declared(pod, "app", attempt, requested, existing)
        diffs = differences("app", declared, requested)
        assert diffs and str(err.value).endswith("; ".join(diffs))
        expected = sum(1 for k in set(d_req) | set(r_req) if d_req.get(k) != r_req.get(k)) + sum(
            1 for k in set(d_lim) | set(r_lim) if d_lim.get(k) != r_lim.get(k)
        )
        expected += len(d_mounts ^ r_mounts) + len(d_dev ^ r_dev) + len(d_cdi ^ r_cdi)
        assert len(diffs) == expected
    with pytest.raises(AlreadyExists):
        admit_declared(pod, "app", attempt, requested, [*existing, Existing("app", attempt)])


@settings(max_examples=300, deadline=None)
@given(a=resource_maps, b=resource_maps, pick_a=st.integers(0, 3), pick_b=st.integers(0, 3))
def test_resource_list_equality_is_value_equality(
    a: dict[str, Fraction], b: dict[str, Fraction], pick_a: int, pick_b: int
) -> None:
    la, lb = build(a, {}, pick_a).requests, build(b, {}, pick_b).requests
    assert (la == lb) == (a == b)
    exact = ([(k, q.value) for k, q in la.items], [(k, q.value) for k, q in lb.items])
    assert (la == lb) == (exact[0] == exact[1])  # the cached canonical key agrees with exact values
    if la == lb:
        assert hash(la) == hash(lb)


@given(st.sampled_from(["1", "1000m", "1000e-3", "0.001k", "1000000u"]), st.sampled_from(["1", "1000m", "1e0"]))
def test_quantity_equality_ignores_spelling_and_cache(a: str, b: str) -> None:
    qa, qb = parse_quantity(a), parse_quantity(b)
    qa.canonical()  # fills qa's cache only
    assert qa == qb and hash(qa) == hash(qb)
    assert qa.canonical() == qb.canonical() == "1"
    assert repr(qa).startswith("Quantity(") and "_canonical" not in repr(qa)


def test_quantity_equality_is_exact() -> None:
    assert parse_quantity("1Gi") == parse_quantity("1073741824")
    assert parse_quantity("1Gi") != parse_quantity("1G")
    assert parse_quantity("1n") != Quantity(Fraction(0))
    assert parse_quantity("500m") != parse_quantity("0.5000001")


def test_an_update_racing_a_start_never_puts_back_created(sandboxes: Sandboxes) -> None:
    # UpdateContainerResources reads the record, then StartContainer records RUNNING, then the
    # update writes its limits: the start's state must survive, and so must the update's limits
    add_sandbox(sandboxes, "a5" * 32, DECLARED)
    cid = admit_into(sandboxes, "a5" * 32, spec("app", declared=True))
    read = sandboxes.records.container

    def read_then_start(container_id: str) -> ContainerRecord:
        record = read(container_id)
        sandboxes.records.change_container(cid, expect_state=CONTAINER_CREATED, state=CONTAINER_RUNNING, started_ns=7)
        return record

    sandboxes.records.container = read_then_start  # type: ignore[method-assign]
    update_limits(sandboxes, cid, None, lin(500, 32))
    del sandboxes.records.container
    after = sandboxes.records.container(cid)
    assert (after.state, after.started_ns) == (CONTAINER_RUNNING, 7)
    assert after.linux.memory_limit_bytes == 32 * MI


def test_a_start_does_not_revive_a_container_that_exited_meanwhile(sandboxes: Sandboxes) -> None:
    add_sandbox(sandboxes, "a6" * 32, DECLARED)
    cid = admit_into(sandboxes, "a6" * 32, spec("app", declared=True))
    sandboxes.records.save_container(
        replace(sandboxes.records.container(cid), state=CONTAINER_EXITED, reason="SandboxDied")
    )
    assert sandboxes.records.change_container(cid, expect_state=CONTAINER_CREATED, state=CONTAINER_RUNNING) is None
    assert sandboxes.records.container(cid).state == CONTAINER_EXITED
