"""What a CRI ContainerConfig asks the guest to run (shim.translate.inbound.container_request) and the
statistics it reports back (shim.translate.stats.container_stats)."""

from __future__ import annotations

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import CONTAINER_CREATED, ContainerRecord, ContainerStats, ImageVolume, MountRequest, image_volumes
from shim.translate import inbound, outbound, stats
from vmsandbox.agent_ops import CgroupStats
from vmsandbox.errors import InvalidArgument, Unsupported
from vmsandbox.resources import ContainerResources, Mount


def _config(**security: object) -> pb.ContainerConfig:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="app"),
        command=["sh"],
        args=["-c", "true"],
        envs=[pb.KeyValue(key="A", value=b"1")],
        working_dir="/srv",
        stop_signal=pb.SIGNAL_SIGQUIT,
    )
    config.linux.security_context.CopyFrom(pb.LinuxContainerSecurityContext(**security))  # type: ignore[arg-type]
    config.linux.resources.CopyFrom(
        pb.LinuxContainerResources(cpu_quota=50_000, cpu_period=100_000, memory_limit_in_bytes=1 << 26)
    )
    return config


def test_command_env_resources_signal() -> None:
    request, user, signal = inbound.container_request(_config(), {"kernel.shm_rmid_forced": "1"})
    assert (request.command, request.args, request.env, request.working_dir) == (
        ("sh",),
        ("-c", "true"),
        (("A", "1"),),
        "/srv",
    )
    assert (request.hostname, user, signal) == ("", "", "SIGQUIT")  # the pod's hostname comes from its owner
    assert request.resources.memory_limit_bytes == 1 << 26 and request.resources.cpu_quota_us == 50_000
    assert request.sysctls == {"kernel.shm_rmid_forced": "1"}


@pytest.mark.parametrize(
    ("security", "user"),
    [
        ({"run_as_user": pb.Int64Value(value=1000)}, "1000"),
        ({"run_as_user": pb.Int64Value(value=0), "run_as_group": pb.Int64Value(value=5)}, "0:5"),
        ({"run_as_username": "www"}, "www"),
        ({}, ""),
    ],
)
def test_user_spec(security: dict[str, object], user: str) -> None:
    assert inbound.container_request(_config(**security), {})[1] == user


@pytest.mark.parametrize(
    ("policy", "image_groups"),
    [(pb.SupplementalGroupsPolicy.Merge, True), (pb.SupplementalGroupsPolicy.Strict, False)],
)
def test_supplemental_groups_policy(policy: int, image_groups: bool) -> None:
    request = inbound.container_request(_config(supplemental_groups=[1234], supplemental_groups_policy=policy), {})[0]
    assert (request.supplemental_groups, request.image_groups) == ((1234,), image_groups)


def test_a_supplemental_groups_policy_the_cri_does_not_define_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="supplemental_groups_policy 7"):
        inbound.container_request(_config(supplemental_groups_policy=7), {})


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        (pb.SecurityProfile(profile_type=pb.SecurityProfile.ProfileType.RuntimeDefault), "runtime/default"),
        (pb.SecurityProfile(profile_type=pb.SecurityProfile.ProfileType.Unconfined), "unconfined"),
        (
            pb.SecurityProfile(profile_type=pb.SecurityProfile.ProfileType.Localhost, localhost_ref="p.json"),
            "localhost/p.json",
        ),
    ],
)
def test_seccomp_profiles(profile: pb.SecurityProfile, expected: str) -> None:
    request, _, _ = inbound.container_request(_config(seccomp=profile), {})
    assert request.seccomp == expected


def test_stats_carry_cpu_memory_and_writable_layer() -> None:
    c = ContainerRecord(
        id="c" * 64, sandbox_id="s" * 64, name="app", attempt=0, state="CONTAINER_RUNNING", created_ns=1
    )
    s = CgroupStats(5, 2_000_000, 300, 200, 100, 7, 1, 2, 4096, 3)
    out = stats.container_stats(ContainerStats(c, s, 1500), "/var/lib/vmsandbox/state")
    assert out.attributes.id == c.id and out.attributes.metadata.name == "app"
    assert (out.cpu.usage_core_nano_seconds.value, out.cpu.usage_nano_cores.value) == (2_000_000, 1500)
    assert (out.memory.working_set_bytes.value, out.memory.usage_bytes.value) == (200, 300)
    assert (out.writable_layer.used_bytes.value, out.writable_layer.inodes_used.value) == (4096, 3)
    assert out.writable_layer.fs_id.mountpoint == "/var/lib/vmsandbox/state"
    empty = stats.container_stats(ContainerStats(c, None, None), "/var/lib/vmsandbox/state")
    assert not empty.HasField("cpu") and not empty.HasField("memory")


@pytest.mark.parametrize(
    ("mount", "error"),
    [
        (pb.Mount(container_path="/a", host_path="/h", readonly=True, recursive_read_only=True), None),
        (pb.Mount(container_path="/a", host_path="/h"), None),
        (pb.Mount(container_path="/a", host_path="/h", recursive_read_only=True), "needs readonly"),
        (
            pb.Mount(
                container_path="/a",
                host_path="/h",
                readonly=True,
                recursive_read_only=True,
                propagation=pb.PROPAGATION_HOST_TO_CONTAINER,
            ),
            "needs private propagation, not PROPAGATION_HOST_TO_CONTAINER",
        ),
        (
            pb.Mount(container_path="/a", readonly=True, recursive_read_only=True, propagation=77),  # type: ignore[arg-type]
            "propagation 77 is not a MountPropagation",
        ),
    ],
)
def test_mount_requests(mount: pb.Mount, error: str | None) -> None:
    if error is None:
        (got,) = inbound.mount_requests([mount], "mounts")
        assert got == MountRequest("/a", "/h", mount.readonly, mount.recursive_read_only)
    else:
        with pytest.raises(InvalidArgument, match=error):
            inbound.mount_requests([mount], "mounts")


_IMAGE = pb.ImageSpec(image="sha256:" + "ab" * 32, user_specified_image="registry.local/data:1")


@pytest.mark.parametrize(
    ("mount", "want", "error"),
    [
        # read-only whatever the kubelet says: an image's tree is never written
        (
            pb.Mount(container_path="/d", image=_IMAGE),
            MountRequest("/d", "", True, image=ImageVolume(_IMAGE.image)),
            None,
        ),
        (
            pb.Mount(container_path="/d", image=_IMAGE, readonly=True, image_sub_path="etc/x"),
            MountRequest("/d", "", True, image=ImageVolume(_IMAGE.image, "etc/x")),
            None,
        ),
        (
            pb.Mount(container_path="/d", image=_IMAGE, image_sub_path="./etc//x/"),
            MountRequest("/d", "", True, image=ImageVolume(_IMAGE.image, "etc/x")),
            None,
        ),
        (
            pb.Mount(container_path="/d", image=_IMAGE, readonly=True, recursive_read_only=True, selinux_relabel=True),
            MountRequest("/d", "", True, True, selinux_relabel=True, image=ImageVolume(_IMAGE.image)),
            None,
        ),
        (pb.Mount(container_path="/d", image_sub_path="etc"), None, "image.image is empty"),
        (pb.Mount(container_path="/d", image=_IMAGE, host_path="/h"), None, "has no host_path"),
        (pb.Mount(container_path="/d", image=_IMAGE, image_sub_path="/etc"), None, "must be relative"),
        (pb.Mount(container_path="/d", image=_IMAGE, image_sub_path="a/../../b"), None, r"must not leave"),
        (pb.Mount(container_path="/d", image=_IMAGE, image_sub_path="a\x00b"), None, "control character"),
        (pb.Mount(container_path="/d", image=pb.ImageSpec(image="x\n")), None, "control character"),
        (
            pb.Mount(container_path="/d", image=_IMAGE, propagation=pb.PROPAGATION_BIDIRECTIONAL),
            None,
            "propagation must be PROPAGATION_PRIVATE, not PROPAGATION_BIDIRECTIONAL",
        ),
        (
            pb.Mount(container_path="/d", image=_IMAGE, uidMappings=[pb.IDMapping(host_id=1, length=1)]),
            None,
            r"an idmapped image volume \(uidMappings, gidMappings: a pod with a user namespace of its own\)",
        ),
        (pb.Mount(container_path="/d", image=_IMAGE, mount_options=["noexec"]), None, "mount_options"),
    ],
)
def test_image_volume_mounts(mount: pb.Mount, want: MountRequest | None, error: str | None) -> None:
    if error is None:
        assert inbound.mount_requests([mount], "mounts") == (want,)
    else:
        with pytest.raises((InvalidArgument, Unsupported), match=error):
            inbound.mount_requests([mount], "mounts")


def test_image_volumes_keep_their_place_among_the_mounts() -> None:
    mounts = inbound.mount_requests(
        [
            pb.Mount(container_path="/a", host_path="/h"),
            pb.Mount(container_path="/b", image=_IMAGE, image_sub_path="x"),
            pb.Mount(container_path="/c", image=_IMAGE),
        ],
        "mounts",
    )
    assert image_volumes(mounts) == {1: ImageVolume(_IMAGE.image, "x"), 2: ImageVolume(_IMAGE.image)}
    assert [m.declared().host_path for m in mounts] == ["/h", "", ""]


def test_an_empty_image_spec_beside_a_host_path_is_an_ordinary_mount() -> None:
    mount = pb.Mount(container_path="/a", host_path="/h", image=pb.ImageSpec())
    assert inbound.mount_requests([mount], "mounts") == (MountRequest("/a", "/h"),)


def test_container_status_reports_the_mounts() -> None:
    record = ContainerRecord(
        id="c" * 64,
        sandbox_id="s" * 64,
        name="app",
        attempt=0,
        state=CONTAINER_CREATED,
        created_ns=1,
        resources=ContainerResources(mounts=frozenset({Mount("/m", "/h", readonly=True, propagation=2)})),
    )
    (m,) = outbound.container_status(record).mounts
    assert (m.container_path, m.host_path, m.readonly, m.recursive_read_only, m.propagation) == (
        "/m",
        "/h",
        True,
        False,
        pb.PROPAGATION_BIDIRECTIONAL,
    )


@pytest.mark.parametrize(
    ("propagation", "mode"),
    [
        (pb.PROPAGATION_PRIVATE, "private"),
        (pb.PROPAGATION_HOST_TO_CONTAINER, "host-to-container"),
        (pb.PROPAGATION_BIDIRECTIONAL, "bidirectional"),
    ],
)
def test_mount_propagation(propagation: int, mode: str) -> None:
    mount = pb.Mount(container_path="/a", host_path="/h", propagation=propagation)  # type: ignore[arg-type]
    assert inbound.mount_requests([mount], "mounts") == (MountRequest("/a", "/h", propagation=mode),)


@pytest.mark.parametrize("value", [-1, 999])
def test_a_stop_signal_the_cri_does_not_define_is_invalid(value: int) -> None:
    config = _config()
    config.stop_signal = value  # type: ignore[assignment]
    with pytest.raises(InvalidArgument, match=f"stop_signal {value} is not a signal"):
        inbound.container_request(config, {})


def test_container_status_reports_an_image_volume_as_the_kubelet_sent_it() -> None:
    (request,) = inbound.mount_requests([pb.Mount(container_path="/d", image=_IMAGE, image_sub_path="x")], "mounts")
    record = ContainerRecord(
        id="c" * 64,
        sandbox_id="s" * 64,
        name="app",
        attempt=0,
        state=CONTAINER_CREATED,
        created_ns=1,
        resources=ContainerResources(mounts=frozenset({request.declared()})),
    )
    (m,) = outbound.container_status(record).mounts
    assert (m.container_path, m.host_path, m.readonly, m.image.image, m.image_sub_path) == (
        "/d",
        "",
        True,
        _IMAGE.image,
        "x",
    )


def test_a_declared_image_volume_matches_the_containers() -> None:
    """A pod's declaration (KEP-4112) names an image volume as the container config does: admission
    compares the two as one mount (read-only, the sub path cleaned) and tells images apart."""
    mount = pb.Mount(container_path="/d", image=_IMAGE, image_sub_path="./x")
    (asked,) = inbound.mount_requests([mount], "mounts")
    assert inbound._mounts([mount], "declared") == frozenset({asked.declared()})
    other = pb.Mount(container_path="/d", image=pb.ImageSpec(image="other:1"), image_sub_path="x")
    assert inbound._mounts([other], "declared") != frozenset({asked.declared()})
