"""Admission through the real socket: one declared pod and one pod from today's kubelets, each
booted once and reused for every CreateContainer / Update case; bad inputs that never reach a
guest; after every rejection the shim still answers Version and the pod is undisturbed.

Declared pod (1 vCPU): init "setup" 250m/32Mi; "app" requests 500m/64Mi, limits 500m/128Mi,
ephemeral-storage 1Gi, a read-only mount; "sidecar" 250m/32Mi + hugepages-2Mi 4Mi. Demand: cpu
max(250m, 750m) = 750m, memory max(32Mi, 160Mi) = 160Mi, 4Mi of 2Mi pages; guest RAM 160 + 4 +
64 (overhead) = 228Mi. Today's pod: LinuxPodSandboxConfig.resources 1 cpu / 256Mi, profile
"small" chosen by annotation.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gen.cri.apimachinery.resource.generated_pb2 import Quantity
from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import (
    IMAGE_DIR,
    Shim,
    our_domains,
    require_host,
    running_shim,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MI = 1 << 20
PROFILE_ANNOTATION = "io.vmsandbox/profile"
DATA_DIR = "/tmp/vmsandbox-admission-data"  # the shim shares only allowlisted host paths that exist
DATA_MOUNT = pb.Mount(container_path="/data", host_path=DATA_DIR, readonly=True)


# -- fixtures ---------------------------------------------------------------------------------------
def write_profiles(path: Path) -> None:
    guest = {"image_dir": str(IMAGE_DIR), "boot_timeout_s": 60}
    docs = [
        {
            "name": "vmsandbox",
            "handler": "vmsandbox",
            "snapshots": False,  # the tests count pages and CPUs exactly (see conftest.SNAPSHOT_HANDLER)
            "guest": guest,
            "allowed_profiles": ["small"],
            "extended_resources": {"example.com/fpga": "fpga-pool"},
        },
        {
            "name": "small",
            "handler": "small",
            "vcpu": {"max": 1},
            "memory": {"overhead": "32Mi"},
            "snapshots": False,
            "guest": guest,
        },
    ]
    path.write_text(yaml.safe_dump_all(docs))


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shim]:
    require_host()
    tmp = tmp_path_factory.mktemp("admission")
    profiles = tmp / "admission-profiles.yaml"
    write_profiles(profiles)
    os.makedirs(DATA_DIR, exist_ok=True)
    config: dict[str, object] = {"profile_files": [str(profiles)], "mount_allowlist": [DATA_DIR]}
    with running_shim(tmp, extra_config=config) as running:
        yield running
        assert claims(running) == 0  # every sandbox gave back its CPUs and pages


def claims(shim: Shim) -> int:
    """CPUs and hugepages this shim holds, from its own state database (other shims may share the host)."""
    db = sqlite3.connect(f"file:{shim.state_dir / 'state.db'}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT count(*) FROM claims").fetchone()[0])
    finally:
        db.close()


def quantities(values: dict[str, str]) -> dict[str, Quantity]:
    return {k: Quantity(string=v) for k, v in values.items()}


def kres(requests: dict[str, str], limits: dict[str, str]) -> pb.KubernetesResources:
    return pb.KubernetesResources(requests=quantities(requests), limits=quantities(limits))


SETUP = kres({"cpu": "250m", "memory": "32Mi"}, {"cpu": "250m", "memory": "32Mi"})
APP = kres({"cpu": "500m", "memory": "64Mi", "ephemeral-storage": "1Gi"}, {"cpu": "500m", "memory": "128Mi"})
SIDECAR = kres(
    {"cpu": "250m", "memory": "32Mi", "hugepages-2Mi": "4Mi"}, {"cpu": "250m", "memory": "32Mi", "hugepages-2Mi": "4Mi"}
)


def declared_config(name: str = "declared") -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace="admission", uid=f"uid-{name}", attempt=0),
        labels={"suite": "admission"},
        pod_resources=pb.PodResourceConfig(
            init_containers=[pb.ContainerResourceConfig(name="setup", kubernetes_resources=SETUP)],
            containers=[
                pb.ContainerResourceConfig(name="app", kubernetes_resources=APP, mounts=[DATA_MOUNT]),
                pb.ContainerResourceConfig(name="sidecar", kubernetes_resources=SIDECAR),
            ],
        ),
    )


def ccfg(
    name: str,
    res: pb.KubernetesResources | None,
    *,
    attempt: int = 0,
    mounts: list[pb.Mount] | None = None,
    devices: list[pb.Device] | None = None,
    cdi: list[str] | None = None,
    linux: pb.LinuxContainerResources | None = None,
) -> pb.ContainerConfig:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=attempt),
        image=pb.ImageSpec(image="busybox"),
        mounts=mounts or [],
        devices=devices or [],
        CDI_devices=[pb.CDIDevice(name=n) for n in cdi or []],
    )
    if res is not None:
        config.kubernetes_resources.CopyFrom(res)
    if linux is not None:
        config.linux.resources.CopyFrom(linux)
    return config


def create(shim: Shim, sandbox_id: str, config: pb.ContainerConfig) -> str:
    return str(
        shim.runtime.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config), timeout=30
        ).container_id
    )


def rejected(shim: Shim, call: Callable[[], object], code: grpc.StatusCode, *needles: str) -> str:
    """The call fails with ``code`` and a message holding every needle; the shim keeps serving."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    details = str(err.value.details())
    assert err.value.code() == code, details
    for needle in needles:
        assert needle in details, f"{needle!r} not in {details!r}"
    assert "Traceback" not in details
    assert shim.runtime.Version(pb.VersionRequest(), timeout=10).runtime_name == "vmsandbox"
    return details


def info(shim: Shim, sandbox_id: str) -> dict[str, Any]:
    st = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=30)
    assert st.status.state == pb.SANDBOX_READY
    doc: dict[str, Any] = json.loads(st.info["info"])
    return doc


def container_names(shim: Shim, sandbox_id: str) -> list[tuple[str, int]]:
    items = shim.runtime.ListContainers(
        pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=sandbox_id)), timeout=30
    ).containers
    return sorted((c.metadata.name, c.metadata.attempt) for c in items)


@pytest.fixture(scope="module")
def declared(shim: Shim) -> Iterator[str]:
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=declared_config(), runtime_handler="vmsandbox"), timeout=300
    ).pod_sandbox_id
    yield from stopped_and_removed(shim, sid)


def stopped_and_removed(shim: Shim, sid: str) -> Iterator[str]:
    """Yield the sandbox, then stop and remove it and check its domain is gone."""
    domain = f"vmsandbox-{sid[:32]}"
    try:
        assert info(shim, sid)["domain"] == domain
        yield sid
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    assert domain not in our_domains()


def todays_config() -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="legacy", namespace="admission", uid="uid-legacy", attempt=0),
        annotations={PROFILE_ANNOTATION: "small"},
        linux=pb.LinuxPodSandboxConfig(
            resources=pb.LinuxContainerResources(
                cpu_period=100_000, cpu_quota=100_000, cpu_shares=1024, memory_limit_in_bytes=256 * MI
            ),
            overhead=pb.LinuxContainerResources(memory_limit_in_bytes=32 * MI),
        ),
    )


@pytest.fixture(scope="module")
def todays(shim: Shim, declared: str) -> Iterator[str]:
    sid = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=todays_config(), runtime_handler="vmsandbox"), timeout=300
    ).pod_sandbox_id
    yield from stopped_and_removed(shim, sid)


def linux(quota: int, memory_mib: int, shares: int = 0) -> pb.LinuxContainerResources:
    return pb.LinuxContainerResources(
        cpu_period=100_000, cpu_quota=quota, cpu_shares=shares, memory_limit_in_bytes=memory_mib * MI
    )


# -- the declared pod -------------------------------------------------------------------------------
def test_declared_pod_is_sized_from_its_declaration(shim: Shim, declared: str) -> None:
    doc = info(shim, declared)
    assert doc["sizing_mode"] == "declared"
    assert doc["profile"] == "vmsandbox"
    demand = doc["shape"]["demand"]
    assert (demand["cpu_millis"], demand["memory_bytes"]) == (750, 160 * MI)
    assert demand["hugepages"] == [[2 * MI, 4 * MI]]
    # ephemeral-storage is accepted and recorded, not given to the guest
    assert demand["ephemeral_storage_bytes"] == doc["ephemeral_storage_bytes"] == 1 << 30
    assert doc["shape"]["vcpus"] == 1 and doc["shape"]["memory_bytes"] == 228 * MI
    assert doc["shape"]["guest_hugepages"] == [[2 * MI, 2]]
    assert doc["guest"]["hugepages"]["2048"]["total"] == 2  # the guest reserved the containers' pages
    assert doc["hugepages"] == [{"node": 0, "page_size": 2 * MI, "pages": 114}]
    assert [c["name"] for c in doc["declaration"]["containers"]] == ["app", "sidecar"]


def app_config(
    requests: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
    *,
    attempt: int = 0,
    mounts: list[pb.Mount] | None = None,
    devices: list[pb.Device] | None = None,
    cdi: list[str] | None = None,
) -> pb.ContainerConfig:
    req = {"cpu": "500m", "memory": "64Mi", "ephemeral-storage": "1Gi"} if requests is None else requests
    lim = {"cpu": "500m", "memory": "128Mi"} if limits is None else limits
    return ccfg(
        "app",
        kres(req, lim),
        attempt=attempt,
        mounts=[DATA_MOUNT] if mounts is None else mounts,
        devices=devices,
        cdi=cdi,
    )


@pytest.mark.parametrize(
    ("config", "differences"),
    [
        pytest.param(
            app_config(limits={"cpu": "500m", "memory": "1Gi"}),
            ['container "app": limits.memory declared 128Mi, requested 1Gi'],
            id="limit-differs",
        ),
        pytest.param(
            app_config(requests={"cpu": "0.4", "memory": "64Mi", "ephemeral-storage": "1Gi"}),
            ['container "app": requests.cpu declared 500m, requested 400m'],
            id="request-differs",
        ),
        pytest.param(
            app_config(limits={"cpu": "500m", "memory": "128Mi", "ephemeral-storage": "2Gi"}),
            ['container "app": limits.ephemeral-storage declared nothing, requested 2Gi'],
            id="extra-key",
        ),
        pytest.param(
            app_config(requests={"cpu": "500m", "memory": "64Mi"}),
            ['container "app": requests.ephemeral-storage declared 1Gi, requested nothing'],
            id="missing-key",
        ),
        pytest.param(
            app_config(mounts=[]),
            ['container "app": mount /tmp/vmsandbox-admission-data:/data:ro declared, not requested'],
            id="mount-missing",
        ),
        pytest.param(
            app_config(
                mounts=[pb.Mount(container_path="/data", host_path="/tmp/vmsandbox-admission-data", readonly=False)]
            ),
            [
                'container "app": mount /tmp/vmsandbox-admission-data:/data:ro declared, not requested',
                'container "app": mount /tmp/vmsandbox-admission-data:/data:rw requested, not declared',
            ],
            id="mount-differs",
        ),
        pytest.param(
            app_config(devices=[pb.Device(container_path="/dev/fuse", host_path="/dev/fuse", permissions="rwm")]),
            ['container "app": device /dev/fuse:/dev/fuse:rwm requested, not declared'],
            id="device",
        ),
        pytest.param(
            app_config(cdi=["vendor.com/gpu=0"]),
            ['container "app": CDI device vendor.com/gpu=0 requested, not declared'],
            id="cdi-device",
        ),
        pytest.param(
            app_config(
                requests={"cpu": "1", "memory": "64Mi", "ephemeral-storage": "1Gi"},
                limits={"cpu": "1", "memory": "1Gi"},
                mounts=[],
                cdi=["vendor.com/gpu=0"],
            ),
            [
                'container "app": requests.cpu declared 500m, requested 1',
                'container "app": limits.cpu declared 500m, requested 1',
                'container "app": limits.memory declared 128Mi, requested 1Gi',
                'container "app": mount /tmp/vmsandbox-admission-data:/data:ro declared, not requested',
                'container "app": CDI device vendor.com/gpu=0 requested, not declared',
            ],
            id="every-difference-listed",
        ),
        pytest.param(
            ccfg("sidecar", None, linux=linux(25_000, 1024, shares=256)),
            [
                'container "sidecar": limits.memory declared 32Mi, requested 1Gi',
                'container "sidecar": limits.hugepages-2Mi declared 4Mi, requested nothing',
            ],
            id="linux-resources-only",
        ),
    ],
)
def test_divergent_container_is_rejected(
    shim: Shim, declared: str, config: pb.ContainerConfig, differences: list[str]
) -> None:
    before = container_names(shim, declared)
    details = rejected(
        shim,
        lambda: create(shim, declared, config),
        grpc.StatusCode.FAILED_PRECONDITION,
        "resources diverge from the pod's declaration",
        *differences,
    )
    assert details.count('container "') == len(differences), details
    assert container_names(shim, declared) == before  # nothing recorded
    info(shim, declared)  # the pod is still READY


def test_undeclared_container_is_rejected(shim: Shim, declared: str) -> None:
    rejected(
        shim,
        lambda: create(shim, declared, ccfg("ghost", APP)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "container \"ghost\" was not declared at RunPodSandbox (declared: 'setup', 'app', 'sidecar')",
    )


def test_matching_containers_are_accepted_and_retries_follow_attempts(shim: Shim, declared: str) -> None:
    # the same quantities spelled differently are the same declaration
    respelled = app_config(
        requests={"cpu": "0.5", "memory": "65536Ki", "ephemeral-storage": "1073741824"},
        limits={"cpu": "500m", "memory": "0.125Gi"},
    )
    assert create(shim, declared, respelled)
    assert create(shim, declared, ccfg("setup", SETUP))
    rejected(
        shim,
        lambda: create(shim, declared, app_config()),
        grpc.StatusCode.ALREADY_EXISTS,
        'container "app" (attempt 0) already exists',
    )
    assert create(shim, declared, app_config(attempt=1))  # a retry with identical resources
    rejected(
        shim,
        lambda: create(shim, declared, app_config(limits={"cpu": "500m", "memory": "256Mi"}, attempt=2)),
        grpc.StatusCode.FAILED_PRECONDITION,
        'container "app": limits.memory declared 128Mi, requested 256Mi',
    )
    # no kubernetes_resources: what LinuxContainerResources implies must match the declaration
    sidecar_linux = linux(25_000, 32, shares=256)
    sidecar_linux.hugepage_limits.append(pb.HugepageLimit(page_size="2MB", limit=4 * MI))
    sidecar = create(shim, declared, ccfg("sidecar", None, linux=sidecar_linux))
    assert container_names(shim, declared) == [("app", 0), ("app", 1), ("setup", 0), ("sidecar", 0)]
    status = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=sidecar), timeout=30).status
    assert status.state == pb.CONTAINER_CREATED
    assert status.resources.linux.memory_limit_in_bytes == 32 * MI
    assert [(h.page_size, h.limit) for h in status.resources.linux.hugepage_limits] == [("2MB", 4 * MI)]


def app_id(shim: Shim, sandbox_id: str) -> str:
    items = shim.runtime.ListContainers(
        pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=sandbox_id)), timeout=30
    ).containers
    apps = sorted((c.metadata.attempt, c.id) for c in items if c.metadata.name == "app")
    if not apps:
        return create(shim, sandbox_id, app_config(attempt=7))
    return apps[-1][1]


def test_update_container_within_the_vm_is_recorded(shim: Shim, declared: str) -> None:
    cid = app_id(shim, declared)
    shim.runtime.UpdateContainerResources(
        pb.UpdateContainerResourcesRequest(
            container_id=cid, kubernetes_resources=kres({"cpu": "250m", "memory": "32Mi"}, {"memory": "96Mi"})
        ),
        timeout=30,
    )
    resp = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid, verbose=True), timeout=30)
    assert resp.status.resources.linux.memory_limit_in_bytes == 96 * MI
    assert resp.status.resources.linux.cpu_quota == 0  # no cpu limit any more
    recorded = json.loads(resp.info["info"])
    assert recorded["resources"]["limits"] == {"memory": "96Mi"}
    assert recorded["linux"]["memory_limit_bytes"] == 96 * MI
    # LinuxContainerResources only (today's kubelets)
    shim.runtime.UpdateContainerResources(
        pb.UpdateContainerResourcesRequest(container_id=cid, linux=linux(50_000, 100)), timeout=30
    )
    resp = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30)
    assert (resp.status.resources.linux.cpu_quota, resp.status.resources.linux.memory_limit_in_bytes) == (
        50_000,
        100 * MI,
    )


def test_update_container_beyond_the_vm_is_rejected(shim: Shim, declared: str) -> None:
    cid = app_id(shim, declared)
    before = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
    rejected(
        shim,
        lambda: shim.runtime.UpdateContainerResources(
            pb.UpdateContainerResourcesRequest(
                container_id=cid,
                kubernetes_resources=kres({"cpu": "2", "memory": "1Gi"}, {"cpu": "2", "memory": "1Gi"}),
            ),
            timeout=30,
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        'update of "app" does not fit in the VM, which cannot grow',
        "VM's 750m (it would have to grow by",
        "VM's 160Mi (it would have to grow by",
    )
    after = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
    assert after.resources == before.resources  # nothing recorded


def test_update_pod_sandbox_resources(shim: Shim, declared: str) -> None:
    shim.runtime.UpdatePodSandboxResources(
        pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=declared, resources=linux(75_000, 160)), timeout=30
    )
    assert info(shim, declared)["updated_resources"]["memory_limit_bytes"] == 160 * MI
    rejected(
        shim,
        lambda: shim.runtime.UpdatePodSandboxResources(
            pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id=declared, resources=linux(100_000, 1024)), timeout=30
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "cannot grow",
        "cpu: 1 in all > VM's 750m (it would have to grow by 250m)",
        "memory: 1Gi in all > VM's 160Mi (it would have to grow by 864Mi)",
    )
    assert info(shim, declared)["updated_resources"]["memory_limit_bytes"] == 160 * MI


# -- today's kubelets: no pod_resources --------------------------------------------------------------
def test_todays_kubelet_pod_is_sized_from_linux_resources(shim: Shim, todays: str) -> None:
    doc = info(shim, todays)
    assert doc["sizing_mode"] == "linux-resources"
    assert doc["profile"] == "small"  # chosen by the pod's annotation among the handler's allowed profiles
    assert doc["declaration"] is None
    assert doc["linux_overhead"]["memory_limit_bytes"] == 32 * MI  # recorded
    shape = doc["shape"]
    assert (shape["demand"]["cpu_millis"], shape["demand"]["memory_bytes"]) == (1000, 256 * MI)
    assert (shape["vcpus"], shape["memory_bytes"]) == (1, 288 * MI)  # 256Mi + the small profile's 32Mi
    st = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=todays), timeout=30).status
    assert st.runtime_handler == "vmsandbox"


def test_todays_kubelet_containers_must_fit_together(shim: Shim, todays: str) -> None:
    a = create(shim, todays, ccfg("a", None, linux=linux(50_000, 128)))
    create(shim, todays, ccfg("b", None, linux=linux(50_000, 128)))
    rejected(
        shim,
        lambda: create(shim, todays, ccfg("c", None, linux=linux(10_000, 1))),
        grpc.StatusCode.FAILED_PRECONDITION,
        'container "c" does not fit in the VM, which cannot grow',
        "cpu: 1100m in all > VM's 1 (it would have to grow by 100m)",
        "memory: 257Mi in all > VM's 256Mi (it would have to grow by 1Mi)",
    )
    rejected(
        shim,
        lambda: create(shim, todays, ccfg("a", None, linux=linux(50_000, 128))),
        grpc.StatusCode.ALREADY_EXISTS,
        'container "a" (attempt 0) already exists',
    )
    create(shim, todays, ccfg("a", None, attempt=1, linux=linux(50_000, 128)))  # a retry replaces attempt 0
    # a container carrying kubernetes_resources is measured by them
    rejected(
        shim,
        lambda: create(shim, todays, ccfg("d", kres({"memory": "1Mi"}, {"memory": "1Mi"}))),
        grpc.StatusCode.FAILED_PRECONDITION,
        "memory: 257Mi in all > VM's 256Mi",
    )
    # updates: within the VM accepted and recorded, beyond it rejected with the growth it would need
    shim.runtime.UpdateContainerResources(
        pb.UpdateContainerResourcesRequest(container_id=a, linux=linux(25_000, 64)), timeout=30
    )
    status = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=a), timeout=30).status
    assert status.resources.linux.memory_limit_in_bytes == 64 * MI
    rejected(
        shim,
        lambda: shim.runtime.UpdateContainerResources(
            pb.UpdateContainerResourcesRequest(container_id=a, linux=linux(50_000, 512)), timeout=30
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        'update of "a" does not fit in the VM, which cannot grow',
        "memory: 640Mi in all > VM's 256Mi (it would have to grow by 384Mi)",
    )


# -- bad inputs that never reach a guest -------------------------------------------------------------
def declared_pod(
    containers: list[pb.ContainerResourceConfig], init: list[pb.ContainerResourceConfig] | None = None
) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="bad", namespace="admission", uid="uid-bad"),
        pod_resources=pb.PodResourceConfig(init_containers=init or [], containers=containers),
    )


def one(name: str, requests: dict[str, str], limits: dict[str, str] | None = None) -> pb.ContainerResourceConfig:
    return pb.ContainerResourceConfig(name=name, kubernetes_resources=kres(requests, limits or {}))


INVALID = grpc.StatusCode.INVALID_ARGUMENT
SIDECARS_ANNOTATION = "io.vmsandbox/sidecars"


def annotated(config: pb.PodSandboxConfig, annotations: dict[str, str]) -> pb.PodSandboxConfig:
    config.annotations.update(annotations)
    return config


def with_overhead(config: pb.PodSandboxConfig, cpu_millis: int, memory: int = 0) -> pb.PodSandboxConfig:
    """LinuxPodSandboxConfig.overhead as the kubelet sends a RuntimeClass overhead (quota/period, memory)."""
    config.linux.overhead.CopyFrom(
        pb.LinuxContainerResources(cpu_period=100_000, cpu_quota=cpu_millis * 100, memory_limit_in_bytes=memory)
    )
    return config


# a sidecar of 10 cpus beside an app of 7: 17 vCPUs (over the profile's 16) only when the shim knows
SIDECAR_POD = ([one("app", {"cpu": "7"})], [one("proxy", {"cpu": "10"})])


@pytest.mark.parametrize(
    ("request_", "code", "needles"),
    [
        pytest.param(pb.RunPodSandboxRequest(), INVALID, ["RunPodSandboxRequest.config is missing"], id="no-config"),
        pytest.param(
            pb.RunPodSandboxRequest(config=pb.PodSandboxConfig()),
            INVALID,
            ["PodSandboxConfig.metadata.name is empty"],
            id="empty-metadata",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"cpu": "1"}), one("app", {"cpu": "2"})])),
            INVALID,
            ["pod_resources: container name 'app' is declared twice"],
            id="duplicate-container-names",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"cpu": "1"})], init=[one("app", {"cpu": "1"})])),
            INVALID,
            ["pod_resources: container name 'app' is declared twice"],
            id="init-and-app-share-a-name",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("", {"cpu": "1"})])),
            INVALID,
            ["pod_resources: an app container has an empty name"],
            id="empty-container-name",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([], init=[one("setup", {"cpu": "1"})])),
            INVALID,
            ["pod_resources: declares no app container"],
            id="no-app-container",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"cpu": "1"}, {"memory": "12XB"})])),
            INVALID,
            ['pod_resources: container "app": limits.memory: invalid quantity "12XB": unknown suffix "XB"'],
            id="invalid-quantity",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"cpu": "-1"})])),
            INVALID,
            ['pod_resources: container "app": requests.cpu: invalid quantity "-1": must not be negative'],
            id="negative-quantity",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"memory": "8Ei"})])),
            INVALID,
            ['pod_resources: container "app": requests.memory: invalid quantity "8Ei": too large'],
            id="absurd-quantity",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"cpu": "2"}, {"cpu": "1"})])),
            INVALID,
            ['pod_resources: container "app": requests.cpu 2 is greater than limits.cpu 1'],
            id="request-above-limit",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"hugepages-4Mi": "4Mi"})])),
            INVALID,
            ["pod_resources: container \"app\": requests: unsupported hugepage resource 'hugepages-4Mi'"],
            id="unsupported-hugepage-size",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"hugepages-2Mi": "3Mi"})])),
            INVALID,
            ['pod_resources: container "app": requests.hugepages-2Mi 3Mi is not a whole number of 2Mi pages'],
            id="partial-hugepage",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"example.com/gpu": "1"})])),
            INVALID,
            ['container "app": extended resource example.com/gpu is not mapped to a device pool by profile'],
            id="unmapped-extended-resource",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"example.com/fpga": "1"})])),
            INVALID,
            ["extended resource example.com/fpga maps to device pool 'fpga-pool'"],
            id="mapped-extended-resource-without-passthrough",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"cpu": "1"})]), runtime_handler="kata"),
            INVALID,
            [
                'failed to get sandbox runtime: no runtime for "kata" is configured',
                "configured handlers: small, vmsandbox",
            ],
            id="unknown-handler",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(
                config=pb.PodSandboxConfig(
                    metadata=pb.PodSandboxMetadata(name="bad", namespace="admission", uid="uid-bad"),
                    annotations={PROFILE_ANNOTATION: "huge"},
                )
            ),
            INVALID,
            [
                'annotation io.vmsandbox/profile: profile "huge" is not allowed for runtime handler "vmsandbox" '
                '(allowed: "vmsandbox", "small")'
            ],
            id="profile-annotation-not-allowed",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(
                config=pb.PodSandboxConfig(
                    metadata=pb.PodSandboxMetadata(name="bad", namespace="admission", uid="uid-bad"),
                    annotations={"io.kubernetes.cri.sandbox-memory": "lots"},
                )
            ),
            INVALID,
            ['annotation io.kubernetes.cri.sandbox-memory: "lots" is not an integer'],
            id="bad-sandbox-annotation",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(
                config=pb.PodSandboxConfig(
                    metadata=pb.PodSandboxMetadata(name="bad", namespace="admission", uid="uid-bad"),
                    linux=pb.LinuxPodSandboxConfig(
                        resources=pb.LinuxContainerResources(
                            hugepage_limits=[pb.HugepageLimit(page_size="3XB", limit=1)]
                        )
                    ),
                )
            ),
            INVALID,
            ['linux.resources.hugepage_limits: invalid hugepage size "3XB"'],
            id="bad-hugepage-size-in-linux-resources",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=declared_pod([one("app", {"cpu": "100"})])),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["pod needs 100 vCPUs", "allows at most 16"],
            id="more-vcpus-than-the-profile-allows",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(
                config=annotated(declared_pod(*SIDECAR_POD), {SIDECARS_ANNOTATION: "proxy"}),
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["pod needs 17 vCPUs (17000m cpu + 0 extra) but profile 'vmsandbox' allows at most 16"],
            id="annotated-sidecar-adds-to-the-app",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=annotated(declared_pod(*SIDECAR_POD), {SIDECARS_ANNOTATION: "app"})),
            INVALID,
            [
                "annotation io.vmsandbox/sidecars: 'app' is not an init container of pod_resources "
                "(init containers: 'proxy')"
            ],
            id="sidecar-annotation-names-an-app-container",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(config=with_overhead(declared_pod([one("app", {"cpu": "15600m"})]), 1000)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["pod needs 17 vCPUs (15600m cpu + 1000m RuntimeClass overhead) but profile 'vmsandbox' allows at most 16"],
            id="declared-pod-runtimeclass-overhead",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(
                config=with_overhead(
                    pb.PodSandboxConfig(
                        metadata=pb.PodSandboxMetadata(name="bad", namespace="admission", uid="uid-bad"),
                        linux=pb.LinuxPodSandboxConfig(
                            resources=pb.LinuxContainerResources(cpu_period=100_000, cpu_quota=1_600_000)
                        ),
                    ),
                    500,
                )
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["pod needs 17 vCPUs (16000m cpu + 500m RuntimeClass overhead) but profile 'vmsandbox' allows at most 16"],
            id="todays-pod-runtimeclass-overhead",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(
                config=declared_pod([one("app", {"cpu": "1", "memory": "64Mi", "hugepages-1Gi": "1Gi"})])
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["hugepages-1Gi on node 0: need 2 pages, free 0 (short by 2)"],
            id="1Gi-backed",
        ),
        pytest.param(
            pb.RunPodSandboxRequest(
                config=declared_pod(
                    [
                        one("app", {"cpu": "500m", "memory": "64Mi", "hugepages-2Mi": "4Mi"}),
                        one("db", {"cpu": "500m", "memory": "64Mi", "hugepages-1Gi": "1Gi"}),
                    ]
                )
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ["hugepages-1Gi on node 0: need 2 pages, free 0 (short by 2)"],
            id="mixed-2Mi-and-1Gi",
        ),
    ],
)
def test_bad_pod_is_refused_before_any_guest(
    shim: Shim, request_: pb.RunPodSandboxRequest, code: grpc.StatusCode, needles: list[str]
) -> None:
    sandboxes = shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
    held = claims(shim)
    rejected(shim, lambda: shim.runtime.RunPodSandbox(request_, timeout=60), code, *needles)
    assert shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items == sandboxes
    assert claims(shim) == held  # nothing claimed, nothing leaked


def test_bad_container_requests(shim: Shim, declared: str) -> None:
    cases: list[tuple[pb.CreateContainerRequest, grpc.StatusCode, str]] = [
        (
            pb.CreateContainerRequest(config=ccfg("app", APP)),
            INVALID,
            "CreateContainerRequest.pod_sandbox_id is empty",
        ),
        (pb.CreateContainerRequest(pod_sandbox_id=declared), INVALID, "CreateContainerRequest.config is missing"),
        (
            pb.CreateContainerRequest(pod_sandbox_id=declared, config=ccfg("", APP)),
            INVALID,
            "ContainerConfig.metadata.name is empty",
        ),
        (
            pb.CreateContainerRequest(pod_sandbox_id=declared, config=ccfg("app", kres({"memory": "lots"}, {}))),
            INVALID,
            'container "app": requests.memory: invalid quantity "lots"',
        ),
        (
            pb.CreateContainerRequest(pod_sandbox_id="0" * 64, config=ccfg("app", APP)),
            grpc.StatusCode.NOT_FOUND,
            f"pod sandbox {'0' * 64!r} not found",
        ),
    ]
    for req, code, needle in cases:
        rejected(shim, functools.partial(shim.runtime.CreateContainer, req, timeout=30), code, needle)
    rejected(
        shim,
        lambda: shim.runtime.UpdateContainerResources(
            pb.UpdateContainerResourcesRequest(
                container_id=app_id(shim, declared), kubernetes_resources=kres({"cpu": "1x"}, {})
            ),
            timeout=30,
        ),
        INVALID,
        'UpdateContainerResourcesRequest.kubernetes_resources: requests.cpu: invalid quantity "1x"',
    )
    rejected(
        shim,
        lambda: shim.runtime.UpdateContainerResources(
            pb.UpdateContainerResourcesRequest(container_id="f" * 64), timeout=30
        ),
        grpc.StatusCode.NOT_FOUND,
        f'container "{"f" * 64}" not found',
    )
    rejected(
        shim,
        lambda: shim.runtime.UpdatePodSandboxResources(pb.UpdatePodSandboxResourcesRequest(), timeout=30),
        INVALID,
        "pod_sandbox_id is empty",
    )
