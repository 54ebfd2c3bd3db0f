"""A container that containerd creates in a VM pod (shim mode): the OCI spec its CRI plugin wrote
into the task's bundle, read back as the CRI ``ContainerConfig`` it was made from.

So a container reaching vmsandbox through containerd passes exactly the checks, admission and
guest spec of one the kubelet creates on vmsandbox's own CRI socket (``inbound.create_container``).
containerd's plugin built the spec from that config and the image's; the inverse is exact for what
a VM pod uses and refused where it is not (``Unsupported``/``InvalidArgument``, naming the field):

- ``process.args`` become the config's ``command`` (containerd already merged the image's
  entrypoint and cmd), ``process.env`` its env (the image's included), ``process.cwd`` its working
  directory, ``process.user`` its ``run_as_user``/``run_as_group`` and supplemental groups (all of
  them, as containerd resolved them by the SupplementalGroupsPolicy: read back as Strict);
- ``linux.resources`` its ``LinuxContainerResources``; ``process.oomScoreAdj`` its score;
- the capabilities are the bounding set read as ``add``/``drop`` against the default set; a
  read-write sysfs (or every capability) with no masked paths and no seccomp is a privileged
  container (which gets the guest's devices, not the host's its spec lists);
- ``linux.seccomp``, the profile containerd resolved, goes to the guest as it is (``inline``);
  ``process.rlimits`` likewise;
- a pid namespace joined by path is the pod's (NamespaceMode POD), else the container's own;
  ``linux.uidMappings``/``gidMappings`` are the pod's user namespace (mode POD);
- bind mounts are the kubelet's volumes (host path, read-only, propagation); the pod's
  ``/etc/hosts``, ``/etc/resolv.conf``, ``/etc/hostname`` and ``/dev/shm`` containerd may add are
  left out: the VM pod has its own, made from the same PodSandboxConfig; the kernel's file
  systems (proc, sysfs, tmpfs, devpts, mqueue, cgroup) are the guest's own;
- the annotations containerd sets name the sandbox, the container and its image.

The task's own options (``CreateTaskRequest.options``, ``task_options``) are none, or runc's with
only the task API's endpoint and the owner of the stdio fifos set (containerd's CRI fills those
for a runtime without options of its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import any_pb2, unknown_fields
from google.protobuf.message import DecodeError

from gen.containerd.types.runc.options import oci_pb2 as runc_options
from gen.cri.runtime.v1 import api_pb2 as pb
from vmsandbox import validation
from vmsandbox.errors import InvalidArgument, Unsupported
from vmsandbox.oci_spec import ALL_CAPABILITIES, DEFAULT_CAPABILITIES

MAX_SPEC_BYTES = 1 << 20
"""A bundle's config.json larger than this is refused (containerd's are a few KiB)."""

CONTAINER_TYPE = "io.kubernetes.cri.container-type"
SANDBOX_ID = "io.kubernetes.cri.sandbox-id"
CONTAINER_NAME = "io.kubernetes.cri.container-name"
IMAGE_NAME = "io.kubernetes.cri.image-name"

# the pod's files containerd mounts when its sandbox made them: a VM pod makes its own
POD_FILES = frozenset(("/etc/hosts", "/etc/resolv.conf", "/etc/hostname", "/dev/shm"))
# file systems the guest's runtime mounts itself for every container
KERNEL_FS = frozenset(("proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "cgroup2"))
_PROPAGATION = {
    "rprivate": pb.PROPAGATION_PRIVATE,
    "private": pb.PROPAGATION_PRIVATE,
    "rslave": pb.PROPAGATION_HOST_TO_CONTAINER,
    "slave": pb.PROPAGATION_HOST_TO_CONTAINER,
    "rshared": pb.PROPAGATION_BIDIRECTIONAL,
    "shared": pb.PROPAGATION_BIDIRECTIONAL,
}
_BIND_OPTIONS = frozenset(("bind", "rbind", "ro", "rw", "rro", "nosuid", "nodev", "noexec"))
OCI_VERSION_MAX = "1.2.1"  # containerd 2.4 writes specs of this version


def runtime_features() -> dict[str, Any]:
    """What the launcher's ``-info`` reports as the runtime's OCI features (runtime-spec
    ``features.md``), from the rules above: the mount options the read-back takes (``rro``: so
    containerd reports recursive read-only mounts), and the namespaces, ``user`` with idmapped
    mounts among them (containerd then reports user namespaces: it makes a pod's network namespace
    inside the pod's user namespace and gives it to CreateSandbox; the container's mappings are
    read back as the pod's, as on the CRI socket; the runc options containerd then gives the
    container's task are taken by ``task_options``)."""
    return {
        "ociVersionMin": "1.0.0",
        "ociVersionMax": OCI_VERSION_MAX,
        "mountOptions": sorted(_BIND_OPTIONS | _PROPAGATION.keys()),
        "linux": {
            "namespaces": ["cgroup", "ipc", "mount", "network", "pid", "user", "uts"],
            "mountExtensions": {"idmap": {"enabled": True}},
        },
    }


@dataclass(frozen=True)
class ContainerdContainer:
    """What containerd asked for one container, in the CRI's words."""

    sandbox_id: str
    config: pb.ContainerConfig
    sysctls: Mapping[str, str]
    seccomp: Mapping[str, Any] | None  # the OCI LinuxSeccomp containerd resolved; None: unconfined
    rlimits: tuple[tuple[str, int, int], ...]  # (type, hard, soft)


RUNC_OPTIONS = "containerd.runc.v1.Options"
"""The type URL of runc's task options as containerd's typeurl forms it."""
_TAKEN_RUNC_OPTIONS = frozenset(("io_uid", "io_gid", "task_api_address", "task_api_version"))


def task_options(options: any_pb2.Any) -> None:
    """``CreateTaskRequest.options``: none, or runc's ``Options`` whose only set fields are the
    ones containerd 2.4's CRI fills for a runtime without options of its own, which it takes to be
    runc-like (``getRuncOptions``):

    - ``task_api_address``/``task_api_version`` (``WithTaskAPIEndpoint``, deprecated fields kept
      for older containerds): the sandbox's task API, that is the handler's socket this request
      came in on, so they name what is already the case;
    - ``io_uid``/``io_gid`` (``WithUIDOwner``/``WithGIDOwner``, for a container with a user
      namespace of its own): the host ids the container's user maps to, made the owner of the
      task's stdio fifos so that runc's container process can open them. vmsandbox opens the fifos
      itself, on the host, as containerd's peer, and the container's stdio is carried from the
      guest: nothing in the container opens them, so the owner has nothing to do.

    Any other field asks runc for what a VM pod's task has no use for, and is refused naming it."""
    if not options.type_url and not options.value:
        return
    if options.type_url.removeprefix("type.googleapis.com/") != RUNC_OPTIONS:
        raise InvalidArgument(
            f"CreateTaskRequest.options is {validation.quote(options.type_url[:128])}: vmsandbox's tasks take none, "
            f"or {RUNC_OPTIONS} with only io_uid, io_gid and the task API's endpoint (a runtime with options in "
            "containerd's configuration is an older vmsandbox's drop-in: write it again with `vmsandbox profile "
            "containerd`)"
        )
    opts = runc_options.Options()
    try:
        opts.ParseFromString(options.value)
    except DecodeError as exc:
        raise InvalidArgument(f"CreateTaskRequest.options: not a {RUNC_OPTIONS}: {exc}") from None
    if len(unknown_fields.UnknownFieldSet(opts)):
        raise InvalidArgument(f"CreateTaskRequest.options: {RUNC_OPTIONS} with fields vmsandbox does not know")
    for field, _ in opts.ListFields():
        if field.name not in _TAKEN_RUNC_OPTIONS:
            raise InvalidArgument(
                f"CreateTaskRequest.options: {RUNC_OPTIONS}.{field.name} is set; a VM pod's task takes only io_uid "
                "and io_gid (the owner of its stdio fifos) and the task API's endpoint"
            )


def _obj(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} is not an object")
    return value


def _list(value: object, where: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidArgument(f"{where} is not a list")
    return value


def _strings(value: object, where: str) -> tuple[str, ...]:
    items = _list(value, where)
    if not all(isinstance(s, str) for s in items):
        raise InvalidArgument(f"{where} holds something other than strings")
    return tuple(items)


def _int(value: object, where: str, *, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{where} is not an integer in [{lo}, {hi}]")
    return value


def _env(items: Sequence[str]) -> list[pb.KeyValue]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"process.env entry {validation.quote(item[:64])} is not KEY=VALUE")
        out.append(pb.KeyValue(key=key, value=value.encode()))
    return out


def linux_resources(res: Mapping[str, Any], oom_score_adj: int = 0) -> pb.LinuxContainerResources:
    """OCI ``LinuxResources`` (a spec's ``linux.resources``, or an update's) as the CRI's."""
    cpu = _obj(res.get("cpu"), "linux.resources.cpu")
    memory = _obj(res.get("memory"), "linux.resources.memory")
    out = pb.LinuxContainerResources(oom_score_adj=oom_score_adj)
    if "shares" in cpu:
        out.cpu_shares = _int(cpu["shares"], "linux.resources.cpu.shares")
    if "quota" in cpu:
        out.cpu_quota = _int(cpu["quota"], "linux.resources.cpu.quota", lo=-1)
    if "period" in cpu:
        out.cpu_period = _int(cpu["period"], "linux.resources.cpu.period")
    if cpu.get("cpus"):
        out.cpuset_cpus = str(cpu["cpus"])
    if cpu.get("mems"):
        out.cpuset_mems = str(cpu["mems"])
    if "limit" in memory:
        out.memory_limit_in_bytes = _int(memory["limit"], "linux.resources.memory.limit", lo=-1)
    if "swap" in memory and memory["swap"] != memory.get("limit"):
        out.memory_swap_limit_in_bytes = _int(memory["swap"], "linux.resources.memory.swap", lo=-1)
    for i, h in enumerate(_list(res.get("hugepageLimits"), "linux.resources.hugepageLimits")):
        h = _obj(h, f"linux.resources.hugepageLimits[{i}]")
        limit = _int(h.get("limit", 0), f"linux.resources.hugepageLimits[{i}].limit")
        out.hugepage_limits.append(pb.HugepageLimit(page_size=str(h.get("pageSize", "")), limit=limit))
    unified = _obj(res.get("unified"), "linux.resources.unified")
    for key, value in unified.items():
        out.unified[str(key)] = str(value)
    return out


def _writable_sysfs(mounts: Sequence[Any]) -> bool:
    """containerd's mark of a privileged container: its sysfs mounted read-write (``WithPrivileged``
    turns the default ``ro`` into ``rw``; every other container's is read-only). Its capabilities
    are no such mark: they are the ones containerd's own process holds, which may be fewer than
    the kernel knows."""
    for m in mounts:
        if isinstance(m, dict) and m.get("type") == "sysfs" and m.get("destination") == "/sys":
            options = m.get("options")
            return isinstance(options, list) and "ro" not in options
    return False


def _security(
    process: Mapping[str, Any], linux: Mapping[str, Any], root: Mapping[str, Any], mounts: Sequence[Any]
) -> tuple[pb.LinuxContainerSecurityContext, Mapping[str, Any] | None]:
    sc = pb.LinuxContainerSecurityContext(
        readonly_rootfs=bool(root.get("readonly", False)),
        no_new_privs=bool(process.get("noNewPrivileges", False)),
        masked_paths=_strings(linux.get("maskedPaths"), "linux.maskedPaths"),
        readonly_paths=_strings(linux.get("readonlyPaths"), "linux.readonlyPaths"),
    )
    user = _obj(process.get("user"), "process.user")
    uid = _int(user.get("uid", 0), "process.user.uid", hi=(1 << 32) - 1)
    gid = _int(user.get("gid", 0), "process.user.gid", hi=(1 << 32) - 1)
    sc.run_as_user.value = uid
    sc.run_as_group.value = gid
    for i, g in enumerate(_list(user.get("additionalGids"), "process.user.additionalGids")):
        g = _int(g, f"process.user.additionalGids[{i}]", hi=(1 << 32) - 1)
        if g != gid:
            sc.supplemental_groups.append(g)
    # containerd resolved the groups by the container's SupplementalGroupsPolicy (with the image's
    # /etc/group for Merge): they are all the container gets, none added again from the image
    sc.supplemental_groups_policy = pb.SupplementalGroupsPolicy.Strict
    caps = _obj(process.get("capabilities"), "process.capabilities")
    bounding = set(_strings(caps.get("bounding"), "process.capabilities.bounding"))
    seccomp = linux.get("seccomp")
    if seccomp is not None:
        seccomp = _obj(seccomp, "linux.seccomp")
    if not sc.masked_paths and seccomp is None and (bounding >= set(ALL_CAPABILITIES) or _writable_sysfs(mounts)):
        sc.privileged = True
    else:
        sc.capabilities.add_capabilities.extend(sorted(bounding - set(DEFAULT_CAPABILITIES)))
        sc.capabilities.drop_capabilities.extend(sorted(set(DEFAULT_CAPABILITIES) - bounding))
    if process.get("apparmorProfile"):
        sc.apparmor.profile_type = pb.SecurityProfile.ProfileType.RuntimeDefault
    namespaces = _list(linux.get("namespaces"), "linux.namespaces")
    pid = [_obj(n, "linux.namespaces[]") for n in namespaces if isinstance(n, dict) and n.get("type") == "pid"]
    sc.namespace_options.pid = pb.POD if pid and pid[0].get("path") else pb.CONTAINER
    uids = _list(linux.get("uidMappings"), "linux.uidMappings")
    gids = _list(linux.get("gidMappings"), "linux.gidMappings")
    if uids or gids:
        sc.namespace_options.userns_options.mode = pb.POD
        sc.namespace_options.userns_options.uids.extend(_mappings(uids, "linux.uidMappings"))
        sc.namespace_options.userns_options.gids.extend(_mappings(gids, "linux.gidMappings"))
    else:
        sc.namespace_options.userns_options.mode = pb.NODE
    return sc, seccomp


def _mappings(items: Sequence[Any], where: str) -> list[pb.IDMapping]:
    out = []
    for i, m in enumerate(items):
        m = _obj(m, f"{where}[{i}]")
        out.append(
            pb.IDMapping(
                container_id=_int(m.get("containerID", 0), f"{where}[{i}].containerID", hi=(1 << 32) - 1),
                host_id=_int(m.get("hostID", 0), f"{where}[{i}].hostID", hi=(1 << 32) - 1),
                length=_int(m.get("size", 0), f"{where}[{i}].size", hi=(1 << 32) - 1),
            )
        )
    return out


def _mounts(items: Sequence[Any], ns: pb.UserNamespace) -> list[pb.Mount]:
    out = []
    for i, m in enumerate(items):
        m = _obj(m, f"mounts[{i}]")
        dest = str(m.get("destination", ""))
        kind = str(m.get("type", ""))
        options = _strings(m.get("options"), f"mounts[{i}].options")
        if kind in KERNEL_FS and kind != "tmpfs":
            continue
        if (kind == "tmpfs" and dest in ("/dev", "/dev/shm")) or dest in POD_FILES:
            continue
        if kind not in ("bind", "rbind", "") and "bind" not in options and "rbind" not in options:
            raise Unsupported(
                f"mount {validation.quote(dest)}: a {validation.quote(kind)} mount is not supported in VM pods "
                "(only bind mounts of host paths reach the guest)"
            )
        propagation = [o for o in options if o in _PROPAGATION]
        other = [o for o in options if o not in _BIND_OPTIONS and o not in _PROPAGATION]
        if other:
            raise Unsupported(
                f"mount {validation.quote(dest)}: options {', '.join(validation.quote(o) for o in other[:4])} "
                "are not supported in VM pods"
            )
        mount = pb.Mount(
            container_path=dest,
            host_path=str(m.get("source", "")),
            readonly="ro" in options or "rro" in options,
            recursive_read_only="rro" in options,
            propagation=_PROPAGATION[propagation[-1]] if propagation else pb.PROPAGATION_PRIVATE,
        )
        if m.get("uidMappings") or m.get("gidMappings"):
            mount.uidMappings.extend(ns.uids)
            mount.gidMappings.extend(ns.gids)
        out.append(mount)
    return out


def _rlimits(items: Sequence[Any]) -> tuple[tuple[str, int, int], ...]:
    out = []
    for i, r in enumerate(items):
        r = _obj(r, f"process.rlimits[{i}]")
        kind = str(r.get("type", ""))
        out.append(
            (
                kind,
                _int(r.get("hard", 0), f"process.rlimits[{i}].hard", hi=(1 << 64) - 1),
                _int(r.get("soft", 0), f"process.rlimits[{i}].soft", hi=(1 << 64) - 1),
            )
        )
    return tuple(out)


def container_config(spec: Mapping[str, Any], *, stdin: bool) -> ContainerdContainer:
    """The CRI config of the container whose OCI spec containerd wrote (``stdin``: containerd gave
    the task a stdin, i.e. the config asked for one)."""
    annotations = {str(k): str(v) for k, v in _obj(spec.get("annotations"), "annotations").items()}
    kind = annotations.get(CONTAINER_TYPE, "")
    if kind != "container":
        raise InvalidArgument(
            f"annotation {CONTAINER_TYPE} is {validation.quote(kind)}: containerd's CRI plugin makes only "
            "containers of a VM pod through the task API (the pod itself is the sandbox API's)"
        )
    for key in (SANDBOX_ID, CONTAINER_NAME, IMAGE_NAME):
        if not annotations.get(key):
            raise InvalidArgument(f"annotation {key} is missing from the container's spec")
    process = _obj(spec.get("process"), "process")
    linux = _obj(spec.get("linux"), "linux")
    root = _obj(spec.get("root"), "root")
    security, seccomp = _security(process, linux, root, _list(spec.get("mounts"), "mounts"))
    args = _strings(process.get("args"), "process.args")
    if not args:
        raise InvalidArgument("process.args is empty")
    oom = _int(process.get("oomScoreAdj", 0), "process.oomScoreAdj", lo=-1000, hi=1000)
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=annotations[CONTAINER_NAME]),
        image=pb.ImageSpec(image=annotations[IMAGE_NAME]),
        command=args,
        working_dir=str(process.get("cwd", "")),
        envs=_env(_strings(process.get("env"), "process.env")),
        mounts=_mounts(_list(spec.get("mounts"), "mounts"), security.namespace_options.userns_options),
        annotations={k: v for k, v in annotations.items() if not k.startswith("io.kubernetes.cri.")},
        stdin=stdin,
        tty=bool(process.get("terminal", False)),
        linux=pb.LinuxContainerConfig(
            resources=linux_resources(_obj(linux.get("resources"), "linux.resources"), oom),
            security_context=security,
        ),
    )
    # a privileged container gets every device of the host in containerd's spec; in a VM pod it
    # gets the guest's, as a privileged container created on vmsandbox's CRI socket does
    if _list(linux.get("devices"), "linux.devices") and not security.privileged:
        raise Unsupported(
            "linux.devices: devices of a container are not passed into VM pods by containerd; give the pod "
            "devices through the profile's device pools"
        )
    sysctl = {str(k): str(v) for k, v in _obj(linux.get("sysctl"), "linux.sysctl").items()}
    return ContainerdContainer(
        sandbox_id=annotations[SANDBOX_ID],
        config=config,
        sysctls=sysctl,
        seccomp=seccomp,
        rlimits=_rlimits(_list(process.get("rlimits"), "process.rlimits")),
    )
