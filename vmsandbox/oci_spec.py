"""The OCI runtime spec (``config.json``) of one container, from what the kubelet asked and what
the image says: a pure function over frozen inputs.

Merge rules follow the CRI (and the image-spec's config): the container's ``command`` replaces the
image's Entrypoint (and drops its Cmd), ``args`` replace Cmd; env is the image's, overridden by
the container's; the working directory and user default to the image's. Limits become cgroup v2
resources of the container inside the guest. The root path and cgroup path are filled in by the
guest agent, which owns the guest's layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vmsandbox.errors import InvalidArgument
from vmsandbox.seccomp import oci_seccomp
from vmsandbox.userns import UserNamespace

OCI_VERSION = "1.0.2"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The default capability set of container runtimes (Docker's and containerd's list).
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)
# Every capability of Linux 6.1 (a privileged container gets them all: the VM is its boundary).
ALL_CAPABILITIES = tuple(
    "CAP_" + c
    for c in [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "MKNOD",
        "LEASE",
        "AUDIT_WRITE",
        "AUDIT_CONTROL",
        "SETFCAP",
        "MAC_OVERRIDE",
        "MAC_ADMIN",
        "SYSLOG",
        "WAKE_ALARM",
        "BLOCK_SUSPEND",
        "AUDIT_READ",
        "PERFMON",
        "BPF",
        "CHECKPOINT_RESTORE",
    ]
)
MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
_RLIMIT_NAMES = frozenset(
    {
        "RLIMIT_AS",
        "RLIMIT_CORE",
        "RLIMIT_CPU",
        "RLIMIT_DATA",
        "RLIMIT_FSIZE",
        "RLIMIT_LOCKS",
        "RLIMIT_MEMLOCK",
        "RLIMIT_MSGQUEUE",
        "RLIMIT_NICE",
        "RLIMIT_NOFILE",
        "RLIMIT_NPROC",
        "RLIMIT_RSS",
        "RLIMIT_RTPRIO",
        "RLIMIT_RTTIME",
        "RLIMIT_SIGPENDING",
        "RLIMIT_STACK",
    }
)


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image's config a container inherits."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    stop_signal: str = ""


@dataclass(frozen=True)
class UserIds:
    """A resolved user: uid, gid and supplementary groups."""

    uid: int
    gid: int
    additional_gids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Resources:
    """cgroup v2 limits of one container; None: no limit."""

    cpu_quota_us: int | None = None
    cpu_period_us: int | None = None
    cpu_shares: int | None = None
    memory_limit_bytes: int | None = None
    pids_limit: int | None = None
    hugepage_limits: Mapping[str, int] = field(default_factory=dict, hash=False)
    """Page size as the kernel spells it ("2MB", "1GB") -> bytes."""


@dataclass(frozen=True)
class Mount:
    destination: str
    source: str
    readonly: bool = False
    hugepage_size: str = ""  # set: a hugetlbfs mount of this page size ("2M", "1G"), not a bind of source


@dataclass(frozen=True)
class ContainerRequest:
    """What CreateContainer asked, already validated for syntax by the translation layer."""

    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    working_dir: str = ""
    hostname: str = ""
    readonly_rootfs: bool = False
    privileged: bool = False
    add_capabilities: tuple[str, ...] = ()
    drop_capabilities: tuple[str, ...] = ()
    no_new_privileges: bool = False
    sysctls: Mapping[str, str] = field(default_factory=dict, hash=False)
    rlimits: tuple[tuple[str, int, int], ...] = ()
    """(type "RLIMIT_NOFILE", hard, soft)."""
    seccomp: str = ""
    """"" or "unconfined": none; "runtime/default": the runtime's default; "localhost/<path>"."""
    seccomp_profile: object = field(default=None, hash=False)
    """The parsed file a "localhost/<path>" profile names (read by the caller, checked here)."""
    apparmor: str = ""
    resources: Resources = Resources()
    mounts: tuple[Mount, ...] = ()
    oom_score_adj: int = 0
    supplemental_groups: tuple[int, ...] = ()
    """Added to the groups the image gives the user."""
    image_groups: bool = True
    """The groups the image's /etc/group gives the user are added (SupplementalGroupsPolicy Merge);
    False: only ``supplemental_groups`` (Strict)."""
    masked_paths: tuple[str, ...] | None = None
    """None: the runtime's defaults (MASKED_PATHS)."""
    readonly_paths: tuple[str, ...] | None = None
    """None: the runtime's defaults (READONLY_PATHS)."""
    own_pid_namespace: bool = True
    """False: the container sees the pod's processes (the guest's PID namespace; CRI NamespaceMode POD/NODE)."""
    stdin: bool = False
    """The container keeps a stdin pipe that Attach writes to (not part of the OCI spec: the agent's)."""
    stdin_once: bool = False
    """That pipe closes when the first Attach that used it ends."""
    tty: bool = False
    """The container asked for a terminal: its output is one stream, logged as stdout (as containerd does)."""
    userns: UserNamespace | None = None
    """The pod's own user namespace (``hostUsers: false``): the container gets a user namespace with
    exactly these mappings (the guest's ids are the "host" ones); None: the guest's."""


def process_args(request: ContainerRequest, image: ImageConfig) -> tuple[str, ...]:
    """The argv: CRI command/args over the image's Entrypoint/Cmd (the kubelet's rules)."""
    argv = request.command + request.args if request.command else image.entrypoint + (request.args or image.cmd)
    if not argv:
        raise InvalidArgument("the container has no command: neither the config nor the image gives one")
    return argv


def merged_env(request: ContainerRequest, image: ImageConfig) -> tuple[str, ...]:
    """The image's environment overridden by the container's, order kept, PATH defaulted."""
    env: dict[str, str] = {}
    for entry in image.env:
        key, sep, value = entry.partition("=")
        if sep:
            env[key] = value
    for key, value in request.env:
        if not key or "=" in key or "\x00" in key or "\x00" in value:
            raise InvalidArgument(f"bad environment variable name {key[:64]!r}")
        env[key] = value
    env.setdefault("PATH", DEFAULT_PATH)
    if request.hostname:
        env.setdefault("HOSTNAME", request.hostname)
    return tuple(f"{k}={v}" for k, v in env.items())


def has_capability(request: ContainerRequest, name: str) -> bool:
    """Whether the container's process holds capability ``name`` ("CAP_...") as its spec grants
    them (the runtime's defaults, drops, adds; every one when privileged)."""
    return name in _capabilities(request)


def _capabilities(request: ContainerRequest) -> list[str]:
    if request.privileged:
        return list(ALL_CAPABILITIES)
    caps = list(DEFAULT_CAPABILITIES)

    def canon(name: str) -> str:
        upper = name.upper()
        full = upper if upper.startswith("CAP_") else "CAP_" + upper
        if not full[4:].replace("_", "").isalnum() or len(full) > 40:
            raise InvalidArgument(f"bad capability name {name[:64]!r}")
        return full

    drops = {canon(c) for c in request.drop_capabilities if c.upper() != "ALL"}
    if any(c.upper() == "ALL" for c in request.drop_capabilities):
        caps = []
    caps = [c for c in caps if c not in drops]
    for cap in request.add_capabilities:
        full = canon(cap)
        if full not in caps:
            caps.append(full)
    return caps


def _resources(res: Resources) -> dict[str, object]:
    out: dict[str, object] = {}
    if res.memory_limit_bytes:
        out["memory"] = {"limit": res.memory_limit_bytes, "swap": res.memory_limit_bytes}
    cpu: dict[str, object] = {}
    if res.cpu_quota_us and res.cpu_quota_us > 0:
        cpu["quota"] = res.cpu_quota_us
        cpu["period"] = res.cpu_period_us or 100_000
    if res.cpu_shares:
        cpu["shares"] = res.cpu_shares
    if cpu:
        out["cpu"] = cpu
    if res.pids_limit and res.pids_limit > 0:
        out["pids"] = {"limit": res.pids_limit}
    if res.hugepage_limits:
        out["hugepageLimits"] = [
            {"pageSize": size, "limit": limit} for size, limit in sorted(res.hugepage_limits.items())
        ]
    return out


def _seccomp(profile: str, document: object, caps: list[str]) -> dict[str, object] | None:
    if profile in ("", "unconfined"):
        return None
    if profile.startswith("localhost/"):
        if document is None:
            raise InvalidArgument(f"seccomp profile {profile[:128]!r}: the profile file was not read")
        return oci_seccomp(document, caps, profile.removeprefix("localhost/")[:256])
    if profile == "docker/default":  # the legacy spelling of the runtime default
        profile = "runtime/default"
    if profile == "runtime/default":
        # Refuse what no container needs (the kernel-facing calls runtimes' default profiles refuse).
        denied = (
            "kexec_load",
            "kexec_file_load",
            "open_by_handle_at",
            "init_module",
            "finit_module",
            "delete_module",
            "reboot",
            "swapon",
            "swapoff",
            "acct",
            "bpf",
            "perf_event_open",
            "ptrace",
            "keyctl",
            "add_key",
            "request_key",
        )
        return {
            "defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
            "syscalls": [{"names": list(denied), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
        }
    raise InvalidArgument(
        f"seccomp profile {profile[:128]!r} is not supported (use runtime/default, unconfined or localhost/<path>)"
    )


def _mounts(request: ContainerRequest) -> list[dict[str, object]]:
    def kernel_fs(dest: str, fstype: str, source: str, *options: str) -> dict[str, object]:
        return {"destination": dest, "type": fstype, "source": source, "options": list(options)}

    nosuid = ("nosuid", "noexec", "nodev")
    mounts = [
        kernel_fs("/proc", "proc", "proc", *nosuid),
        kernel_fs("/dev", "tmpfs", "tmpfs", "nosuid", "strictatime", "mode=755", "size=65536k"),
        kernel_fs("/dev/pts", "devpts", "devpts", "nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"),
        kernel_fs("/dev/shm", "tmpfs", "shm", *nosuid, "mode=1777", "size=65536k"),
        kernel_fs("/dev/mqueue", "mqueue", "mqueue", *nosuid),
        kernel_fs("/sys", "sysfs", "sysfs", *nosuid, "rw" if request.privileged else "ro"),
        kernel_fs("/sys/fs/cgroup", "cgroup", "cgroup", *nosuid, "relatime", "rw" if request.privileged else "ro"),
    ]
    if request.userns is not None:
        # The guest's network and IPC namespaces (the pod's) belong to the guest's initial user
        # namespace, so the container's cannot mount a sysfs or an mqueue of them: it gets the
        # guest's, bound (the guest agent mounts the mqueue at /dev/mqueue first), as runc does.
        ro = "rw" if request.privileged else "ro"
        mounts[5] = kernel_fs("/sys", "bind", "/sys", "rbind", *nosuid, ro)
        mounts[4] = kernel_fs("/dev/mqueue", "bind", "/dev/mqueue", "rbind", *nosuid)
    for m in request.mounts:
        if not m.destination.startswith("/"):
            raise InvalidArgument(f"mount destination {m.destination[:128]!r} is not absolute")
        if m.hugepage_size:
            options = ["nosuid", "nodev", f"pagesize={m.hugepage_size}", "ro" if m.readonly else "rw"]
            mounts.append({"destination": m.destination, "type": "hugetlbfs", "source": "nodev", "options": options})
            continue
        options = ["rbind", "ro" if m.readonly else "rw"]
        mounts.append({"destination": m.destination, "type": "bind", "source": m.source, "options": options})
    return mounts


def _or(asked: tuple[str, ...] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    return default if asked is None else asked


def build_spec(request: ContainerRequest, image: ImageConfig, user: UserIds) -> dict[str, object]:
    """The OCI runtime spec (as JSON-ready data) of one container."""
    caps = _capabilities(request)
    rlimits = []
    for kind, hard, soft in request.rlimits:
        if kind not in _RLIMIT_NAMES:
            raise InvalidArgument(f"unknown rlimit {kind[:32]!r}")
        if soft > hard:
            raise InvalidArgument(f"rlimit {kind}: soft limit {soft} above hard limit {hard}")
        rlimits.append({"type": kind, "hard": hard, "soft": soft})
    if not any(r["type"] == "RLIMIT_NOFILE" for r in rlimits):
        rlimits.append({"type": "RLIMIT_NOFILE", "hard": 1048576, "soft": 1048576})
    cwd = request.working_dir or image.working_dir or "/"
    if not cwd.startswith("/"):
        raise InvalidArgument(f"working directory {cwd[:128]!r} is not absolute")
    ids: dict[str, object] = {"uid": user.uid, "gid": user.gid}
    from_image = list(user.additional_gids) if request.image_groups else []
    groups = from_image + [g for g in request.supplemental_groups if g not in from_image]
    if groups:
        ids["additionalGids"] = groups
    process: dict[str, object] = {
        "terminal": False,
        "user": ids,
        "args": list(process_args(request, image)),
        "env": list(merged_env(request, image)),
        "cwd": cwd,
        "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted")},
        "rlimits": rlimits,
        "noNewPrivileges": request.no_new_privileges,
        "oomScoreAdj": request.oom_score_adj,
    }  # fmt: skip
    if request.apparmor not in ("", "unconfined", "runtime/default"):
        raise InvalidArgument(f"apparmor profile {request.apparmor[:128]!r} is not supported in the guest")
    if request.userns is not None:
        _check_mapped(request.userns, user.uid, user.gid, groups)
    kinds = ("pid", "uts", "mount", "cgroup") + (("user",) if request.userns is not None else ())
    linux: dict[str, object] = {
        # network and IPC: the guest's, which are the pod's (a VM per pod)
        "namespaces": [{"type": t} for t in kinds if t != "pid" or request.own_pid_namespace],
        "resources": _resources(request.resources),
        "maskedPaths": [] if request.privileged else list(_or(request.masked_paths, MASKED_PATHS)),
        "readonlyPaths": [] if request.privileged else list(_or(request.readonly_paths, READONLY_PATHS)),
    }
    if request.userns is not None:
        linux |= request.userns.oci()
    if request.sysctls:
        for key in request.sysctls:
            if not key.replace(".", "").replace("_", "").replace("-", "").isalnum():
                raise InvalidArgument(f"bad sysctl name {key[:64]!r}")
        linux["sysctl"] = dict(sorted(request.sysctls.items()))
    seccomp = None if request.privileged else _seccomp(request.seccomp, request.seccomp_profile, caps)
    if seccomp is not None:
        linux["seccomp"] = seccomp
    return {
        "ociVersion": OCI_VERSION,
        "process": process,
        "root": {"path": "rootfs", "readonly": request.readonly_rootfs},
        "hostname": request.hostname,
        "mounts": _mounts(request),
        "linux": linux,
    }


def _check_mapped(ns: UserNamespace, uid: int, gid: int, groups: list[int]) -> None:
    """The process's user and groups must be ids the container's user namespace maps (the kernel
    refuses to switch to an unmapped one)."""
    if not ns.maps_uid(uid):
        raise InvalidArgument(f"the container's user {uid} is not mapped by its user namespace's uid mappings")
    for g in [gid, *groups]:
        if not ns.maps_gid(g):
            raise InvalidArgument(f"the container's group {g} is not mapped by its user namespace's gid mappings")


def stop_signal(request_signal: str, image: ImageConfig) -> str:
    """The signal StopContainer sends first: the config's, else the image's, else SIGTERM."""
    sig = (request_signal or image.stop_signal or "SIGTERM").upper()
    name = sig.removeprefix("SIG")
    if not name or not name.replace("+", "").replace("-", "").isalnum() or len(name) > 12:
        raise InvalidArgument(f"bad stop signal {request_signal[:32]!r}")
    return name


def parse_user(spec: str, passwd: Sequence[str], group: Sequence[str]) -> UserIds:
    """Resolves an image or config user ("", "name", "uid", "name:group", "uid:gid") against the
    image's /etc/passwd and /etc/group lines."""
    user, _, grp = spec.partition(":")
    uid: int | None = None
    gid: int | None = None
    name = ""
    if user == "":
        uid = 0
    elif user.isdigit():
        uid = int(user)
    for line in passwd:
        fields = line.split(":")
        if len(fields) < 4 or not fields[2].isdigit() or not fields[3].isdigit():
            continue
        if (uid is None and fields[0] == user) or (uid is not None and int(fields[2]) == uid):
            uid = int(fields[2])
            name = fields[0]
            if not grp:
                gid = int(fields[3])
            break
    if uid is None:
        raise InvalidArgument(f"user {user[:64]!r} is not in the image's /etc/passwd")
    if grp:
        if grp.isdigit():
            gid = int(grp)
        else:
            for line in group:
                fields = line.split(":")
                if len(fields) >= 3 and fields[0] == grp and fields[2].isdigit():
                    gid = int(fields[2])
                    break
            if gid is None:
                raise InvalidArgument(f"group {grp[:64]!r} is not in the image's /etc/group")
    if gid is None:
        gid = 0
    extra: list[int] = []
    if name:
        for line in group:
            fields = line.split(":")
            if len(fields) >= 4 and fields[2].isdigit() and name in fields[3].split(","):
                g = int(fields[2])
                if g != gid and g not in extra:
                    extra.append(g)
    return UserIds(uid=uid, gid=gid, additional_gids=tuple(extra))
