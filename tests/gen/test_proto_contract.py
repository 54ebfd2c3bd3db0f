"""The CRI wire contract: field numbers, services, unknown fields, generated code.

The numbers below are the ones k8s.io/cri-api (runtime.v1) uses, plus the KEP-4112
extension described in docs/sizing-and-admission.md and proto/. A kubelet, crictl or critest only
interoperates with us if these match, so a change here is a change of the wire format.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import descriptor_pb2
from google.protobuf.message import Message

from gen.cri.apimachinery.resource import generated_pb2 as resource_pb2
from gen.cri.runtime.v1 import api_pb2, api_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen-proto.sh"
GENERATED_ROOT = REPO_ROOT / "gen" / "cri"

# ---------------------------------------------------------------------------
# Field numbers
# ---------------------------------------------------------------------------

# (message, field, number)
FIELD_NUMBERS: list[tuple[str, str, int]] = [
    # KEP-4112 extension.
    ("PodSandboxConfig", "pod_resources", 10),
    ("PodResourceConfig", "init_containers", 1),
    ("PodResourceConfig", "containers", 2),
    ("ContainerResourceConfig", "name", 1),
    ("ContainerResourceConfig", "kubernetes_resources", 2),
    ("ContainerResourceConfig", "mounts", 3),
    ("ContainerResourceConfig", "devices", 4),
    ("ContainerResourceConfig", "CDI_devices", 5),
    ("KubernetesResources", "requests", 1),
    ("KubernetesResources", "limits", 2),
    ("ContainerConfig", "kubernetes_resources", 19),
    ("UpdateContainerResourcesRequest", "kubernetes_resources", 5),
    # Upstream fields the sizing and admission code reads.
    ("PodSandboxConfig", "metadata", 1),
    ("PodSandboxConfig", "hostname", 2),
    ("PodSandboxConfig", "log_directory", 3),
    ("PodSandboxConfig", "labels", 6),
    ("PodSandboxConfig", "annotations", 7),
    ("PodSandboxConfig", "linux", 8),
    ("PodSandboxConfig", "windows", 9),
    ("PodSandboxMetadata", "name", 1),
    ("PodSandboxMetadata", "uid", 2),
    ("PodSandboxMetadata", "namespace", 3),
    ("PodSandboxMetadata", "attempt", 4),
    ("RunPodSandboxRequest", "config", 1),
    ("RunPodSandboxRequest", "runtime_handler", 2),
    ("LinuxPodSandboxConfig", "cgroup_parent", 1),
    ("LinuxPodSandboxConfig", "security_context", 2),
    ("LinuxPodSandboxConfig", "sysctls", 3),
    ("LinuxPodSandboxConfig", "overhead", 4),
    ("LinuxPodSandboxConfig", "resources", 5),
    ("LinuxSandboxSecurityContext", "namespace_options", 1),
    ("LinuxSandboxSecurityContext", "run_as_group", 8),
    ("LinuxSandboxSecurityContext", "supplemental_groups_policy", 11),
    ("NamespaceOption", "network", 1),
    ("NamespaceOption", "pid", 2),
    ("NamespaceOption", "ipc", 3),
    ("NamespaceOption", "target_id", 4),
    ("NamespaceOption", "userns_options", 5),
    ("LinuxContainerResources", "cpu_period", 1),
    ("LinuxContainerResources", "cpu_quota", 2),
    ("LinuxContainerResources", "cpu_shares", 3),
    ("LinuxContainerResources", "memory_limit_in_bytes", 4),
    ("LinuxContainerResources", "oom_score_adj", 5),
    ("LinuxContainerResources", "cpuset_cpus", 6),
    ("LinuxContainerResources", "cpuset_mems", 7),
    ("LinuxContainerResources", "hugepage_limits", 8),
    ("LinuxContainerResources", "unified", 9),
    ("LinuxContainerResources", "memory_swap_limit_in_bytes", 10),
    ("HugepageLimit", "page_size", 1),
    ("HugepageLimit", "limit", 2),
    ("ContainerConfig", "metadata", 1),
    ("ContainerConfig", "image", 2),
    ("ContainerConfig", "mounts", 7),
    ("ContainerConfig", "devices", 8),
    ("ContainerConfig", "annotations", 10),
    ("ContainerConfig", "linux", 15),
    ("ContainerConfig", "CDI_devices", 17),
    ("ContainerConfig", "stop_signal", 18),
    ("ContainerMetadata", "name", 1),
    ("ContainerMetadata", "attempt", 2),
    ("LinuxContainerConfig", "resources", 1),
    ("LinuxContainerConfig", "security_context", 2),
    ("CreateContainerRequest", "pod_sandbox_id", 1),
    ("CreateContainerRequest", "config", 2),
    ("CreateContainerRequest", "sandbox_config", 3),
    ("UpdateContainerResourcesRequest", "container_id", 1),
    ("UpdateContainerResourcesRequest", "linux", 2),
    ("UpdateContainerResourcesRequest", "windows", 3),
    ("UpdateContainerResourcesRequest", "annotations", 4),
    ("Mount", "container_path", 1),
    ("Mount", "host_path", 2),
    ("Mount", "readonly", 3),
    ("Mount", "selinux_relabel", 4),
    ("Mount", "propagation", 5),
    ("Mount", "uidMappings", 6),
    ("Mount", "gidMappings", 7),
    ("Mount", "recursive_read_only", 8),
    ("Mount", "image", 9),
    ("Mount", "image_sub_path", 10),
    ("Device", "container_path", 1),
    ("Device", "host_path", 2),
    ("Device", "permissions", 3),
    ("CDIDevice", "name", 1),
    ("ImageSpec", "image", 1),
    ("ImageSpec", "annotations", 2),
    ("ImageSpec", "user_specified_image", 18),
    ("ImageSpec", "runtime_handler", 19),
    ("ImageSpec", "image_ref", 20),
    ("ContainerFilter", "id", 1),
    ("ContainerFilter", "state", 2),
    ("ContainerFilter", "pod_sandbox_id", 3),
    ("ContainerFilter", "label_selector", 4),
    ("PodSandboxFilter", "id", 1),
    ("PodSandboxFilter", "state", 2),
    ("PodSandboxFilter", "label_selector", 3),
    ("PodSandboxStateValue", "state", 1),
    ("ContainerStateValue", "state", 1),
    ("PodSandboxStatus", "runtime_handler", 9),
    ("PodSandboxStatusResponse", "containers_statuses", 3),
    ("ContainerStatus", "resources", 16),
    ("ContainerStatus", "image_id", 17),
    ("ContainerStatus", "stop_signal", 19),
    ("Container", "image_id", 10),
    ("VersionResponse", "runtime_api_version", 4),
    ("RuntimeCondition", "type", 1),
    ("RuntimeCondition", "status", 2),
    ("StatusResponse", "runtime_handlers", 3),
    ("StatusResponse", "features", 4),
    ("FilesystemUsage", "timestamp", 1),
    ("FilesystemUsage", "fs_id", 2),
    ("FilesystemUsage", "used_bytes", 3),
    ("FilesystemUsage", "inodes_used", 4),
    ("ImageFsInfoResponse", "image_filesystems", 1),
    ("ImageFsInfoResponse", "container_filesystems", 2),
    ("PullImageRequest", "sandbox_config", 3),
    ("UpdatePodSandboxResourcesRequest", "overhead", 2),
    ("UpdatePodSandboxResourcesRequest", "resources", 3),
]


def _message_descriptor(name: str) -> _descriptor.Descriptor:
    return api_pb2.DESCRIPTOR.message_types_by_name[name]


@pytest.mark.parametrize(
    ("message", "field", "number"),
    FIELD_NUMBERS,
    ids=[f"{m}.{f}={n}" for m, f, n in FIELD_NUMBERS],
)
def test_field_number(message: str, field: str, number: int) -> None:
    fields = _message_descriptor(message).fields_by_name
    assert field in fields, f"runtime.v1.{message} has no field {field!r}"
    assert fields[field].number == number


# (message, field, full name of the field's message type, repeated)
KEP_FIELD_TYPES: list[tuple[str, str, str, bool]] = [
    ("PodSandboxConfig", "pod_resources", "runtime.v1.PodResourceConfig", False),
    ("PodResourceConfig", "init_containers", "runtime.v1.ContainerResourceConfig", True),
    ("PodResourceConfig", "containers", "runtime.v1.ContainerResourceConfig", True),
    ("ContainerResourceConfig", "kubernetes_resources", "runtime.v1.KubernetesResources", False),
    ("ContainerResourceConfig", "mounts", "runtime.v1.Mount", True),
    ("ContainerResourceConfig", "devices", "runtime.v1.Device", True),
    ("ContainerResourceConfig", "CDI_devices", "runtime.v1.CDIDevice", True),
    ("ContainerConfig", "kubernetes_resources", "runtime.v1.KubernetesResources", False),
    ("UpdateContainerResourcesRequest", "kubernetes_resources", "runtime.v1.KubernetesResources", False),
]


@pytest.mark.parametrize(
    ("message", "field", "type_name", "repeated"),
    KEP_FIELD_TYPES,
    ids=[f"{m}.{f}" for m, f, _, _ in KEP_FIELD_TYPES],
)
def test_kep4112_field_type(message: str, field: str, type_name: str, repeated: bool) -> None:
    fd = _message_descriptor(message).fields_by_name[field]
    assert fd.message_type is not None
    assert fd.message_type.full_name == type_name
    assert fd.is_repeated == repeated


@pytest.mark.parametrize("field", ["requests", "limits"])
def test_kubernetes_resources_maps_quantities(field: str) -> None:
    fd = _message_descriptor("KubernetesResources").fields_by_name[field]
    entry = fd.message_type
    assert entry is not None and entry.GetOptions().map_entry
    assert entry.fields_by_name["key"].type == _descriptor.FieldDescriptor.TYPE_STRING
    value_type = entry.fields_by_name["value"].message_type
    assert value_type is not None
    assert value_type.full_name == "k8s.io.apimachinery.pkg.api.resource.Quantity"


def test_quantity_is_upstream_proto2_message() -> None:
    quantity = resource_pb2.Quantity.DESCRIPTOR
    assert resource_pb2.DESCRIPTOR.package == "k8s.io.apimachinery.pkg.api.resource"
    assert quantity.full_name == "k8s.io.apimachinery.pkg.api.resource.Quantity"
    assert [(f.name, f.number) for f in quantity.fields] == [("string", 1)]
    assert quantity.fields_by_name["string"].has_presence
    # Presence is observable, as in Go: unset differs from "".
    assert not resource_pb2.Quantity().HasField("string")
    assert resource_pb2.Quantity(string="").HasField("string")


# (enum, value name, number)
ENUM_VALUES: list[tuple[str, str, int]] = [
    ("PodSandboxState", "SANDBOX_READY", 0),
    ("PodSandboxState", "SANDBOX_NOTREADY", 1),
    ("ContainerState", "CONTAINER_CREATED", 0),
    ("ContainerState", "CONTAINER_RUNNING", 1),
    ("ContainerState", "CONTAINER_EXITED", 2),
    ("ContainerState", "CONTAINER_UNKNOWN", 3),
    ("NamespaceMode", "POD", 0),
    ("NamespaceMode", "CONTAINER", 1),
    ("NamespaceMode", "NODE", 2),
    ("NamespaceMode", "TARGET", 3),
    ("MountPropagation", "PROPAGATION_PRIVATE", 0),
    ("MountPropagation", "PROPAGATION_HOST_TO_CONTAINER", 1),
    ("MountPropagation", "PROPAGATION_BIDIRECTIONAL", 2),
    ("Protocol", "TCP", 0),
    ("Protocol", "UDP", 1),
    ("Protocol", "SCTP", 2),
    ("Signal", "SIGNAL_RUNTIME_DEFAULT", 0),
    ("Signal", "SIGNAL_SIGKILL", 13),
    ("Signal", "SIGNAL_SIGTERM", 23),
    ("Signal", "SIGNAL_SIGRTMAX", 65),
    ("CgroupDriver", "SYSTEMD", 0),
    ("CgroupDriver", "CGROUPFS", 1),
    ("ContainerEventType", "CONTAINER_CREATED_EVENT", 0),
    ("ContainerEventType", "CONTAINER_DELETED_EVENT", 3),
]


@pytest.mark.parametrize(
    ("enum", "name", "number"),
    ENUM_VALUES,
    ids=[f"{e}.{n}={v}" for e, n, v in ENUM_VALUES],
)
def test_enum_value(enum: str, name: str, number: int) -> None:
    values = api_pb2.DESCRIPTOR.enum_types_by_name[enum].values_by_name
    assert values[name].number == number


# ---------------------------------------------------------------------------
# Services
# ---------------------------------------------------------------------------

RUNTIME_METHODS = [
    "Version",
    "RunPodSandbox",
    "StopPodSandbox",
    "RemovePodSandbox",
    "PodSandboxStatus",
    "ListPodSandbox",
    "StreamPodSandboxes",
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "RemoveContainer",
    "ListContainers",
    "StreamContainers",
    "ContainerStatus",
    "UpdateContainerResources",
    "ReopenContainerLog",
    "ExecSync",
    "Exec",
    "Attach",
    "PortForward",
    "ContainerStats",
    "ListContainerStats",
    "StreamContainerStats",
    "PodSandboxStats",
    "ListPodSandboxStats",
    "StreamPodSandboxStats",
    "UpdateRuntimeConfig",
    "Status",
    "CheckpointContainer",
    "CheckpointPod",
    "RestorePod",
    "GetContainerEvents",
    "ListMetricDescriptors",
    "ListPodSandboxMetrics",
    "StreamPodSandboxMetrics",
    "RuntimeConfig",
    "UpdatePodSandboxResources",
]
IMAGE_METHODS = ["ListImages", "StreamImages", "ImageStatus", "PullImage", "RemoveImage", "ImageFsInfo"]

# Every other method is unary-unary; none is client-streaming.
SERVER_STREAMING = {
    "runtime.v1.RuntimeService": {
        "GetContainerEvents",
        "StreamPodSandboxes",
        "StreamContainers",
        "StreamContainerStats",
        "StreamPodSandboxStats",
        "StreamPodSandboxMetrics",
    },
    "runtime.v1.ImageService": {"StreamImages"},
}

SERVICES = [
    ("RuntimeService", "runtime.v1.RuntimeService", RUNTIME_METHODS),
    ("ImageService", "runtime.v1.ImageService", IMAGE_METHODS),
]


def test_package_name() -> None:
    assert api_pb2.DESCRIPTOR.package == "runtime.v1"
    assert api_pb2.DESCRIPTOR.name == "gen/cri/runtime/v1/api.proto"
    assert set(api_pb2.DESCRIPTOR.services_by_name) == {"RuntimeService", "ImageService"}


@pytest.mark.parametrize(("service", "full_name", "methods"), SERVICES, ids=[s[0] for s in SERVICES])
def test_service_methods(service: str, full_name: str, methods: list[str]) -> None:
    sd = api_pb2.DESCRIPTOR.services_by_name[service]
    assert sd.full_name == full_name
    assert [m.name for m in sd.methods] == methods
    for m in sd.methods:
        assert not m.client_streaming, m.full_name
        assert m.server_streaming == (m.name in SERVER_STREAMING[full_name]), m.full_name


@pytest.mark.parametrize(("service", "full_name", "methods"), SERVICES, ids=[s[0] for s in SERVICES])
def test_grpc_stubs_cover_every_method(service: str, full_name: str, methods: list[str]) -> None:
    servicer = getattr(api_pb2_grpc, f"{service}Servicer")
    assert callable(getattr(api_pb2_grpc, f"add_{service}Servicer_to_server"))
    for name in methods:
        assert callable(getattr(servicer, name, None)), f"{full_name}/{name}"


@pytest.mark.parametrize(
    ("method", "request_type", "response_type"),
    [
        ("RunPodSandbox", "RunPodSandboxRequest", "RunPodSandboxResponse"),
        ("CreateContainer", "CreateContainerRequest", "CreateContainerResponse"),
        ("UpdateContainerResources", "UpdateContainerResourcesRequest", "UpdateContainerResourcesResponse"),
        ("Status", "StatusRequest", "StatusResponse"),
        ("GetContainerEvents", "GetEventsRequest", "ContainerEventResponse"),
    ],
    ids=["RunPodSandbox", "CreateContainer", "UpdateContainerResources", "Status", "GetContainerEvents"],
)
def test_method_types(method: str, request_type: str, response_type: str) -> None:
    md = api_pb2.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name[method]
    assert md.input_type.full_name == f"runtime.v1.{request_type}"
    assert md.output_type.full_name == f"runtime.v1.{response_type}"


# ---------------------------------------------------------------------------
# Every name, number and type as upstream cri-api has it
# ---------------------------------------------------------------------------

UPSTREAM_TABLE = REPO_ROOT / "tests" / "fixtures" / "cri-api" / "runtime-v1.tsv"

# What we add to upstream's runtime.v1: the KEP-4112 extension, nothing else.
KEP4112_LINES = {
    "field\tPodSandboxConfig\tpod_resources\t10\truntime.v1.PodResourceConfig\toptional",
    "field\tContainerConfig\tkubernetes_resources\t19\truntime.v1.KubernetesResources\toptional",
    "field\tUpdateContainerResourcesRequest\tkubernetes_resources\t5\truntime.v1.KubernetesResources\toptional",
    "field\tPodResourceConfig\tinit_containers\t1\truntime.v1.ContainerResourceConfig\trepeated",
    "field\tPodResourceConfig\tcontainers\t2\truntime.v1.ContainerResourceConfig\trepeated",
    "field\tContainerResourceConfig\tname\t1\tstring\toptional",
    "field\tContainerResourceConfig\tkubernetes_resources\t2\truntime.v1.KubernetesResources\toptional",
    "field\tContainerResourceConfig\tmounts\t3\truntime.v1.Mount\trepeated",
    "field\tContainerResourceConfig\tdevices\t4\truntime.v1.Device\trepeated",
    "field\tContainerResourceConfig\tCDI_devices\t5\truntime.v1.CDIDevice\trepeated",
    "field\tKubernetesResources\trequests\t1\truntime.v1.KubernetesResources.RequestsEntry\trepeated",
    "field\tKubernetesResources\tlimits\t2\truntime.v1.KubernetesResources.LimitsEntry\trepeated",
    "field\tKubernetesResources.RequestsEntry\tkey\t1\tstring\toptional",
    "field\tKubernetesResources.RequestsEntry\tvalue\t2\tk8s.io.apimachinery.pkg.api.resource.Quantity\toptional",
    "field\tKubernetesResources.LimitsEntry\tkey\t1\tstring\toptional",
    "field\tKubernetesResources.LimitsEntry\tvalue\t2\tk8s.io.apimachinery.pkg.api.resource.Quantity\toptional",
}

_TYPE_NAMES = {v: k[len("TYPE_") :].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}
_LABEL_NAMES = {v: k[len("LABEL_") :].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Label.items()}


def _contract_lines(f: descriptor_pb2.FileDescriptorProto) -> set[str]:
    """The same lines scripts/cri-api-table.py prints, from our compiled descriptor."""
    lines: set[str] = set()

    def walk(
        prefix: str,
        messages: Iterable[descriptor_pb2.DescriptorProto],
        enums: Iterable[descriptor_pb2.EnumDescriptorProto],
    ) -> None:
        for e in enums:
            lines.update(f"enum\t{prefix}{e.name}\t{v.name}\t{v.number}" for v in e.value)
        for m in messages:
            for fd in m.field:
                kind = fd.type_name.lstrip(".") if fd.type_name else _TYPE_NAMES[fd.type]
                label = "proto3-optional" if fd.proto3_optional else _LABEL_NAMES[fd.label]
                lines.add(f"field\t{prefix}{m.name}\t{fd.name}\t{fd.number}\t{kind}\t{label}")
            walk(f"{prefix}{m.name}.", m.nested_type, m.enum_type)

    walk("", f.message_type, f.enum_type)
    for s in f.service:
        for md in s.method:
            stream = "server-stream" if md.server_streaming else "unary"
            lines.add(f"rpc\t{s.name}\t{md.name}\t{md.input_type.lstrip('.')}\t{md.output_type.lstrip('.')}\t{stream}")
    return lines


def _upstream_lines() -> set[str]:
    return {line for line in UPSTREAM_TABLE.read_text().splitlines() if line and not line.startswith("#")}


def test_matches_upstream_cri_api_outside_kep4112() -> None:
    ours = _contract_lines(descriptor_pb2.FileDescriptorProto.FromString(api_pb2.DESCRIPTOR.serialized_pb))
    upstream = _upstream_lines()
    assert ours >= KEP4112_LINES
    missing = sorted(upstream - ours)
    extra = sorted(ours - upstream - KEP4112_LINES)
    assert not missing and not extra, (
        "runtime.v1 differs from upstream cri-api (tests/fixtures/cri-api/runtime-v1.tsv):\n"
        + "\n".join([f"  upstream only: {line}" for line in missing] + [f"  ours only: {line}" for line in extra])
    )


def test_env_value_is_bytes_as_upstream() -> None:
    """A non-UTF-8 environment value parses (it was INTERNAL "Exception deserializing request")."""
    wire = _len_field(6, _len_field(1, b"K") + _len_field(2, b"\xff\xfe not utf-8"))
    config = api_pb2.ContainerConfig.FromString(wire)
    assert config.envs[0].value == b"\xff\xfe not utf-8"


# ---------------------------------------------------------------------------
# Unknown fields survive a parse/serialise round trip
# ---------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _len_field(number: int, payload: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return _tag(number, 0) + _varint(value)


# Fields a newer peer might send that we do not declare: every wire type.
_UNKNOWN_VARINT = _varint_field(4112, 300)
_UNKNOWN_FIXED64 = _tag(901, 1) + bytes(range(8))
_UNKNOWN_FIXED32 = _tag(902, 5) + b"\x01\x02\x03\x04"
_UNKNOWN_BYTES = _len_field(903, b"\x00\xffnot utf-8 \xc3")
_UNKNOWN_GROUP_OF_ALL = _UNKNOWN_VARINT + _UNKNOWN_FIXED64 + _UNKNOWN_FIXED32 + _UNKNOWN_BYTES

_METADATA = _len_field(1, _len_field(1, b"pod-a") + _len_field(2, b"uid-1") + _len_field(3, b"default"))

# (id, message type, wire bytes holding declared fields in number order, then unknown ones)
UNKNOWN_FIELD_CASES: list[tuple[str, type[Message], bytes]] = [
    ("top-level-varint", api_pb2.VersionRequest, _len_field(1, b"v1") + _UNKNOWN_VARINT),
    ("top-level-every-wire-type", api_pb2.PodSandboxConfig, _METADATA + _UNKNOWN_GROUP_OF_ALL),
    ("only-unknown", api_pb2.StatusRequest, _UNKNOWN_BYTES),
    (
        # A LinuxPodSandboxConfig from a newer kubelet, with a field 6 we do not know.
        "nested-in-linux-config",
        api_pb2.PodSandboxConfig,
        _METADATA + _len_field(8, _len_field(1, b"/kubepods/pod1") + _varint_field(6, 1)),
    ),
    (
        "nested-in-kep-resources",
        api_pb2.ContainerConfig,
        _len_field(
            19,
            _len_field(
                1,
                _len_field(1, b"cpu") + _len_field(2, _len_field(1, b"500m") + _varint_field(7, 1)),
            )
            + _UNKNOWN_FIXED32,
        ),
    ),
    (
        "proto2-quantity",
        resource_pb2.Quantity,
        _len_field(1, b"2Gi") + _UNKNOWN_VARINT,
    ),
]


@pytest.mark.parametrize(
    ("message_type", "wire"),
    [(t, w) for _, t, w in UNKNOWN_FIELD_CASES],
    ids=[i for i, _, _ in UNKNOWN_FIELD_CASES],
)
def test_unknown_fields_survive_round_trip(message_type: type[Message], wire: bytes) -> None:
    msg = message_type()
    msg.ParseFromString(wire)
    assert msg.SerializeToString() == wire
    # And through a copy, as a servicer that stores configs would do.
    clone = message_type()
    clone.CopyFrom(msg)
    assert clone.SerializeToString() == wire


def test_unknown_fields_do_not_shadow_declared_ones() -> None:
    cfg = api_pb2.ContainerConfig()
    cfg.ParseFromString(_len_field(1, _len_field(1, b"app")) + _UNKNOWN_VARINT)
    assert cfg.metadata.name == "app"
    assert not cfg.HasField("kubernetes_resources")


def test_kep_fields_round_trip() -> None:
    cfg = api_pb2.PodSandboxConfig()
    cfg.metadata.name = "pod-a"
    app = cfg.pod_resources.containers.add(name="app")
    app.kubernetes_resources.requests["cpu"].string = "500m"
    app.kubernetes_resources.limits["hugepages-2Mi"].string = "1Gi"
    app.CDI_devices.add(name="vendor.com/gpu=gpu0")
    cfg.pod_resources.init_containers.add(name="init")

    again = api_pb2.PodSandboxConfig.FromString(cfg.SerializeToString())
    assert again == cfg
    assert again.pod_resources.containers[0].kubernetes_resources.requests["cpu"].string == "500m"


# ---------------------------------------------------------------------------
# Generated code is up to date
# ---------------------------------------------------------------------------

_GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _generated_files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name.endswith(_GENERATED_SUFFIXES)}


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed, cannot regenerate the CRI stubs")

    env = dict(os.environ, PYTHON=sys.executable)
    result = subprocess.run(
        ["bash", str(GEN_SCRIPT), str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"gen-proto.sh failed:\n{result.stdout}\n{result.stderr}"

    fresh_root = tmp_path / "gen" / "cri"
    fresh = _generated_files(fresh_root)
    committed = _generated_files(GENERATED_ROOT)
    assert fresh, "gen-proto.sh produced no files"
    assert committed == fresh, (
        "generated files differ in name; run scripts/gen-proto.sh "
        f"(missing: {sorted(map(str, fresh - committed))}, stale: {sorted(map(str, committed - fresh))})"
    )
    stale = [
        str(rel) for rel in sorted(fresh) if not filecmp.cmp(fresh_root / rel, GENERATED_ROOT / rel, shallow=False)
    ]
    assert not stale, f"generated code is out of date, run scripts/gen-proto.sh: {stale}"
