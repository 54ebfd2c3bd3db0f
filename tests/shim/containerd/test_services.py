"""What shim mode's services refuse before anything is made: bad ids, a missing or foreign pod
config, a rootfs for the sandbox, no network namespace, a bundle without a spec, checkpoints,
task options other than none or runc's fifo owner."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import any_pb2

from gen.containerd.runtime.sandbox.v1 import sandbox_pb2 as sb
from gen.containerd.runtime.task.v3 import shim_pb2 as task
from gen.containerd.types import mount_pb2
from gen.containerd.types.runc.options import oci_pb2 as runc_options
from gen.cri.runtime.v1 import api_pb2 as cri
from shim.containerd.sandbox_service import SandboxService, pod_sandbox_config
from shim.containerd.task_service import TaskService, oci_document, read_spec
from vmsandbox.errors import InvalidArgument, NotFound, Unsupported, WrongState

SID = "5" * 64
SPEC = "types.containerd.io/opencontainers/runtime-spec/1"


class NoPods:
    """Pods that hold nothing: a refusal must come before the core is asked anything else."""

    records = SimpleNamespace(find=lambda _: None, find_container=lambda _: None)


def runc_any(**fields: Any) -> any_pb2.Any:
    value = runc_options.Options(**fields).SerializeToString()
    return any_pb2.Any(type_url="containerd.runc.v1.Options", value=value)


def config_any(config: cri.PodSandboxConfig, type_url: str = "runtime.v1.PodSandboxConfig") -> any_pb2.Any:
    return any_pb2.Any(type_url=type_url, value=config.SerializeToString())


def pod_config() -> cri.PodSandboxConfig:
    return cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="p", namespace="n", uid="u-1"))


def userns_pod_config() -> cri.PodSandboxConfig:
    """A pod with a user namespace of its own (``hostUsers: false``)."""
    config = pod_config()
    mapping = [cri.IDMapping(host_id=65536, container_id=0, length=65536)]
    config.linux.security_context.namespace_options.userns_options.CopyFrom(
        cri.UserNamespace(mode=cri.POD, uids=mapping, gids=mapping)
    )
    return config


def test_the_pod_config_is_read_from_options() -> None:
    assert pod_sandbox_config(config_any(pod_config())).metadata.name == "p"


@pytest.mark.parametrize(
    ("request_", "error", "says"),
    [
        (sb.CreateSandboxRequest(sandbox_id="x", options=config_any(pod_config())), InvalidArgument, "64 hex"),
        (
            sb.CreateSandboxRequest(sandbox_id=SID, options=config_any(pod_config(), "runtime.v1.ContainerConfig")),
            InvalidArgument,
            "not a runtime.v1.PodSandboxConfig",
        ),
        (
            sb.CreateSandboxRequest(sandbox_id=SID, options=any_pb2.Any(type_url="runtime.v1.PodSandboxConfig",
                                                                        value=b"\xff\xff")),
            InvalidArgument,
            "not a PodSandboxConfig",
        ),
        (
            sb.CreateSandboxRequest(sandbox_id=SID, options=config_any(pod_config()),
                                    rootfs=[mount_pb2.Mount(type="bind", source="/x")]),
            Unsupported,
            "no sandbox container",
        ),
        (sb.CreateSandboxRequest(sandbox_id=SID, options=config_any(pod_config())), InvalidArgument, "netns_path"),
        (  # a pod with a user namespace of its own is taken: it gets as far as its network namespace
            sb.CreateSandboxRequest(sandbox_id=SID, options=config_any(userns_pod_config()), netns_path="relative"),
            InvalidArgument,
            "netns_path",
        ),
        (
            sb.CreateSandboxRequest(sandbox_id=SID, options=config_any(pod_config()), netns_path="relative"),
            InvalidArgument,
            "netns_path",
        ),
    ],
)  # fmt: skip
def test_create_sandbox_refuses(request_: sb.CreateSandboxRequest, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        SandboxService(NoPods(), "vmsandbox", None).create(request_)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["start", "platform", "status", "ping", "metrics", "update"])
def test_a_sandbox_it_does_not_run_is_not_found(method: str) -> None:
    service = SandboxService(NoPods(), "vmsandbox", None)  # type: ignore[arg-type]
    request: Any = SimpleNamespace(sandbox_id=SID, verbose=False)
    with pytest.raises(NotFound):
        getattr(service, method)(request)


def test_stop_and_shutdown_of_an_unknown_sandbox_succeed() -> None:
    service = SandboxService(NoPods(), "vmsandbox", None)  # type: ignore[arg-type]
    service.stop(sb.StopSandboxRequest(sandbox_id=SID))
    service.shutdown(sb.ShutdownSandboxRequest(sandbox_id=SID))


def tasks_service() -> TaskService:
    return TaskService(NoPods(), "vmsandbox", None, None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "error", "says"),
    [
        # refused as FAILED_PRECONDITION, not UNIMPLEMENTED: containerd would take that for "no task v3"
        (task.CreateTaskRequest(id=SID, checkpoint="/c"), WrongState, "checkpoints"),
        (task.CreateTaskRequest(id="../x"), InvalidArgument, "64 hex"),
        (task.CreateTaskRequest(id=SID, stdout="relative"), InvalidArgument, "absolute fifo path"),
        (task.CreateTaskRequest(id=SID, bundle="relative"), InvalidArgument, "bundle"),
        (task.CreateTaskRequest(id=SID), InvalidArgument, "bundle is empty"),
        # the task's options: none, or runc's with only the fifos' owner (then it gets as far as its bundle)
        (
            task.CreateTaskRequest(id=SID, options=runc_any(io_uid=1 << 20, io_gid=1 << 20)),
            InvalidArgument,
            "bundle is empty",
        ),
        (
            task.CreateTaskRequest(id=SID, options=runc_any(io_uid=1, systemd_cgroup=True)),
            InvalidArgument,
            "containerd.runc.v1.Options.systemd_cgroup is set",
        ),
        (
            task.CreateTaskRequest(id=SID, options=any_pb2.Any(type_url="runtimeoptions.v1.Options", value=b"")),
            InvalidArgument,
            "an older vmsandbox's drop-in",
        ),
    ],
)
def test_create_task_refuses(request_: task.CreateTaskRequest, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        tasks_service().create(request_)


@pytest.mark.parametrize("method", ["start", "kill", "delete", "wait", "state", "stats", "exec", "update"])
def test_a_task_it_does_not_run_is_not_found(method: str) -> None:
    request: Any = SimpleNamespace(id=SID, exec_id="", signal=15, all=False)
    with pytest.raises(NotFound):
        getattr(tasks_service(), method)(request)


def test_a_bundle_spec_is_read_bounded_and_not_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({"process": {}}))
    assert read_spec(str(tmp_path / "b")) == {"process": {}}
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "config.json").symlink_to(tmp_path / "b" / "config.json")
    with pytest.raises(InvalidArgument, match="cannot be read"):
        read_spec(str(tmp_path / "l"))
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text("[" + "0," * (1 << 20) + "0]")
    with pytest.raises(InvalidArgument, match="larger"):
        read_spec(str(tmp_path / "big"))
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[]")
    with pytest.raises(InvalidArgument, match="not an object"):
        read_spec(str(tmp_path / "list"))


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (any_pb2.Any(type_url=f"{SPEC}/LinuxResources", value=b"{}"), "not Process"),
        (any_pb2.Any(type_url=f"{SPEC}/Process", value=b"{"), "not JSON"),
        (any_pb2.Any(type_url=f"{SPEC}/Process", value=b"[]"), "not an object"),
    ],
)  # fmt: skip
def test_an_oci_document_of_another_kind_or_no_object_is_refused(value: any_pb2.Any, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        oci_document(value, "opencontainers/runtime-spec/1/Process", "ExecProcessRequest.spec")


def test_an_oci_document_is_read() -> None:
    value = any_pb2.Any(type_url="types.containerd.io/opencontainers/runtime-spec/1/Process", value=b'{"args": ["ls"]}')
    assert oci_document(value, "opencontainers/runtime-spec/1/Process", "spec") == {"args": ["ls"]}
