"""The OCI spec of a container: merge of the CRI request and the image config (vmsandbox.oci_spec)."""

from __future__ import annotations

import pytest

from vmsandbox.errors import InvalidArgument
from vmsandbox.oci_spec import (
    DEFAULT_CAPABILITIES,
    DEFAULT_PATH,
    ContainerRequest,
    ImageConfig,
    Mount,
    Resources,
    UserIds,
    build_spec,
    merged_env,
    parse_user,
    process_args,
    stop_signal,
)
from vmsandbox.userns import IdMapping, UserNamespace

IMAGE = ImageConfig(entrypoint=("/entry",), cmd=("serve", "--port=80"), env=("PATH=/img/bin", "A=image"))
ROOT = UserIds(0, 0)


@pytest.mark.parametrize(
    ("command", "args", "image", "expected"),
    [
        ((), (), IMAGE, ("/entry", "serve", "--port=80")),
        ((), ("other",), IMAGE, ("/entry", "other")),
        (("/bin/sh",), (), IMAGE, ("/bin/sh",)),
        (("/bin/sh",), ("-c", "true"), IMAGE, ("/bin/sh", "-c", "true")),
        ((), (), ImageConfig(cmd=("sh",)), ("sh",)),
        ((), ("x",), ImageConfig(cmd=("sh",)), ("x",)),
    ],
)
def test_argv_follows_the_kubelet_rules(
    command: tuple[str, ...], args: tuple[str, ...], image: ImageConfig, expected: tuple[str, ...]
) -> None:
    assert process_args(ContainerRequest(command=command, args=args), image) == expected


def test_no_command_anywhere_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="no command"):
        process_args(ContainerRequest(), ImageConfig())


@pytest.mark.parametrize(
    ("image_env", "env", "expected"),
    [
        ((), (), (f"PATH={DEFAULT_PATH}",)),
        (("PATH=/img/bin", "A=image"), (("A", "ctr"),), ("PATH=/img/bin", "A=ctr")),
        (("A=1",), (("B", "2"),), ("A=1", "B=2", f"PATH={DEFAULT_PATH}")),
        (("BROKEN",), (), (f"PATH={DEFAULT_PATH}",)),
    ],
)
def test_env_image_then_container(
    image_env: tuple[str, ...], env: tuple[tuple[str, str], ...], expected: tuple[str, ...]
) -> None:
    assert merged_env(ContainerRequest(env=env), ImageConfig(env=image_env)) == expected


@pytest.mark.parametrize("key", ["", "A=B", "A\x00"])
def test_bad_env_names_are_refused(key: str) -> None:
    with pytest.raises(InvalidArgument, match="environment variable"):
        merged_env(ContainerRequest(env=((key, "v"),)), ImageConfig())


PASSWD = ("root:x:0:0:root:/root:/bin/sh", "www:x:33:33::/var/www:/bin/false", "bad:line")
GROUP = ("root:x:0:", "www:x:33:", "media:x:500:www,other", "video:x:44:www")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", UserIds(0, 0)),
        ("0", UserIds(0, 0)),
        ("www", UserIds(33, 33, (500, 44))),
        ("33", UserIds(33, 33, (500, 44))),
        ("www:media", UserIds(33, 500, (44,))),
        ("1000", UserIds(1000, 0)),
        ("1000:1000", UserIds(1000, 1000)),
        ("www:0", UserIds(33, 0, (500, 44))),
    ],
)
def test_user_from_the_image_files(spec: str, expected: UserIds) -> None:
    assert parse_user(spec, PASSWD, GROUP) == expected


@pytest.mark.parametrize(
    ("spec", "problem"), [("nobody", "not in the image's /etc/passwd"), ("www:nogroup", "/etc/group")]
)
def test_unknown_user_or_group(spec: str, problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        parse_user(spec, PASSWD, GROUP)


def test_spec_carries_limits_caps_and_namespaces() -> None:
    request = ContainerRequest(
        command=("sh",),
        working_dir="/work",
        readonly_rootfs=True,
        add_capabilities=("sys_time",),
        drop_capabilities=("NET_RAW", "CAP_MKNOD"),
        sysctls={"net.core.somaxconn": "1024"},
        rlimits=(("RLIMIT_NOFILE", 1024, 512),),
        seccomp="runtime/default",
        resources=Resources(
            cpu_quota_us=50_000, cpu_period_us=100_000, cpu_shares=512, memory_limit_bytes=64 << 20, pids_limit=100
        ),
        mounts=(Mount("/etc/hosts", "/shared/hosts", readonly=True),),
    )
    spec = build_spec(request, IMAGE, UserIds(33, 33, (44,)))
    process = spec["process"]
    assert isinstance(process, dict)
    assert process["cwd"] == "/work"
    assert process["user"] == {"uid": 33, "gid": 33, "additionalGids": [44]}
    caps = process["capabilities"]["bounding"]
    assert "CAP_SYS_TIME" in caps and "CAP_NET_RAW" not in caps and "CAP_MKNOD" not in caps
    assert process["rlimits"] == [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 512}]
    assert spec["root"] == {"path": "rootfs", "readonly": True}
    linux = spec["linux"]
    assert isinstance(linux, dict)
    assert {"type": "cgroup"} in linux["namespaces"]
    assert linux["resources"] == {
        "memory": {"limit": 64 << 20, "swap": 64 << 20},
        "cpu": {"quota": 50_000, "period": 100_000, "shares": 512},
        "pids": {"limit": 100},
    }
    assert linux["sysctl"] == {"net.core.somaxconn": "1024"}
    assert linux["seccomp"]["defaultAction"] == "SCMP_ACT_ALLOW"
    mounts = spec["mounts"]
    assert isinstance(mounts, list)
    assert mounts[-1] == {
        "destination": "/etc/hosts",
        "type": "bind",
        "source": "/shared/hosts",
        "options": ["rbind", "ro"],
    }


def test_defaults_without_limits() -> None:
    spec = build_spec(ContainerRequest(command=("sh",)), ImageConfig(), ROOT)
    linux = spec["linux"]
    assert isinstance(linux, dict)
    assert linux["resources"] == {}
    assert "seccomp" not in linux and "sysctl" not in linux
    process = spec["process"]
    assert isinstance(process, dict)
    assert process["capabilities"]["effective"] == list(DEFAULT_CAPABILITIES)


def test_drop_all_then_add() -> None:
    spec = build_spec(
        ContainerRequest(command=("sh",), drop_capabilities=("ALL",), add_capabilities=("CHOWN",)), IMAGE, ROOT
    )
    assert spec["process"]["capabilities"]["permitted"] == ["CAP_CHOWN"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("request_", "problem"),
    [
        (ContainerRequest(command=("sh",), seccomp="localhost/prof.json"), "seccomp profile"),
        (ContainerRequest(command=("sh",), apparmor="localhost/p"), "apparmor"),
        (ContainerRequest(command=("sh",), rlimits=(("RLIMIT_BOGUS", 1, 1),)), "unknown rlimit"),
        (ContainerRequest(command=("sh",), rlimits=(("RLIMIT_NOFILE", 1, 2),)), "soft limit 2 above hard"),
        (ContainerRequest(command=("sh",), working_dir="rel"), "not absolute"),
        (ContainerRequest(command=("sh",), add_capabilities=("bad cap!",)), "bad capability"),
        (ContainerRequest(command=("sh",), sysctls={"a/b": "1"}), "bad sysctl"),
        (ContainerRequest(command=("sh",), mounts=(Mount("rel", "/x"),)), "not absolute"),
    ],
)
def test_refusals_name_the_problem(request_: ContainerRequest, problem: str) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        build_spec(request_, IMAGE, ROOT)


@pytest.mark.parametrize(
    ("requested", "image", "expected"),
    [("", "", "TERM"), ("", "SIGQUIT", "QUIT"), ("SIGINT", "SIGQUIT", "INT"), ("sigusr1", "", "USR1"), ("9", "", "9")],
)
def test_stop_signal(requested: str, image: str, expected: str) -> None:
    assert stop_signal(requested, ImageConfig(stop_signal=image)) == expected


def test_bad_stop_signal() -> None:
    with pytest.raises(InvalidArgument, match="bad stop signal"):
        stop_signal("SIG;rm", ImageConfig())


@pytest.mark.parametrize(
    ("own", "namespaces"), [(True, ["pid", "uts", "mount", "cgroup"]), (False, ["uts", "mount", "cgroup"])]
)
def test_namespaces_network_and_ipc_are_the_pods(own: bool, namespaces: list[str]) -> None:
    spec = build_spec(ContainerRequest(command=("sh",), own_pid_namespace=own), IMAGE, ROOT)
    assert [n["type"] for n in spec["linux"]["namespaces"]] == namespaces  # type: ignore[index]


def test_privileged_gets_every_capability_and_no_masks() -> None:
    spec = build_spec(ContainerRequest(command=("sh",), privileged=True, seccomp="runtime/default"), IMAGE, ROOT)
    linux = spec["linux"]
    assert isinstance(linux, dict)
    assert "CAP_SYS_ADMIN" in spec["process"]["capabilities"]["bounding"]  # type: ignore[index]
    assert (linux["maskedPaths"], linux["readonlyPaths"]) == ([], [])
    assert "seccomp" not in linux


def test_masked_paths_as_asked() -> None:
    spec = build_spec(ContainerRequest(command=("sh",), masked_paths=("/proc/x",), readonly_paths=()), IMAGE, ROOT)
    assert (spec["linux"]["maskedPaths"], spec["linux"]["readonlyPaths"]) == (["/proc/x"], [])  # type: ignore[index]


NS = UserNamespace((IdMapping(0, 65536, 65536),), (IdMapping(0, 65536, 1000), IdMapping(1000, 300000, 10)))


@pytest.mark.parametrize(
    ("user", "groups", "problem"),
    [
        (ROOT, (), None),
        (UserIds(65535, 999, (1005,)), (1009,), None),
        (UserIds(65536, 0), (), "the container's user 65536 is not mapped by its user namespace's uid mappings"),
        (UserIds(0, 1010), (), "the container's group 1010 is not mapped by its user namespace's gid mappings"),
        (UserIds(0, 0, (2000,)), (), "the container's group 2000 is not mapped"),
        (ROOT, (1010,), "the container's group 1010 is not mapped"),
    ],
)
def test_a_user_namespace_gets_exactly_its_mappings(
    user: UserIds, groups: tuple[int, ...], problem: str | None
) -> None:
    request = ContainerRequest(command=("sh",), userns=NS, supplemental_groups=groups)
    if problem is not None:
        with pytest.raises(InvalidArgument, match=problem):
            build_spec(request, IMAGE, user)
        return
    spec = build_spec(request, IMAGE, user)
    linux = spec["linux"]
    assert [n["type"] for n in linux["namespaces"]] == ["pid", "uts", "mount", "cgroup", "user"]  # type: ignore[index]
    assert linux["uidMappings"] == [{"containerID": 0, "hostID": 65536, "size": 65536}]  # type: ignore[index]
    assert linux["gidMappings"] == [  # type: ignore[index]
        {"containerID": 0, "hostID": 65536, "size": 1000},
        {"containerID": 1000, "hostID": 300000, "size": 10},
    ]
    assert spec["process"]["user"]["uid"] == user.uid  # type: ignore[index]  # ids inside the namespace


def test_without_a_user_namespace_the_spec_has_no_mappings() -> None:
    linux = build_spec(ContainerRequest(command=("sh",)), IMAGE, UserIds(70000, 70000))["linux"]
    assert "uidMappings" not in linux and "gidMappings" not in linux  # type: ignore[operator]


@pytest.mark.parametrize("privileged", [False, True])
def test_a_user_namespace_binds_the_guests_sysfs_and_mqueue(privileged: bool) -> None:
    mounts = build_spec(ContainerRequest(command=("sh",), userns=NS, privileged=privileged), IMAGE, ROOT)["mounts"]
    by_dest = {m["destination"]: m for m in mounts}  # type: ignore[attr-defined]
    ro = "rw" if privileged else "ro"
    assert by_dest["/sys"] == {
        "destination": "/sys",
        "type": "bind",
        "source": "/sys",
        "options": ["rbind", "nosuid", "noexec", "nodev", ro],
    }
    assert by_dest["/dev/mqueue"] == {
        "destination": "/dev/mqueue",
        "type": "bind",
        "source": "/dev/mqueue",
        "options": ["rbind", "nosuid", "noexec", "nodev"],
    }
    assert by_dest["/sys/fs/cgroup"]["type"] == "cgroup"  # its own cgroup namespace's, mounted
    plain = {m["destination"]: m["type"] for m in build_spec(ContainerRequest(command=("sh",)), IMAGE, ROOT)["mounts"]}  # type: ignore[attr-defined]
    assert (plain["/sys"], plain["/dev/mqueue"]) == ("sysfs", "mqueue")


@pytest.mark.parametrize(
    ("image_groups", "supplemental", "groups"),
    [
        (True, (), [50000]),  # Merge: the image's /etc/group membership
        (True, (1234,), [50000, 1234]),
        (True, (50000, 1234), [50000, 1234]),  # asked again: once
        (False, (1234,), [1234]),  # Strict: only what the config asks
        (False, (), None),
    ],
)
def test_supplemental_groups_policy(
    image_groups: bool, supplemental: tuple[int, ...], groups: list[int] | None
) -> None:
    request = ContainerRequest(command=("sh",), supplemental_groups=supplemental, image_groups=image_groups)
    process = build_spec(request, IMAGE, UserIds(1000, 1000, (50000,)))["process"]
    assert isinstance(process, dict)
    assert process["user"].get("additionalGids") == groups
