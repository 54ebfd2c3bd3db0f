"""``vmsandbox plan`` through the real entry point: real manifests, fixture hosts, exit codes 0/1/2,
JSON for the numbers, text for the explanation, golden files for ``--format xml``."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from shim.model import PodMeta, SandboxRecord
from tests.cli.vmsandbox_cmd import (
    DEPLOY,
    GOLDEN,
    MANIFESTS,
    ONE_NODE,
    PROFILES,
    REPO,
    TWO_SOCKET,
    UPDATE_GOLDEN,
    VFIO_HOST,
    vmsandbox,
    vmsandbox_json,
)
from tests.cli.vmsandbox_cmd import (
    HERE as CLI,
)
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.claims import Claim

MI = 1 << 20
GI = 1 << 30


def dig(doc: Any, path: str) -> Any:
    for part in path.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


@dataclass(frozen=True)
class PlanCase:
    id: str
    manifest: str
    host: Path
    args: tuple[str, ...] = ("--profiles", str(PROFILES))
    exit: int = 0
    expect: dict[str, Any] = field(default_factory=dict)  # JSON path -> value
    contains: dict[str, str] = field(default_factory=dict)  # JSON path -> substring of its text


PLAN_CASES = [
    PlanCase(
        "guaranteed-pod-fits-two-socket",
        "guaranteed-pod.yaml",
        TWO_SOCKET,
        expect={
            "pod.namespace": "shop",
            "pod.name": "web",
            "handler": "vmsandbox",  # from runtimeClassName
            "pod_resources.containers.0.requests": {"cpu": "2", "memory": "512Mi"},
            "pod_resources.containers.0.mounts.0.container_path": "/usr/share/nginx/html",
            "pod_resources.containers.0.mounts.0.host_path": "",
            "demand.cpu_millis": 2000,
            "shape.vcpus": 2,
            "shape.memory_bytes": 576 * MI,
            "shape.backing_page_size": 2 * MI,
            # spread (the default packing): node 1 has more free, node 0's kernel shows 24 pages in use
            "placement.nodes": [1],
            "placement.cpus": [16, 48],  # one whole core: thread siblings together
            "placement.hugepages": [{"node": 1, "page_size": 2 * MI, "pages": 288}],
            "host.accel": "kvm",  # the fixture's CPUs have vmx
            "fits": True,
            "refusal": None,
        },
    ),
    PlanCase(
        "guaranteed-pod-short-of-hugepages-one-node",
        "guaranteed-pod.yaml",
        ONE_NODE,
        exit=1,
        expect={
            "fits": False,
            "placement": None,
            "domain_xml": None,
            "host.accel": "tcg",
            "refusal.shortfalls": [
                {
                    "resource": "hugepages-2Mi (guest RAM 576Mi)",
                    "declared": "288 pages",
                    "available": "60 free on node 0",
                }
            ],
        },
        contains={"refusal.reason": "hugepages-2Mi on node 0: need 288 pages, free 60 (short by 228)"},
    ),
    PlanCase(
        "burstable-pod-counts-limits-else-requests",
        "burstable-pod.yaml",
        TWO_SOCKET,
        expect={
            "pod.namespace": "default",
            # api: cpu request only (250m), memory limit 256Mi; metrics: requests defaulted from limits
            "pod_resources.containers.0.requests": {"cpu": "250m", "memory": "128Mi"},
            "pod_resources.containers.0.limits": {"memory": "256Mi"},
            "pod_resources.containers.1.requests": {"cpu": "100m", "memory": "32Mi"},
            "demand.cpu_millis": 350,
            "demand.memory_bytes": 288 * MI,
            "shape.vcpus": 1,
            "shape.memory_bytes": 352 * MI,
        },
    ),
    PlanCase(
        "init-and-sidecar-kep-753",
        "init-hugepages-pod.yaml",
        TWO_SOCKET,
        expect={
            "pod.sidecars": ["log-shipper"],
            "pod_resources.init_containers.0.name": "setup",
            "pod_resources.init_containers.1.name": "log-shipper",
            "pod_resources.init_containers.0.requests": {"cpu": "500m", "memory": "64Mi"},
            # the sidecar (100m, 32Mi) runs beside the app container (1, 128Mi): max(500m, 100m + 1) cpu,
            # max(64Mi, 32Mi + 128Mi) memory
            "demand.cpu_millis": 1100,
            "demand.memory_bytes": 160 * MI,
            "demand.hugepages": [[2 * MI, 64 * MI]],
            "shape.vcpus": 2,
            "shape.memory_bytes": 288 * MI,  # 160Mi + 64Mi hugepages + 64Mi overhead
            "shape.guest_hugepages": [[2 * MI, 32]],
        },
        # the manifest does not carry the annotation the shim reads on the wire
        contains={
            "notes": "the shim takes them from the pod annotation io.vmsandbox/sidecars (here: none): it would ask "
            "for cpu 1000m, memory 128Mi instead of 1100m, 160Mi; give the pod template "
            '"io.vmsandbox/sidecars: log-shipper"'
        },
    ),
    PlanCase(
        "gpu-without-device-pool-refused",
        "gpu-pod.yaml",
        TWO_SOCKET,
        exit=1,
        expect={
            "pod_resources.containers.0.requests": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"},
            "demand.extended": [["nvidia.com/gpu", 1]],
            "shape": None,
            "refusal.shortfalls": [],
        },
        contains={
            "refusal.reason": "extended resource nvidia.com/gpu is not mapped to a device pool by profile 'vmsandbox'",
        },
    ),
    PlanCase(
        "gpu-pool-not-configured-on-this-host",
        "gpu-pod.yaml",
        TWO_SOCKET,
        args=("--profiles", str(PROFILES), "--handler", "vmsandbox-gpu"),
        exit=1,
        contains={"refusal.reason": "maps to device pool 'a100', which is not configured on this node"},
    ),
    PlanCase(
        "gpu-from-the-admins-pool-whole-iommu-group",
        "gpu-inference-pod.yaml",
        VFIO_HOST,
        args=("--config", str(CLI / "gpu-config.yaml"), "--handler", "vmsandbox-gpu"),
        expect={
            "fits": True,
            "placement.nodes": [0],  # the GPU's node: numa_policy single-numa-node
            "placement.devices": [
                {"pool": "a100", "iommu_group": 12, "node": 0, "functions": ["0000:3b:00.0", "0000:3b:00.1"]}
            ],
        },
        contains={"domain_xml": '<hostdev mode="subsystem" type="pci" managed="yes">'},
    ),
    PlanCase(
        "deployment-template",
        "deployment.yaml",
        TWO_SOCKET,
        expect={
            "pod.kind": "Deployment",
            "pod.name": "cache",
            "pod.namespace": "shop",
            "pod.labels": {"app": "cache"},
            "demand.cpu_millis": 1000,
            "shape.vcpus": 1,
        },
    ),
    PlanCase(
        "big-pod-no-node-has-the-pages",
        "big-pod.yaml",
        TWO_SOCKET,
        exit=1,
        expect={
            "shape.vcpus": 24,
            "refusal.shortfalls": [
                {
                    "resource": "hugepages-2Mi (guest RAM 4160Mi)",
                    "declared": "2080 pages",
                    "available": "1000 free on node 0",
                },
                {
                    "resource": "hugepages-2Mi (guest RAM 4160Mi)",
                    "declared": "2080 pages",
                    "available": "1024 free on node 1",
                },
            ],
        },
    ),
    PlanCase(
        "big-pod-on-1gi-pages",
        "big-pod.yaml",
        TWO_SOCKET,
        args=("--profiles", str(DEPLOY / "profiles.yaml"), "--handler", "vmsandbox-hugepages"),
        expect={
            "profile": "hugepages",
            "shape.vcpus": 24,
            "shape.memory_bytes": 5 * GI,  # 4Gi + 128Mi overhead, rounded up to 1Gi pages
            # spread counts pages too: node 0 has more 1Gi pages left over afterwards (8 free, node 1 6)
            "placement.hugepages": [{"node": 0, "page_size": GI, "pages": 5}],
        },
    ),
    PlanCase(
        "big-pod-over-profile-vcpu-max",
        "big-pod.yaml",
        TWO_SOCKET,
        args=("--profiles", str(DEPLOY / "profiles.yaml"), "--profile", "small"),
        exit=1,
        expect={
            "shape": None,
            "refusal.shortfalls": [
                {"resource": "vCPUs", "declared": "24", "available": "2 (vcpu.max of profile 'small')"}
            ],
        },
    ),
    PlanCase(
        "shared-profile-4k-pages-fits-small-host",
        "burstable-pod.yaml",
        ONE_NODE,
        args=("--config", str(CLI / "shared-config.yaml"), "--profile", "small"),
        expect={
            "shape.cpu_policy": "shared",
            "shape.backing_page_size": 4096,
            "placement.cpus": [0, 1],  # floats over the pool
            "placement.hugepages": [],
        },
    ),
    PlanCase(
        "cpu-pool-too-small",
        "guaranteed-pod.yaml",
        TWO_SOCKET,
        args=("--profiles", str(PROFILES), "--cpu-pool", "5"),
        exit=1,
        expect={
            "host.owned_cpus": "5",
            "refusal.shortfalls.0": {
                "resource": "cpu",
                "declared": "2",
                "available": "1 free on node 0",
            },
        },
    ),
    PlanCase(
        "cpu-pool-on-second-node",
        "guaranteed-pod.yaml",
        TWO_SOCKET,
        args=("--profiles", str(PROFILES), "--cpu-pool", "16-17"),
        expect={"placement.nodes": [1], "placement.cpus": [16, 17]},
    ),
]


@pytest.mark.parametrize("case", PLAN_CASES, ids=[c.id for c in PLAN_CASES])
def test_plan_json(case: PlanCase) -> None:
    code, doc = vmsandbox_json("plan", MANIFESTS / case.manifest, "--host-sysfs", case.host, *case.args)
    assert code == case.exit, json.dumps(doc, indent=1)
    for path, value in case.expect.items():
        assert dig(doc, path) == value, path
    for path, text in case.contains.items():
        found = dig(doc, path)
        haystack = "\n".join(found) if isinstance(found, list) else str(found)
        assert text in haystack, (path, haystack)
    assert (doc["domain_xml"] is not None) == (case.exit == 0)


@dataclass(frozen=True)
class GoldenCase:
    id: str
    manifest: str
    host: Path
    args: tuple[str, ...]


GOLDEN_CASES = [
    GoldenCase("guaranteed-two-socket", "guaranteed-pod.yaml", TWO_SOCKET, ("--profiles", str(PROFILES))),
    GoldenCase("init-hugepages-two-socket", "init-hugepages-pod.yaml", TWO_SOCKET, ("--profiles", str(PROFILES))),
    GoldenCase(
        "deployment-medium-shared",
        "deployment.yaml",
        TWO_SOCKET,
        ("--config", str(CLI / "two-socket-config.yaml"), "--handler", "vmsandbox-medium"),
    ),
    GoldenCase(
        "burstable-small-one-node-tcg",
        "burstable-pod.yaml",
        ONE_NODE,
        ("--config", str(CLI / "shared-config.yaml"), "--profile", "small"),
    ),
    GoldenCase(
        "gpu-vfio-host-hostdevs",
        "gpu-inference-pod.yaml",
        VFIO_HOST,
        ("--config", str(CLI / "gpu-config.yaml")),
    ),
    GoldenCase(
        "big-pod-1gi-pages",
        "big-pod.yaml",
        TWO_SOCKET,
        ("--profiles", str(DEPLOY / "profiles.yaml"), "--handler", "vmsandbox-hugepages"),
    ),
]


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=[c.id for c in GOLDEN_CASES])
def test_plan_xml_golden(case: GoldenCase) -> None:
    done = vmsandbox("plan", MANIFESTS / case.manifest, "--host-sysfs", case.host, *case.args, "--format", "xml")
    assert done.returncode == 0, done.stderr
    golden = GOLDEN / f"plan-{case.id}.xml"
    if UPDATE_GOLDEN:
        golden.write_text(done.stdout)
    assert done.stdout == golden.read_text(), f"{golden} differs (VMSANDBOX_UPDATE_GOLDEN=1 rewrites it)"
    again = vmsandbox("plan", MANIFESTS / case.manifest, "--host-sysfs", case.host, *case.args, "--format", "xml")
    assert again.stdout == done.stdout  # same input, same XML


def test_plan_text_explains_a_fit() -> None:
    done = vmsandbox("plan", MANIFESTS / "init-hugepages-pod.yaml", "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "pod        net/dpdk (Pod)" in out
    assert "init (sidecar)  log-shipper" in out
    assert "demand     cpu 1100m, memory 160Mi, hugepages-2Mi 64Mi" in out
    assert (
        "VM         2 vCPUs (pinned, exclusive), 288Mi RAM on 2Mi hugepages (144 pages), guest hugepages 32x2Mi" in out
    )
    assert "placement  NUMA node 1: vCPU 0 -> CPU 16, vCPU 1 -> CPU 48; 144x2Mi pages from node 1" in out
    assert "verdict    fits" in out
    assert "<cmdline>console=ttyS0 panic=-1 quiet cryptomgr.notests hugepagesz=2M hugepages=32</cmdline>" in out


def test_plan_text_explains_a_refusal() -> None:
    done = vmsandbox("plan", MANIFESTS / "guaranteed-pod.yaml", "--host-sysfs", ONE_NODE, "--profiles", PROFILES)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert any(
        line.startswith("verdict    does not fit: cannot place the VM: hugepages-2Mi on node 0") for line in lines
    )
    assert "  RESOURCE                         DECLARED   AVAILABLE" in lines
    assert "  hugepages-2Mi (guest RAM 576Mi)  288 pages  60 free on node 0" in lines
    assert "<domain" not in done.stdout


def test_plan_xml_of_a_refused_pod_prints_nothing() -> None:
    done = vmsandbox("plan", MANIFESTS / "gpu-pod.yaml", "--host-sysfs", TWO_SOCKET, "--format", "xml")
    assert (done.returncode, done.stdout) == (1, "")
    assert "nvidia.com/gpu is not mapped to a device pool" in done.stderr


INVALID = {
    "not-yaml": ("kind: Pod\nspec: [unclosed\n", "invalid YAML"),
    "not-a-pod": (
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
        "no pod in the manifest (found kind ConfigMap)",
    ),
    "no-containers": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {containers: []}\n",
        "at least one container",
    ),
    "bad-quantity": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n"
        "  - name: app\n    resources: {limits: {cpu: two}}\n",
        'spec.containers[0] ("app").resources.limits.cpu: invalid quantity "two"',
    ),
    "hugepages-alone": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n"
        "  - name: app\n    resources: {limits: {hugepages-2Mi: 64Mi}}\n",
        "HugePages require cpu or memory",
    ),
    "hugepages-not-whole-pages": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n"
        "  - name: app\n    resources: {limits: {memory: 64Mi, hugepages-2Mi: 3Mi}}\n",
        "is not a whole number of 2Mi pages",
    ),
    "extended-request-without-limit": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n"
        "  - name: app\n    resources: {requests: {nvidia.com/gpu: 1}}\n",
        "a limit must be set for non-overcommitable resource nvidia.com/gpu",
    ),
    "extended-fraction": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers:\n"
        "  - name: app\n    resources: {limits: {nvidia.com/gpu: 500m}}\n",
        "nvidia.com/gpu: 500m must be an integer",
    ),
    "duplicate-names": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  initContainers: [{name: app}]\n"
        "  containers: [{name: app}]\n",
        "container name 'app' is declared twice",
    ),
    "bad-container-name": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec:\n  containers: [{name: App_1}]\n",
        "'App_1' is not a valid container name",
    ),
    "old-api-version": (
        "apiVersion: extensions/v1beta1\nkind: Deployment\nmetadata: {name: x}\nspec: {}\n",
        "apiVersion: 'extensions/v1beta1' is not a version of Deployment (expected apps/v1)",
    ),
    "two-pods-no-index": (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [{name: c}]}\n---\n"
        "apiVersion: v1\nkind: Pod\nmetadata: {name: b}\nspec: {containers: [{name: c}]}\n",
        "holds 2 pod templates (0: Pod/a, 1: Pod/b); choose one with --document N (0-based)",
    ),
}


@pytest.mark.parametrize("text,message", INVALID.values(), ids=list(INVALID))
def test_plan_bad_input_exits_2(tmp_path: Path, text: str, message: str) -> None:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(text)
    done = vmsandbox("plan", manifest, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.startswith(f"vmsandbox plan: {manifest}")
    assert message in done.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        pytest.param(
            (MANIFESTS / "invalid-request-over-limit.yaml",),
            "2 must be less than or equal to cpu limit of 1",
            id="request-over-limit",
        ),
        pytest.param((MANIFESTS / "no-such.yaml",), "cannot read: No such file or directory", id="missing-file"),
        pytest.param(
            (MANIFESTS / "guaranteed-pod.yaml", "--profile", "nope"),
            "--profile nope: no such profile",
            id="unknown-profile",
        ),
        pytest.param(
            (MANIFESTS / "guaranteed-pod.yaml", "--handler", "nope"),
            "--handler nope: no profile serves it",
            id="unknown-handler",
        ),
        pytest.param(
            (MANIFESTS / "guaranteed-pod.yaml", "--cpu-pool", "99"),
            "cpu_pool names CPUs that are not online",
            id="cpu-pool-offline",
        ),
        pytest.param((MANIFESTS / "guaranteed-pod.yaml", "--cpu-pool", "x-y"), "--cpu-pool", id="cpu-pool-syntax"),
        pytest.param(
            (MANIFESTS / "guaranteed-pod.yaml", "--host-sysfs", "/nonexistent"), "no devices/system/cpu", id="bad-sysfs"
        ),
    ],
)
def test_plan_bad_arguments_exit_2(args: tuple[Any, ...], message: str) -> None:
    done = vmsandbox("plan", "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES, *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr


def test_plan_picks_a_document_by_index(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((MANIFESTS / "deployment.yaml").read_text()))
    manifest = tmp_path / "two.yaml"
    pod = yaml.safe_load((MANIFESTS / "burstable-pod.yaml").read_text())
    manifest.write_text(yaml.safe_dump_all([docs[0], docs[1], pod]))
    code, doc = vmsandbox_json("plan", manifest, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES, "--document", "1")
    assert code == 0
    assert (doc["pod"]["kind"], doc["pod"]["name"]) == ("Pod", "api")


def test_plan_uses_the_shim_config(tmp_path: Path) -> None:
    """cpu_pool, the hugepage budget and profile_files come from the shim's own config file."""
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"cpu_pool": "16-31", "hugepages": {"2Mi": 100}, "profile_files": [str(PROFILES)]})
    )
    code, doc = vmsandbox_json(
        "plan", MANIFESTS / "guaranteed-pod.yaml", "--host-sysfs", TWO_SOCKET, "--config", config
    )
    assert code == 1
    assert doc["host"]["owned_cpus"] == "16-31"
    # the 100-page budget is handed to node 0 first; node 1, where the owned CPUs are, gets none
    assert "hugepages-2Mi on node 1: need 288 pages, free 0" in doc["refusal"]["reason"]


def test_plan_counts_what_a_running_shim_holds_and_changes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    ledger = Ledger(state / "state.db")
    node0 = [*range(16), *range(32, 48)]
    ledger.claim("a" * 64, Claim(cpus=tuple(node0)), page_limits={}, memory_limits={})
    record = SandboxRecord(
        id="a" * 64,
        meta=PodMeta("x", "y", "z"),
        state="SANDBOX_READY",
        created_ns=1,
        runtime_handler="vmsandbox",
        profile="vmsandbox",
        domain="vmsandbox-" + "a" * 32,
    )
    ledger.put_sandbox(record.id, record.state, record.created_ns, record.to_doc())
    ledger.close()
    before = hashlib.sha256((state / "state.db").read_bytes()).hexdigest()
    code, doc = vmsandbox_json(
        "plan",
        MANIFESTS / "guaranteed-pod.yaml",
        "--host-sysfs",
        TWO_SOCKET,
        "--profiles",
        PROFILES,
        "--state-dir",
        state,
    )
    assert code == 0
    assert doc["placement"]["nodes"] == [1]  # node 0's CPUs are all held
    assert doc["placement"]["cpus"] == [16, 48]
    assert hashlib.sha256((state / "state.db").read_bytes()).hexdigest() == before


def test_plan_never_loads_libvirt_or_grpc() -> None:
    """The plan command runs in-process here only to look at sys.modules afterwards."""
    import subprocess

    code = (
        "import sys; from cli.main import main\n"
        f"rc = main(['plan', {str(MANIFESTS / 'guaranteed-pod.yaml')!r}, '--host-sysfs', {str(TWO_SOCKET)!r}, "
        "'--format', 'json'])\n"
        "assert rc == 0, rc\n"
        "loaded = sorted(m for m in ('libvirt', 'grpc', 'shim.server', 'shim.sandboxes') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def _with_annotations(tmp_path: Path, name: str, annotations: dict[str, str]) -> Path:
    doc = yaml.safe_load((MANIFESTS / name).read_text())
    doc.setdefault("metadata", {})["annotations"] = annotations
    out = tmp_path / name
    out.write_text(yaml.safe_dump(doc))
    return out


def test_plan_with_the_sidecar_annotation_agrees_with_the_shim(tmp_path: Path) -> None:
    manifest = _with_annotations(tmp_path, "init-hugepages-pod.yaml", {"io.vmsandbox/sidecars": "log-shipper"})
    code, doc = vmsandbox_json("plan", manifest, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES)
    assert code == 0
    assert (doc["demand"]["cpu_millis"], doc["demand"]["memory_bytes"]) == (1100, 160 * MI)
    assert not any("io.vmsandbox/sidecars" in note for note in doc["notes"])


def test_plan_sidecar_annotation_naming_an_app_container_is_refused(tmp_path: Path) -> None:
    manifest = _with_annotations(tmp_path, "init-hugepages-pod.yaml", {"io.vmsandbox/sidecars": "forwarder"})
    code, doc = vmsandbox_json("plan", manifest, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES)
    assert code == 1
    assert doc["refusal"]["reason"] == (
        "annotation io.vmsandbox/sidecars: 'forwarder' is not an init container of pod_resources (init containers: "
        "'setup', 'log-shipper') (the shim refuses RunPodSandbox with INVALID_ARGUMENT)"
    )


def test_plan_counts_the_runtimeclass_overhead(tmp_path: Path) -> None:
    """spec.overhead (what the kubelet sends as LinuxPodSandboxConfig.overhead) replaces the smaller
    profile overhead: 512Mi + 256Mi, and ceil(2 + 0.5) vCPUs."""
    doc = yaml.safe_load((MANIFESTS / "guaranteed-pod.yaml").read_text())
    doc["spec"]["overhead"] = {"cpu": "500m", "memory": "256Mi"}
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    code, plan = vmsandbox_json("plan", manifest, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES)
    assert code == 0
    assert plan["demand"]["overhead"] == {"cpu_millis": 500, "memory_bytes": 256 * MI}
    assert (plan["shape"]["vcpus"], plan["shape"]["memory_bytes"]) == (3, 768 * MI)


def test_plan_unwraps_a_list(tmp_path: Path) -> None:
    """``kubectl get pods -o yaml`` prints ``kind: List``; its items are the documents."""
    pod = yaml.safe_load((MANIFESTS / "burstable-pod.yaml").read_text())
    [deployment] = [
        d for d in yaml.safe_load_all((MANIFESTS / "deployment.yaml").read_text()) if d["kind"] == "Deployment"
    ]
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [pod]}))
    code, doc = vmsandbox_json("plan", one, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES)
    assert (code, doc["pod"]["name"]) == (0, "api")
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [deployment, pod]}))
    done = vmsandbox("plan", two, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES)
    assert done.returncode == 2
    assert "holds 2 pod templates (0: Deployment/cache, 1: Pod/api); choose one with --document N" in done.stderr
    code, doc = vmsandbox_json("plan", two, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES, "--document", "1")
    assert (code, doc["pod"]["name"]) == (0, "api")
    done = vmsandbox("plan", two, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES, "--document", "2")
    assert done.returncode == 2
    assert "--document 2 is out of range: the manifest holds 2 pods" in done.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        pytest.param(("--state-dir", "/nonexistent/state"), "no state database at", id="missing-state-dir"),
        pytest.param(("--config", "/nonexistent/config.yaml"), "cannot read", id="missing-config"),
    ],
)
def test_plan_cannot_plan_exits_2(args: tuple[str, ...], message: str) -> None:
    """docs/install.md and --help: 0 fits, 1 refused, 2 bad input (no plan could be made)."""
    done = vmsandbox("plan", MANIFESTS / "guaranteed-pod.yaml", "--host-sysfs", TWO_SOCKET, *args)
    assert (done.returncode, done.stdout) == (2, "")
    assert message in done.stderr


@pytest.mark.parametrize(
    ("pod_resources", "container_limits", "want"),
    [
        # KEP-2837 pod-level limits, containers without their own: the VM is the pod-level figure
        pytest.param({"cpu": "3", "memory": "768Mi"}, [None, None], (3000, 768 * MI), id="pod-level-only"),
        # a pod-level memory limit beside containers' own cpu limits: each resource on its own
        pytest.param({"memory": "1Gi"}, [{"cpu": "500m"}, {"cpu": "1"}], (1500, GI), id="memory-at-pod-level"),
    ],
)
def test_plan_sizes_a_pod_with_pod_level_limits_from_them_as_the_kubelet_sends_them(
    tmp_path: Path, pod_resources: dict[str, str], container_limits: list[dict[str, str] | None], want: tuple[int, int]
) -> None:
    """A kubelet sends pod-level limits (``spec.resources``) as LinuxPodSandboxConfig.resources, with
    no pod_resources: the plan sizes the VM that way (mode ``linux-resources``) and says so."""
    doc = yaml.safe_load((MANIFESTS / "guaranteed-pod.yaml").read_text())
    spec = doc["spec"]
    spec["resources"] = {"limits": pod_resources}
    first = spec["containers"][0]
    spec["containers"] = [
        {**first, "name": f"c{i}", "resources": {"limits": limits} if limits else {}}
        for i, limits in enumerate(container_limits)
    ]
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    code, plan = vmsandbox_json("plan", manifest, "--host-sysfs", TWO_SOCKET, "--profiles", PROFILES)
    assert code == 0, plan
    assert (plan["demand"]["mode"], plan["demand"]["cpu_millis"], plan["demand"]["memory_bytes"]) == (
        "linux-resources",
        *want,
    ), plan["demand"]
    assert any("pod-level resources" in n for n in plan["notes"]), plan["notes"]
