"""Malformed and hostile CRI requests, one table row each, through the real gRPC server.

Each row is a request that once answered INTERNAL (with a traceback), deleted a file it named,
forged a log line, or echoed megabytes back; now it answers the right status with a message that
names the field and stays short. The server is ``tests/cri_server.py`` (production servicers,
real ledger, libvirt's test driver).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from gen.cri.apimachinery.resource.generated_pb2 import Quantity
from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import SANDBOX_NOTREADY, SANDBOX_READY
from shim.translate import inbound
from tests.cri_server import (
    SEED_CONTAINER,
    SEED_LOG_DIRECTORY,
    SEED_SANDBOXES,
    Server,
    assert_no_leak,
    cri_server,
    seed,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
OK = grpc.StatusCode.OK


@pytest.fixture(scope="module")
def module_server() -> Iterator[Server]:
    with cri_server() as s:
        yield s


@pytest.fixture
def server(module_server: Server) -> Server:
    seed(module_server.sandboxes)
    return module_server


def run_request(**overrides: object) -> pb.RunPodSandboxRequest:
    """A RunPodSandbox a kubelet could send, with one thing changed."""
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="web", namespace="default", uid="2b7e1c3a-uid"),
        log_directory="/var/log/pods/default_web_uid",
        labels={"app": "web"},
    )
    md = config.metadata
    for key, value in overrides.items():
        if key in ("name", "namespace", "uid"):
            setattr(md, key, value)
        elif key == "labels":
            config.labels.clear()
            config.labels.update(value)  # type: ignore[call-overload]
        elif key == "annotations":
            config.annotations.update(value)  # type: ignore[call-overload]
        elif key == "hugepage":
            config.linux.resources.hugepage_limits.add(page_size=value, limit=2 << 20)
        elif key == "resource":
            c = config.pod_resources.containers.add(name="app")
            c.kubernetes_resources.requests[str(value)].CopyFrom(Quantity(string="1"))
        elif key == "device":
            c = config.pod_resources.containers.add(name="app")
            c.kubernetes_resources.requests["cpu"].CopyFrom(Quantity(string="1"))
            c.devices.add(container_path="/dev/x", host_path=value, permissions="rw")
        else:
            setattr(config, key, value)
    return pb.RunPodSandboxRequest(config=config)


RUN_CASES = [
    pytest.param(run_request(name="we\x00b"), "PodSandboxConfig.metadata.name", id="nul-in-name"),
    pytest.param(run_request(namespace="de\x00fault"), "PodSandboxConfig.metadata.namespace", id="nul-in-namespace"),
    pytest.param(run_request(uid="u\x00id"), "PodSandboxConfig.metadata.uid", id="nul-in-uid"),
    pytest.param(run_request(name="web\nFORGED ERROR line"), "PodSandboxConfig.metadata.name", id="newline-in-name"),
    pytest.param(run_request(name="web\ufffe"), "PodSandboxConfig.metadata.name", id="u+fffe-in-name"),
    pytest.param(run_request(name="web\x1b[31m"), "PodSandboxConfig.metadata.name", id="escape-in-name"),
    pytest.param(run_request(name="web_1"), "PodSandboxConfig.metadata.name", id="underscore-in-name"),
    pytest.param(run_request(name="a..b"), "PodSandboxConfig.metadata.name", id="empty-dns-label-in-name"),
    pytest.param(run_request(name="../etc"), "PodSandboxConfig.metadata.name", id="path-in-name"),
    pytest.param(run_request(name="x" * 13_000), "PodSandboxConfig.metadata.name", id="13k-name"),
    pytest.param(run_request(namespace="a.b"), "PodSandboxConfig.metadata.namespace", id="dotted-namespace"),
    pytest.param(run_request(uid="../../etc"), "PodSandboxConfig.metadata.uid", id="path-in-uid"),
    pytest.param(run_request(labels={"bad key": "v"}), "PodSandboxConfig.labels key", id="label-key-space"),
    pytest.param(run_request(labels={"a/b/c": "v"}), "PodSandboxConfig.labels key", id="label-key-two-slashes"),
    pytest.param(run_request(labels={"app": "v" * 64}), "PodSandboxConfig.labels[app]", id="label-value-64"),
    pytest.param(run_request(labels={"app": "a\nb"}), "PodSandboxConfig.labels[app]", id="label-value-newline"),
    pytest.param(run_request(annotations={"-x": "v"}), "PodSandboxConfig.annotations key", id="annotation-key"),
    pytest.param(
        run_request(annotations={"io.kubernetes.cri.sandbox-cpu-period": "\u0661\u0660\u0660"}),
        "io.kubernetes.cri.sandbox-cpu-period",
        id="arabic-indic-digits-in-annotation",
    ),
    pytest.param(
        run_request(annotations={"io.kubernetes.cri.sandbox-memory": "\uff11\uff12"}),
        "io.kubernetes.cri.sandbox-memory",
        id="fullwidth-digits-in-annotation",
    ),
    pytest.param(run_request(hugepage="0KB"), "hugepage size", id="hugepage-size-zero"),
    pytest.param(run_request(resource="x" * 100_000), "resource name", id="100k-resource-name"),
    pytest.param(run_request(resource="cpu\n"), "resource name", id="newline-in-resource-name"),
    pytest.param(run_request(hugepage="\u0662MB"), "hugepage size", id="hugepage-size-non-ascii"),
    pytest.param(run_request(device="/dev/vfio/\u00b2"), "cannot be passed into a VM", id="vfio-superscript-two"),
    pytest.param(run_request(log_directory="../logs"), "PodSandboxConfig.log_directory", id="relative-log-dir"),
    pytest.param(
        pb.RunPodSandboxRequest(config=run_request().config, runtime_handler="x\x00"),
        "runtime_handler",
        id="nul-in-handler",
    ),
]


@pytest.mark.parametrize(("request_", "field"), RUN_CASES)
def test_bad_run_pod_sandbox(server: Server, request_: pb.RunPodSandboxRequest, field: str) -> None:
    code, details, _ = server.rpc("RunPodSandbox", request_)
    assert code == INVALID, details
    assert field in details
    assert len(details) <= 1024
    assert "\n" not in details and "\x00" not in details
    assert_no_leak(server.sandboxes)


@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(run_request(), id="kubelet-like"),
        # cri-tools' critest names pods with capitals, and copies the name into the kubelet's label
        pytest.param(
            run_request(
                name="PodSandbox-with-attributes-6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f",
                namespace="cri-test-namespace6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f",
                uid="cri-test-uid6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f",
                labels={
                    "foo": "bar",
                    "io.kubernetes.pod.name": "PodSandbox-with-attributes-6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f",
                },
            ),
            id="critest-like",
        ),
    ],
)
def test_a_valid_run_still_gets_through(server: Server, request_: pb.RunPodSandboxRequest) -> None:
    code, details, _ = server.rpc("RunPodSandbox", request_)
    assert code == grpc.StatusCode.UNAVAILABLE and "rolled back" in details  # no guest image: past validation
    assert_no_leak(server.sandboxes)


# -- ids ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "code"),
    [
        pytest.param("ab\x00cd", INVALID, id="nul"),
        pytest.param("a" * (1 << 20), INVALID, id="1MB"),
        pytest.param("../victim", INVALID, id="dot-dot"),
        pytest.param("/tmp/victim", INVALID, id="absolute"),
        pytest.param("AB" * 32, OK, id="uppercase-names-nothing"),
        pytest.param("4451902d-de8f-4af8-b0e6-bb69b88ad8b9", OK, id="uuid-names-nothing"),  # critest's idempotence
        pytest.param("x" * 129, INVALID, id="129-chars"),
        pytest.param("ab", INVALID, id="ambiguous-prefix"),
        pytest.param("f" * 64, OK, id="unknown-id"),
        pytest.param("ff", OK, id="unknown-prefix"),
    ],
)
@pytest.mark.parametrize("rpc", ["StopPodSandbox", "RemovePodSandbox"])
def test_stop_and_remove_validate_the_id(server: Server, rpc: str, given: str, code: grpc.StatusCode) -> None:
    victims = [
        server.root / "victim.log",
        Path("/tmp/victim.log"),
        server.root / "console" / "victim.log",
        server.root / "console" / f"{'f' * 64}.log",  # id-shaped, but no sandbox of ours
    ]
    for v in victims:
        v.parent.mkdir(exist_ok=True)
        v.write_text("keep me")
    try:
        got, details, _ = server.rpc(rpc, pb.RemovePodSandboxRequest(pod_sandbox_id=given))
        assert got == code, details
        assert len(details) <= 1024
        assert all(v.exists() for v in victims), "a client string became a path"
        states = {sid: state for sid, state, _, _ in server.sandboxes.ledger.sandboxes()}
        assert all(states.get(sid) == SANDBOX_READY for sid in SEED_SANDBOXES)
    finally:
        for v in victims:
            v.unlink(missing_ok=True)


def test_a_unique_prefix_names_the_sandbox(server: Server) -> None:
    code, _, body = server.rpc("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id="abcd"))
    assert code == OK
    assert pb.PodSandboxStatusResponse.FromString(body).status.id == SEED_SANDBOXES[1]
    code, details, _ = server.rpc("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id="ab"))
    assert code == INVALID and "ambiguous" in details and "abababababab" in details
    code, details, _ = server.rpc("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id="ff"))
    assert code == grpc.StatusCode.NOT_FOUND, details

    # crictl stopp <prefix>: the sandbox named is the one stopped, and inspectp <prefix> finds it
    code, _, _ = server.rpc("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id="c0ffee1"))
    assert code == OK
    code, _, body = server.rpc("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id="c0ffee"))
    assert code == OK
    status = pb.PodSandboxStatusResponse.FromString(body).status
    assert (status.id, status.state) == (SEED_SANDBOXES[2], pb.SANDBOX_NOTREADY)
    rows = {sid: state for sid, state, _, _ in server.sandboxes.ledger.sandboxes()}
    assert rows[SEED_SANDBOXES[2]] == SANDBOX_NOTREADY

    code, _, body = server.rpc(
        "ListContainers", pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id="abab"))
    )
    assert [c.id for c in pb.ListContainersResponse.FromString(body).containers] == [SEED_CONTAINER]
    code, _, body = server.rpc("ContainerStatus", pb.ContainerStatusRequest(container_id="dede"))
    assert code == OK and pb.ContainerStatusResponse.FromString(body).status.id == SEED_CONTAINER
    code, _, _ = server.rpc("RemoveContainer", pb.RemoveContainerRequest(container_id="f" * 64))
    assert code == OK  # removing an unknown container succeeds, as in containerd
    code, details, _ = server.rpc("ContainerStatus", pb.ContainerStatusRequest(container_id="x\x00"))
    assert code == INVALID and "container_id" in details


# -- containers --------------------------------------------------------------------------------------
def create(
    server: Server, config: pb.ContainerConfig, sandbox: str = SEED_SANDBOXES[0]
) -> tuple[grpc.StatusCode, str, bytes]:
    return server.rpc("CreateContainer", pb.CreateContainerRequest(pod_sandbox_id=sandbox, config=config))


def test_relative_log_path_is_joined_with_the_log_directory(server: Server) -> None:
    config = pb.ContainerConfig(metadata=pb.ContainerMetadata(name="web"), log_path="web/0.log")
    # admitted and recorded (no guest runs here to start it in); a prefix names the sandbox
    assert server.containers is not None
    sandbox = server.sandboxes.records.get("abcd")
    cid = server.containers.admission.admit(sandbox, inbound.container_spec(config)).id
    code, details, body = server.rpc("ContainerStatus", pb.ContainerStatusRequest(container_id=cid))
    assert code == OK, details
    assert pb.ContainerStatusResponse.FromString(body).status.log_path == f"{SEED_LOG_DIRECTORY}/web/0.log"


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        pytest.param(
            pb.ContainerConfig(metadata=pb.ContainerMetadata(name="web"), log_path="../../../etc/cron.d/x"),
            "ContainerConfig.log_path",
            id="log-path-escapes",
        ),
        pytest.param(
            pb.ContainerConfig(metadata=pb.ContainerMetadata(name="web"), log_path="/etc/x.log"),
            "ContainerConfig.log_path",
            id="log-path-absolute",
        ),
        pytest.param(
            pb.ContainerConfig(metadata=pb.ContainerMetadata(name="we\x00b")),
            "ContainerConfig.metadata.name",
            id="nul-in-container-name",
        ),
        pytest.param(
            pb.ContainerConfig(metadata=pb.ContainerMetadata(name="a_b")),
            "ContainerConfig.metadata.name",
            id="underscore-container-name",
        ),
        pytest.param(
            pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="web"),
                devices=[pb.Device(container_path="/dev/kvm", host_path="/dev/kvm", permissions="rwm")],
            ),
            'device "/dev/kvm" cannot reach the guest',
            id="legacy-pod-names-dev-kvm",
        ),
        pytest.param(
            pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name="web"),
                devices=[pb.Device(container_path="/dev/sda", host_path="/dev/sda", permissions="r")],
            ),
            "host device nodes are never passed through",
            id="legacy-pod-names-a-disk",
        ),
    ],
)
def test_bad_create_container(server: Server, config: pb.ContainerConfig, needle: str) -> None:
    code, details, _ = create(server, config)
    assert code == INVALID, details
    assert needle in details


def test_a_sandbox_of_an_earlier_version_takes_no_new_container(server: Server) -> None:
    """A record naming no QEMU uid is a sandbox an earlier version started (QEMU as root, images
    over 9p, no root port for a disk): CreateContainer is FAILED_PRECONDITION naming the cause and
    the fix, and leaves no record; the same pod with a uid goes on to look up its image."""
    sid = SEED_SANDBOXES[1]
    record = server.sandboxes.records.get(sid)
    assert record.qemu_uid == 0
    # a name no other test of this module's server uses
    config = pb.ContainerConfig(metadata=pb.ContainerMetadata(name="late"), image=pb.ImageSpec(image="busybox"))
    code, details, _ = create(server, config, sid)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert f"sandbox {sid[:12]} was started by an earlier version" in details
    assert "takes no new container; recreate the pod" in details
    assert "late" not in {c.name for c in server.sandboxes.records.containers(sid)}
    current = replace(record, qemu_uid=2_000_000_000)
    server.sandboxes.ledger.put_sandbox(sid, current.state, current.created_ns, current.to_doc())
    server.sandboxes.records.reload()
    code, details, _ = create(server, config, sid)
    assert code == grpc.StatusCode.NOT_FOUND and "not pulled" in details, details


def test_critest_container_names_are_accepted(server: Server) -> None:
    name = "container-with-RunAsGroup-without-RunAsUser-test-6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f"  # 86
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name), labels={"io.kubernetes.container.name": name, "foo": "bar"}
    )
    assert server.containers is not None
    sandbox = server.sandboxes.records.get(SEED_SANDBOXES[0])
    assert server.containers.admission.admit(sandbox, inbound.container_spec(config))


def test_env_value_need_not_be_utf8(server: Server) -> None:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="env"), envs=[pb.KeyValue(key="K", value=b"A\xff\xfe")]
    )
    code, details, _ = create(server, config)
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), details
    assert "env" not in details.lower() and "utf" not in details.lower(), details
    run, _user, _signal = inbound.container_request(config, {})
    assert run.env == (("K", "A\ufffd\ufffd"),)  # as containerd's JSON encoding of the spec has it


def test_update_with_zero_hugepage_size(server: Server) -> None:
    request = pb.UpdateContainerResourcesRequest(
        container_id=SEED_CONTAINER,
        linux=pb.LinuxContainerResources(hugepage_limits=[pb.HugepageLimit(page_size="0KB", limit=0)]),
    )
    code, details, _ = server.rpc("UpdateContainerResources", request)
    assert code == INVALID and "hugepage size" in details


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\x0a\x05\x0a\x03\x0a\x01\xff", id="non-utf8-in-a-string"),
        pytest.param(b"\x0a\x05\x0a\x03", id="truncated"),
        pytest.param(b"\x0f\xff\xff", id="bad-tag"),
    ],
)
def test_undecodable_request_is_invalid_argument(server: Server, body: bytes) -> None:
    code, details, _ = server.rpc("RunPodSandbox", body)
    assert code == INVALID and "runtime.v1.RunPodSandboxRequest" in details


@pytest.mark.parametrize("rpc", ["StopContainer", "RemoveContainer"])
@pytest.mark.parametrize(
    ("given", "code"),
    [
        pytest.param("4451902d-de8f-4af8-b0e6-bb69b88ad8b9", OK, id="uuid-names-nothing"),
        pytest.param("f" * 64, OK, id="unknown-id"),
        pytest.param("ab\x00cd", INVALID, id="nul"),
        pytest.param("../victim", INVALID, id="dot-dot"),
    ],
)
def test_stop_and_remove_container_of_an_unknown_id_succeed(
    server: Server, rpc: str, given: str, code: grpc.StatusCode
) -> None:
    request = pb.StopContainerRequest(container_id=given) if rpc == "StopContainer" else None
    got, details, _ = server.rpc(rpc, request or pb.RemoveContainerRequest(container_id=given))
    assert got == code, details


def test_a_removed_container_leaves_no_lock_behind(server: Server) -> None:
    assert server.containers is not None
    server.containers.lock_for(SEED_CONTAINER)  # as a start or stop of it would
    code, _, _ = server.rpc("RemoveContainer", pb.RemoveContainerRequest(container_id=SEED_CONTAINER))
    assert code == grpc.StatusCode.OK
    assert SEED_CONTAINER not in server.containers._container_locks


def _userns(mode: pb.NamespaceMode.ValueType) -> pb.RunPodSandboxRequest:
    request = run_request()
    ns = request.config.linux.security_context.namespace_options
    ns.userns_options.mode = mode
    if mode == pb.POD:  # what a kubelet sends for hostUsers: false
        ns.userns_options.uids.add(host_id=65536, container_id=0, length=65536)
        ns.userns_options.gids.add(host_id=65536, container_id=0, length=65536)
    return request


def test_a_pod_user_namespace_and_the_nodes_are_accepted_and_other_modes_refused(server: Server) -> None:
    for mode in (pb.POD, pb.NODE):
        code, details, _ = server.rpc("RunPodSandbox", _userns(mode))
        assert code == grpc.StatusCode.UNAVAILABLE and "rolled back" in details  # no guest image: past validation
        assert_no_leak(server.sandboxes)
    code, details, _ = server.rpc("RunPodSandbox", _userns(pb.CONTAINER))
    assert code == INVALID and "userns_options.mode" in details
    empty = run_request()
    empty.config.linux.security_context.namespace_options.userns_options.mode = pb.POD  # mode POD, no mappings
    code, details, _ = server.rpc("RunPodSandbox", empty)
    assert code == INVALID and "userns_options.uids is empty" in details
    node_with_mappings = _userns(pb.POD)
    node_with_mappings.config.linux.security_context.namespace_options.userns_options.mode = pb.NODE
    code, details, _ = server.rpc("RunPodSandbox", node_with_mappings)
    assert code == INVALID and "mode NODE" in details and "takes no uids or gids" in details
    assert_no_leak(server.sandboxes)


def test_status_tells_the_kubelet_every_handler_takes_user_namespaces(server: Server) -> None:
    code, details, body = server.rpc("Status", pb.StatusRequest())
    assert code == grpc.StatusCode.OK, details
    handlers = pb.StatusResponse.FromString(body).runtime_handlers
    assert handlers and all(h.features.user_namespaces and h.features.recursive_read_only_mounts for h in handlers)


def test_an_idmapped_mount_without_a_user_namespace_is_refused(server: Server) -> None:
    mount = pb.Mount(container_path="/data", host_path="/tmp", uidMappings=[pb.IDMapping(host_id=1, length=1)])
    code, details, _ = create(server, pb.ContainerConfig(metadata=pb.ContainerMetadata(name="web"), mounts=[mount]))
    assert code == INVALID, details
    assert "uidMappings/gidMappings (an idmapped mount) need the container to have a user namespace" in details


@pytest.mark.parametrize(
    ("mount", "needle"),
    [
        pytest.param(
            pb.Mount(
                container_path="/data",
                image=pb.ImageSpec(image="registry.local/data:1"),
                propagation=pb.PROPAGATION_HOST_TO_CONTAINER,
            ),
            "an image volume's propagation must be PROPAGATION_PRIVATE",
            id="image-volume-propagation",
        ),
        pytest.param(
            pb.Mount(container_path="/data", image=pb.ImageSpec(image="registry.local/data:1"), mount_options=["x"]),
            "mount_options",
            id="image-volume-mount-options",
        ),
        pytest.param(
            pb.Mount(container_path="/data", host_path="/tmp", mount_options=["noexec"]),
            "mount_options",
            id="mount-options",
        ),
    ],
)
def test_mount_fields_not_implemented_are_refused_not_ignored(server: Server, mount: pb.Mount, needle: str) -> None:
    config = pb.ContainerConfig(metadata=pb.ContainerMetadata(name="web"), mounts=[mount])
    code, details, _ = create(server, config)
    assert code == grpc.StatusCode.UNIMPLEMENTED, details
    assert needle in details
