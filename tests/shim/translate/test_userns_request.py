"""A user namespace of the pod's own (KEP-127, hostUsers: false) as the kubelet sends it: the
sandbox's and each container's ``userns_options`` and each mount's idmapping, checked by
shim.translate.inbound; the PodSandboxStatus echo (outbound) and the record's document."""

from __future__ import annotations

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import SANDBOX_READY, SandboxRecord
from shim.translate import inbound, outbound
from vmsandbox.errors import InvalidArgument, Unsupported
from vmsandbox.pod import PodMeta
from vmsandbox.userns import IdMapping, UserNamespace

POD_NS = UserNamespace((IdMapping(0, 131072, 65536),), (IdMapping(0, 131072, 65536),))


def _ns(
    msg: pb.NamespaceOption, mode: pb.NamespaceMode.ValueType = pb.POD, host: int = 131072, gid_host: int = 0
) -> None:
    msg.userns_options.mode = mode
    msg.userns_options.uids.add(host_id=host, container_id=0, length=65536)
    msg.userns_options.gids.add(host_id=gid_host or host, container_id=0, length=65536)


def _sandbox(**ns: object) -> pb.PodSandboxConfig:
    config = pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="p", namespace="default", uid="u1"))
    _ns(config.linux.security_context.namespace_options, **ns)  # type: ignore[arg-type]
    return config


def _create(
    container_host: int = 131072, sandbox_host: int | None = 131072, **extra: object
) -> pb.CreateContainerRequest:
    config = pb.ContainerConfig(metadata=pb.ContainerMetadata(name="app"), image=pb.ImageSpec(image="busybox"))
    _ns(config.linux.security_context.namespace_options, host=container_host)
    config.linux.security_context.namespace_options.pid = pb.CONTAINER  # as the kubelet sends it
    mount = config.mounts.add(container_path="/etc/cfg", host_path="/var/lib/kubelet/pods/u1/volumes/x")
    mount.uidMappings.add(host_id=container_host, container_id=0, length=65536)
    mount.gidMappings.add(host_id=container_host, container_id=0, length=65536)
    request = pb.CreateContainerRequest(pod_sandbox_id="a" * 64, config=config)
    if sandbox_host is not None:
        request.sandbox_config.CopyFrom(_sandbox(host=sandbox_host))
    for key, value in extra.items():
        setattr(request, key, value)
    return request


def test_the_sandbox_carries_the_pods_mappings() -> None:
    spec = inbound.sandbox_spec(_sandbox(), "vmsandbox")
    assert spec.userns == POD_NS
    plain = pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="p", namespace="default", uid="u1"))
    assert inbound.sandbox_spec(plain, "").userns is None
    plain.linux.security_context.namespace_options.userns_options.mode = pb.NODE  # hostUsers: true
    assert inbound.sandbox_spec(plain, "").userns is None


@pytest.mark.parametrize(
    ("change", "error", "problem"),
    [
        (lambda c: c.linux.security_context.namespace_options.userns_options.ClearField("uids"), InvalidArgument,
         r"userns_options\.uids is empty"),
        (lambda c: c.linux.security_context.namespace_options.userns_options.gids[0].__setattr__("length", 0),
         InvalidArgument, r"userns_options\.gids\[0\]\.length is 0"),
        (lambda c: c.linux.security_context.namespace_options.userns_options.__setattr__("mode", pb.NODE),
         InvalidArgument, r"mode NODE .* takes no uids or gids mappings"),
        (lambda c: c.linux.security_context.namespace_options.userns_options.__setattr__("mode", pb.TARGET),
         InvalidArgument, r"userns_options\.mode is 3, not POD or NODE"),
        (lambda c: c.linux.security_context.namespace_options.userns_options.uids[0].__setattr__("container_id", 1),
         InvalidArgument, r"userns_options\.uids maps no container id 0"),
        (lambda c: c.linux.security_context.namespace_options.userns_options.gids[0].__setattr__("container_id", 5),
         InvalidArgument, r"userns_options\.gids maps no container id 0"),
        (lambda c: c.linux.security_context.namespace_options.__setattr__("network", pb.NODE), Unsupported,
         r"with the node's network \(hostNetwork\) is not supported"),
    ],
)  # fmt: skip
def test_a_bad_sandbox_namespace_is_refused_precisely(change: object, error: type[Exception], problem: str) -> None:
    config = _sandbox()
    change(config)  # type: ignore[operator]
    with pytest.raises(error, match=problem):
        inbound.sandbox_spec(config, "vmsandbox")


def test_a_container_runs_in_the_pods_namespace_with_idmapped_mounts() -> None:
    req = inbound.create_container(_create())
    assert req.run.userns == POD_NS
    assert [m.container_path for m in req.spec.mounts] == ["/etc/cfg"]


@pytest.mark.parametrize(
    ("request_", "error", "problem"),
    [
        (_create(container_host=196608), InvalidArgument,
         r"the container's user namespace \(uids \[0 196608 65536\].*is not its pod's \(uids \[0 131072 65536\]"),
        (_create(sandbox_host=None), None, ""),  # no sandbox_config: checked against the pod's record instead
    ],
)  # fmt: skip
def test_a_container_namespace_other_than_the_sandbox_config_is_refused(
    request_: pb.CreateContainerRequest, error: type[Exception] | None, problem: str
) -> None:
    if error is None:
        assert inbound.create_container(request_).run.userns == UserNamespace(
            (IdMapping(0, 131072, 65536),), (IdMapping(0, 131072, 65536),)
        )
    else:
        with pytest.raises(error, match=problem):
            inbound.create_container(request_)


def test_a_mounts_idmapping_must_be_the_containers_namespace() -> None:
    request = _create()
    request.config.mounts[0].uidMappings[0].host_id = 65536
    with pytest.raises(InvalidArgument, match=r'mount "/etc/cfg": its idmapping \(uids \[0 65536 65536\]'):
        inbound.create_container(request)
    request = _create()
    request.config.mounts[0].ClearField("gidMappings")
    with pytest.raises(InvalidArgument, match=r'mount "/etc/cfg"\.gidMappings is empty'):
        inbound.create_container(request)


def test_a_mount_without_an_idmapping_is_a_plain_mount() -> None:
    request = _create()
    request.config.mounts[0].ClearField("uidMappings")
    request.config.mounts[0].ClearField("gidMappings")
    assert len(inbound.create_container(request).spec.mounts) == 1


def test_a_shared_pid_namespace_in_a_user_namespace_is_refused() -> None:
    request = _create()
    request.config.linux.security_context.namespace_options.pid = pb.POD  # shareProcessNamespace
    with pytest.raises(Unsupported, match=r"PID namespace shared with the pod \(shareProcessNamespace\)"):
        inbound.create_container(request)


def test_the_record_keeps_the_namespace_and_the_status_echoes_it() -> None:
    record = SandboxRecord(
        id="a" * 64,
        meta=PodMeta("p", "default", "u1"),
        state=SANDBOX_READY,
        created_ns=1,
        runtime_handler="vmsandbox",
        profile="default",
        domain="d",
        userns=POD_NS,
    )
    assert SandboxRecord.from_doc(record.to_doc()) == record
    options = outbound.pod_sandbox_status(record).linux.namespaces.options
    assert options.userns_options.mode == pb.POD
    assert [(m.container_id, m.host_id, m.length) for m in options.userns_options.uids] == [(0, 131072, 65536)]
    assert [(m.container_id, m.host_id, m.length) for m in options.userns_options.gids] == [(0, 131072, 65536)]
    plain = SandboxRecord.from_doc({**record.to_doc(), "userns": None})
    assert plain.userns is None
    assert not outbound.pod_sandbox_status(plain).linux.namespaces.options.HasField("userns_options")
    del_doc = record.to_doc()
    del del_doc["userns"]  # a record of an earlier version
    assert SandboxRecord.from_doc(del_doc).userns is None
