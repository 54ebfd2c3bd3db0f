"""A pod with a user namespace of its own (KEP-127, hostUsers: false) through the CRI socket with a
real guest, sent as a kubelet sends it: ``userns_options`` in mode POD with one uid and gid
mapping in the sandbox's and the container's config, and the same idmapping on each mount. The
container's ``/proc/self/uid_map`` and ``gid_map`` are exactly those mappings, it is root inside,
its image's files are root's to it (the idmapped image disk) and it writes its root file system;
its ConfigMap, Secret and token volumes read with the kubelet's owners (root, the fsGroup), as
through containerd's idmapped binds. A container whose namespace is not its pod's is refused."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.image_setup import one_image_registry
from tests.kubelet_layout import volume_dir, write_volume
from tests.registry_kit import busybox_entries
from tests.shim_kit import Shim, pod, q, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APPLETS = ("sh", "cat", "stat", "id", "touch", "sleep", "tr")
SMALL = q({"cpu": "250m", "memory": "32Mi"})
HOST_ID = 131072  # the kubelet's choice: a multiple of 65536 past its own ids
LENGTH = 65536
FS_GROUP = 2000


def _userns(options: pb.NamespaceOption, host_id: int = HOST_ID) -> None:
    options.userns_options.mode = pb.POD
    options.userns_options.uids.add(host_id=host_id, container_id=0, length=LENGTH)
    options.userns_options.gids.add(host_id=host_id, container_id=0, length=LENGTH)


def _idmapped(m: pb.Mount, host_id: int = HOST_ID) -> pb.Mount:
    m.uidMappings.add(host_id=host_id, container_id=0, length=LENGTH)
    m.gidMappings.add(host_id=host_id, container_id=0, length=LENGTH)
    return m


@dataclass
class Env:
    shim: Shim
    image: str
    sandbox: str
    config: pb.PodSandboxConfig
    cfg: Path
    secret: Path
    token: Path
    scratch: Path
    container: str = ""

    def mounts(self, host_id: int = HOST_ID) -> list[pb.Mount]:
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        return [
            _idmapped(pb.Mount(container_path="/etc/cfg", host_path=str(self.cfg), readonly=True), host_id),
            _idmapped(pb.Mount(container_path="/etc/sec", host_path=str(self.secret), readonly=True), host_id),
            _idmapped(pb.Mount(container_path=sa, host_path=str(self.token), readonly=True), host_id),
            _idmapped(pb.Mount(container_path="/scratch", host_path=str(self.scratch)), host_id),
        ]

    def container_config(self, name: str, host_id: int = HOST_ID) -> pb.ContainerConfig:
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name),
            image=pb.ImageSpec(image=self.image),
            command=["sleep", "3600"],
            log_path=f"{name}.log",
            mounts=self.mounts(host_id),
        )
        config.kubernetes_resources.CopyFrom(SMALL)
        options = config.linux.security_context.namespace_options
        options.pid = pb.CONTAINER  # the kubelet's default
        _userns(options, host_id)
        return config


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("userns")
    with one_image_registry(tmp, busybox_entries(APPLETS), "test/userns:1") as ref:
        pods = tmp / "pods"
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim", extra_config={"kubelet_pods_dir": str(pods)}, pull_busybox=False) as shim:
            shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            config = pod("userns", containers=[("app", SMALL), ("other", SMALL)])
            uid = config.metadata.uid
            cfg = volume_dir(pods, uid, "configmap", "cfg")
            write_volume(cfg, {"greeting": b"hello\n"})
            secret = volume_dir(pods, uid, "secret", "creds")
            write_volume(secret, {"password": b"s3cret\n"}, mode=0o440, fs_group=FS_GROUP)
            token = volume_dir(pods, uid, "projected", "kube-api-access-u1")
            write_volume(token, {"token": b"token-1", "namespace": b"test"}, mode=0o600)
            token.chmod(0o1777)  # a projected volume is a tmpfs of its own, sticky and world-writable
            scratch = volume_dir(pods, uid, "empty-dir", "scratch")
            scratch.mkdir(parents=True, exist_ok=True)
            scratch.chmod(0o777)  # as the kubelet makes an emptyDir
            e = Env(shim, ref, "", config, cfg, secret, token, scratch)
            for decl in config.pod_resources.containers:
                decl.mounts.extend(
                    pb.Mount(container_path=m.container_path, host_path=m.host_path, readonly=m.readonly)
                    for m in e.mounts()
                )
            config.log_directory = str(tmp / "logs")
            _userns(config.linux.security_context.namespace_options)
            e.sandbox = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            yield e


@pytest.fixture(scope="module")
def running(env: Env) -> Env:
    rt = env.shim.runtime
    env.container = rt.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=env.sandbox, config=env.container_config("app"), sandbox_config=env.config
        ),
        timeout=120,
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=env.container), timeout=120)
    return env


def _exec(env: Env, script: str) -> str:
    r = env.shim.runtime.ExecSync(
        pb.ExecSyncRequest(container_id=env.container, cmd=["sh", "-c", script], timeout=30), timeout=60
    )
    assert r.exit_code == 0, (script, r.stdout, r.stderr)
    return r.stdout.decode()


def test_the_container_has_exactly_the_kubelets_mappings_and_is_root_in_them(running: Env) -> None:
    squeeze = "tr -s ' '"
    assert _exec(running, f"cat /proc/self/uid_map | {squeeze}").strip() == f"0 {HOST_ID} {LENGTH}"
    assert _exec(running, f"cat /proc/self/gid_map | {squeeze}").strip() == f"0 {HOST_ID} {LENGTH}"
    assert _exec(running, "id -u; id -g").split() == ["0", "0"]


def test_its_image_is_roots_to_it_and_its_root_file_system_writable(running: Env) -> None:
    assert _exec(running, "stat -c '%u %g' / /bin/busybox /etc").split("\n")[:3] == ["0 0"] * 3
    out = _exec(running, "echo made > /etc/made && touch /tmp/t && stat -c '%u %g' /etc/made /tmp/t && cat /etc/made")
    assert out.split("\n")[:3] == ["0 0", "0 0", "made"]


def test_its_volumes_read_with_the_kubelets_owners(running: Env) -> None:
    assert _exec(running, "cat /etc/cfg/greeting; stat -L -c '%u %g %a' /etc/cfg/greeting") == "hello\n0 0 644\n"
    assert _exec(running, "cat /etc/sec/password; stat -L -c '%u %g %a' /etc/sec/password") == (
        f"s3cret\n0 {FS_GROUP} 440\n"
    )
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert _exec(running, f"cat {sa}/token; echo; stat -L -c '%u %g %a' {sa}/token") == "token-1\n0 0 600\n"
    # its links are the volume directory's owner's, so the kernel follows them in a sticky directory
    assert _exec(running, f"stat -c '%u %g' {sa} {sa}/..data {sa}/token").split("\n")[:3] == ["0 0"] * 3


def test_a_shared_volume_is_writable_but_shows_no_host_owner(running: Env) -> None:
    """A volume shared over 9p (an emptyDir here) cannot be idmapped in the guest: what the kubelet
    made there shows as the overflow id, reached through its mode; what the container makes is its own."""
    out = _exec(running, "stat -c '%u %g %a' /scratch; echo w > /scratch/f && stat -c '%u %g' /scratch/f")
    assert out.split("\n")[:2] == ["65534 65534 777", "0 0"]
    assert (running.scratch / "f").read_text() == "w\n"


def test_the_sandbox_status_echoes_the_namespace(running: Env) -> None:
    st = running.shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=running.sandbox)).status
    u = st.linux.namespaces.options.userns_options
    assert u.mode == pb.POD and [(m.container_id, m.host_id, m.length) for m in u.uids] == [(0, HOST_ID, LENGTH)]


def test_a_container_in_another_namespace_is_refused(running: Env) -> None:
    with pytest.raises(grpc.RpcError) as err:
        running.shim.runtime.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=running.sandbox, config=running.container_config("other", 196608)),
            timeout=120,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not its pod's (uids [0 131072 65536]" in str(err.value.details())
