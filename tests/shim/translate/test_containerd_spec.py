"""containerd's OCI spec of a container read back as its CRI config (shim/translate/containerd_spec.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from google.protobuf import any_pb2

from gen.containerd.types.runc.options import oci_pb2 as runc_options
from gen.cri.runtime.v1 import api_pb2 as pb
from shim.translate import inbound
from shim.translate.containerd_spec import container_config, task_options
from vmsandbox.errors import InvalidArgument, Unsupported
from vmsandbox.oci_spec import ALL_CAPABILITIES, DEFAULT_CAPABILITIES

SID = "5" * 64
KUBELET = "/var/lib/kubelet/pods/43d1c420-346d-47b4-99c2-6bb49e50e9f8"


def spec(**changes: Any) -> dict[str, Any]:
    """A container's spec as containerd 2.4's CRI plugin writes it (trimmed to what is read)."""
    caps = list(DEFAULT_CAPABILITIES)
    base: dict[str, Any] = {
        "ociVersion": "1.2.1",
        "process": {
            "user": {"uid": 1000, "gid": 1000, "additionalGids": [1000, 10]},
            "args": ["/bin/sh", "-c", "echo hi"],
            "env": ["PATH=/usr/bin:/bin", "GREETING=a=b"],
            "cwd": "/work",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576}],
            "noNewPrivileges": True,
            "oomScoreAdj": 1000,
        },
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "gid=5"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["ro"]},
            {
                "destination": "/etc/hosts",
                "type": "bind",
                "source": "/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/x/hosts",
                "options": ["rbind", "rprivate", "rw"],
            },
            {
                "destination": "/dev/termination-log",
                "type": "bind",
                "source": f"{KUBELET}/containers/app/1a2b3c4d",
                "options": ["rbind", "rprivate", "rw"],
            },
            {
                "destination": "/var/run/secrets/kubernetes.io/serviceaccount",
                "type": "bind",
                "source": f"{KUBELET}/volumes/kubernetes.io~projected/kube-api-access-x",
                "options": ["rbind", "rprivate", "ro"],
            },
            {
                "destination": "/data",
                "type": "bind",
                "source": f"{KUBELET}/volumes/kubernetes.io~empty-dir/data",
                "options": ["rbind", "rslave", "rw"],
            },
        ],
        "annotations": {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-id": SID,
            "io.kubernetes.cri.container-name": "app",
            "io.kubernetes.cri.image-name": "docker.io/library/busybox:1.36",
            "io.kubernetes.cri.sandbox-name": "web",
            "example.com/keep": "yes",
        },
        "linux": {
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "cpu": {"shares": 256, "quota": 50000, "period": 100000},
                "memory": {"limit": 67108864, "swap": 67108864},
            },
            "namespaces": [{"type": "pid"}, {"type": "ipc", "path": "/proc/1/ns/ipc"}, {"type": "mount"}],
            "maskedPaths": ["/proc/kcore"],
            "readonlyPaths": ["/proc/sys"],
            "seccomp": {
                "defaultAction": "SCMP_ACT_ERRNO",
                "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}],
            },
            "sysctl": {"net.ipv4.ip_unprivileged_port_start": "0"},
        },
    }
    for path, value in changes.items():
        node = base
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return base


def test_a_container_reads_back_as_its_cri_config() -> None:
    got = container_config(spec(), stdin=False)
    c = got.config
    assert got.sandbox_id == SID
    assert c.metadata.name == "app" and c.image.image == "docker.io/library/busybox:1.36"
    assert list(c.command) == ["/bin/sh", "-c", "echo hi"] and not c.args
    assert [(kv.key, kv.value) for kv in c.envs] == [("PATH", b"/usr/bin:/bin"), ("GREETING", b"a=b")]
    assert c.working_dir == "/work"
    sc = c.linux.security_context
    assert (sc.run_as_user.value, sc.run_as_group.value, list(sc.supplemental_groups)) == (1000, 1000, [10])
    # containerd resolved the groups (the image's included for Merge): the guest adds none
    assert sc.supplemental_groups_policy == pb.SupplementalGroupsPolicy.Strict
    assert not sc.privileged and not sc.capabilities.add_capabilities and not sc.capabilities.drop_capabilities
    assert sc.no_new_privs and list(sc.masked_paths) == ["/proc/kcore"] and list(sc.readonly_paths) == ["/proc/sys"]
    assert sc.namespace_options.pid == pb.CONTAINER
    r = c.linux.resources
    assert (r.cpu_shares, r.cpu_quota, r.cpu_period, r.memory_limit_in_bytes) == (256, 50000, 100000, 64 << 20)
    assert r.oom_score_adj == 1000 and r.memory_swap_limit_in_bytes == 0
    assert [(m.container_path, m.readonly, m.propagation) for m in c.mounts] == [
        ("/dev/termination-log", False, pb.PROPAGATION_PRIVATE),
        ("/var/run/secrets/kubernetes.io/serviceaccount", True, pb.PROPAGATION_PRIVATE),
        ("/data", False, pb.PROPAGATION_HOST_TO_CONTAINER),
    ]
    assert dict(c.annotations) == {"example.com/keep": "yes"}
    assert got.sysctls == {"net.ipv4.ip_unprivileged_port_start": "0"}
    assert got.rlimits == (("RLIMIT_NOFILE", 1048576, 1048576),)
    assert got.seccomp is not None and got.seccomp["defaultAction"] == "SCMP_ACT_ERRNO"
    # and the CRI path accepts it as the kubelet's
    created = inbound.create_container(pb.CreateContainerRequest(pod_sandbox_id=SID, config=c))
    assert created.run.command == ("/bin/sh", "-c", "echo hi")
    assert created.run.supplemental_groups == (10,) and not created.run.image_groups


@pytest.mark.parametrize(
    ("changes", "check"),
    [
        (
            {"process__capabilities": {"bounding": list(ALL_CAPABILITIES)}, "linux__maskedPaths": None,
             "linux__seccomp": None},
            lambda c: c.linux.security_context.privileged,
        ),
        (
            {"process__capabilities": {"bounding": [*DEFAULT_CAPABILITIES[1:], "CAP_NET_ADMIN"]}},
            lambda c: (list(c.linux.security_context.capabilities.add_capabilities),
                       list(c.linux.security_context.capabilities.drop_capabilities))
            == (["CAP_NET_ADMIN"], [DEFAULT_CAPABILITIES[0]]),
        ),
        (
            {"linux__namespaces": [{"type": "pid", "path": "/proc/42/ns/pid"}]},
            lambda c: c.linux.security_context.namespace_options.pid == pb.POD,
        ),
        (
            {"linux__uidMappings": [{"containerID": 0, "hostID": 65536, "size": 65536}],
             "linux__gidMappings": [{"containerID": 0, "hostID": 65536, "size": 65536}]},
            lambda c: [(m.container_id, m.host_id, m.length)
                       for m in c.linux.security_context.namespace_options.userns_options.uids] == [(0, 65536, 65536)],
        ),
        (
            {"process__capabilities": {"bounding": list(ALL_CAPABILITIES)}, "linux__maskedPaths": None,
             "linux__seccomp": None, "linux__devices": [{"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232}]},
            lambda c: c.linux.security_context.privileged,
        ),
        (
            # containerd's privileged container on a host whose containerd lacks a capability: its
            # bounding set is containerd's own, its sysfs read-write (the mark WithPrivileged leaves)
            {"process__capabilities": {"bounding": [c for c in ALL_CAPABILITIES if c != "CAP_SYS_RESOURCE"]},
             "linux__maskedPaths": None, "linux__readonlyPaths": None, "linux__seccomp": None,
             "mounts": [{"destination": "/sys", "type": "sysfs", "source": "sysfs",
                         "options": ["nosuid", "noexec", "nodev", "rw"]}],
             "linux__devices": [{"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232}]},
            lambda c: c.linux.security_context.privileged,
        ),
        (
            # the same capabilities, no masked paths, no seccomp, but a read-only sysfs: not privileged
            {"process__capabilities": {"bounding": [c for c in ALL_CAPABILITIES if c != "CAP_SYS_RESOURCE"]},
             "linux__maskedPaths": None, "linux__seccomp": None},
            lambda c: not c.linux.security_context.privileged
            and "CAP_SYS_ADMIN" in c.linux.security_context.capabilities.add_capabilities,
        ),
        (
            {"mounts": [{"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["rw"]}]},
            lambda c: not c.linux.security_context.privileged,  # masked paths and seccomp: not privileged
        ),
        ({"process__terminal": True}, lambda c: c.tty),
        ({"root__readonly": True}, lambda c: c.linux.security_context.readonly_rootfs),
        (
            {"linux__resources": {"hugepageLimits": [{"pageSize": "2MB", "limit": 4194304}]}},
            lambda c: [(h.page_size, h.limit) for h in c.linux.resources.hugepage_limits] == [("2MB", 4194304)],
        ),
    ],
)  # fmt: skip
def test_fields_read_back(changes: dict[str, Any], check: Any) -> None:
    assert check(container_config(spec(**changes), stdin=False).config)


@pytest.mark.parametrize(
    ("changes", "error", "says"),
    [
        ({"annotations": {"io.kubernetes.cri.container-type": "sandbox"}}, InvalidArgument, "container-type"),
        ({"process__args": []}, InvalidArgument, "process.args is empty"),
        ({"process__env": ["NOEQUALS"]}, InvalidArgument, "KEY=VALUE"),
        ({"process__user": {"uid": -1}}, InvalidArgument, "process.user.uid"),
        ({"process__oomScoreAdj": 5000}, InvalidArgument, "oomScoreAdj"),
        ({"mounts": [{"destination": "/x", "type": "overlay", "source": "overlay"}]}, Unsupported, "overlay"),
        (
            {"mounts": [{"destination": "/x", "type": "bind", "source": "/srv", "options": ["rbind", "exec,suid"]}]},
            Unsupported,
            "options",
        ),
        ({"linux__devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}]}, Unsupported, "devices"),
        ({"linux__resources": {"cpu": {"shares": "many"}}}, InvalidArgument, "cpu.shares"),
        ({"mounts": "all"}, InvalidArgument, "mounts is not a list"),
    ],
)
def test_refused_precisely(changes: dict[str, Any], error: type[Exception], says: str) -> None:
    s = spec(**changes)
    if "annotations" in changes:
        s["annotations"] = {**spec()["annotations"], **changes["annotations"]}
    with pytest.raises(error, match=says):
        container_config(s, stdin=False)


def test_every_annotation_it_needs_is_required() -> None:
    for key in ("io.kubernetes.cri.sandbox-id", "io.kubernetes.cri.container-name", "io.kubernetes.cri.image-name"):
        s = copy.deepcopy(spec())
        del s["annotations"][key]
        with pytest.raises(InvalidArgument, match=key):
            container_config(s, stdin=False)


def _runc(type_url: str = "containerd.runc.v1.Options", **fields: Any) -> any_pb2.Any:
    return any_pb2.Any(type_url=type_url, value=runc_options.Options(**fields).SerializeToString())


@pytest.mark.parametrize(
    "options",
    [
        any_pb2.Any(),  # the runtime has no options and the container no user namespace
        _runc(),
        _runc(io_uid=1 << 20, io_gid=1 << 20),  # containerd's WithUIDOwner/WithGIDOwner (a user namespace)
        _runc(io_uid=0, io_gid=65536),
        _runc("type.googleapis.com/containerd.runc.v1.Options", io_gid=7),
        # containerd's WithTaskAPIEndpoint: the sandbox's task API, in runc's deprecated fields too
        _runc(task_api_address="ttrpc+unix:///run/vmsandbox/containerd/vmsandbox.sock", task_api_version=3),
        _runc(task_api_address="ttrpc+unix:///x.sock", task_api_version=3, io_uid=1 << 20, io_gid=1 << 20),
    ],
)
def test_task_options_of_no_kind_or_only_the_endpoint_and_the_fifos_owner_are_taken(options: any_pb2.Any) -> None:
    task_options(options)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (_runc(io_uid=1, no_pivot_root=True), "containerd.runc.v1.Options.no_pivot_root is set"),
        (_runc(binary_name="crun"), "binary_name is set"),
        (_runc(shim_cgroup="/x"), "shim_cgroup is set"),
        (_runc(root="/run/runc"), r"\.root is set"),
        (_runc(criu_work_path="/x"), "criu_work_path is set"),
        (_runc(systemd_cgroup=True, task_api_version=3), "systemd_cgroup is set"),
        (any_pb2.Any(type_url="containerd.runc.v1.Options", value=b"\xff"), "not a containerd.runc.v1.Options"),
        (any_pb2.Any(type_url="containerd.runc.v1.Options", value=b"\xa0\x06\x01"), "fields vmsandbox does not know"),
        (any_pb2.Any(type_url="runtimeoptions.v1.Options", value=b""), "older vmsandbox's drop-in"),
        (any_pb2.Any(type_url="runhcs.v1.Options", value=b"\x08\x01"), "runhcs.v1.Options"),
    ],
)
def test_other_task_options_are_refused_naming_them(options: any_pb2.Any, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        task_options(options)
