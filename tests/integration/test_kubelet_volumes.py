"""The kubelet's ConfigMap, Secret and projected service-account token volumes in a VM pod, through
the CRI socket with a real guest, on the layout the kubelet's atomic writer makes
(tests/kubelet_layout.py): each reads in the guest as under runc (the ``..data`` and per-key
symlinks resolve), with the owners and modes the kubelet set (``defaultMode``, ``fsGroup``); an
update written on the host the kubelet's way reaches the running container; another pod's
volume is refused."""

from __future__ import annotations

import time
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

APPLETS = ("sh", "cat", "stat", "ls", "readlink", "sleep", "test", "[")
SMALL = q({"cpu": "250m", "memory": "32Mi"})
FS_GROUP = 2000
CA = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


@dataclass
class Env:
    shim: Shim
    image: str
    sandbox: str
    config: pb.PodSandboxConfig
    pods: Path
    cfg: Path
    secret: Path
    token: Path
    container: str = ""


def _mounts(env: Env) -> list[pb.Mount]:
    return [
        pb.Mount(container_path="/etc/cfg", host_path=str(env.cfg), readonly=True),
        pb.Mount(container_path="/etc/sec", host_path=str(env.secret), readonly=True),
        pb.Mount(
            container_path="/var/run/secrets/kubernetes.io/serviceaccount", host_path=str(env.token), readonly=True
        ),
    ]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("kvol")
    with one_image_registry(tmp, busybox_entries(APPLETS), "test/kvol:1") as ref:
        pods = tmp / "pods"
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim", extra_config={"kubelet_pods_dir": str(pods)}, pull_busybox=False) as shim:
            shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            config = pod("kvol", containers=[("app", SMALL), ("other", SMALL)])
            uid = config.metadata.uid
            cfg = volume_dir(pods, uid, "configmap", "cfg")
            write_volume(cfg, {"greeting": b"hello\n", "nested/key": b"n1\n"})
            secret = volume_dir(pods, uid, "secret", "creds")
            write_volume(secret, {"password": b"s3cret\n"}, mode=0o400, fs_group=FS_GROUP)
            token = volume_dir(pods, uid, "projected", "kube-api-access-x1y2z")
            write_volume(
                token, {"token": b"token-1", "ca.crt": CA, "namespace": b"test"}, mode=0o644, fs_group=FS_GROUP
            )
            e = Env(shim, ref, "", config, pods, cfg, secret, token)
            for decl in config.pod_resources.containers:
                decl.mounts.extend(_mounts(e))
            config.log_directory = str(tmp / "logs")
            e.sandbox = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            yield e


def _container(env: Env, name: str, mounts: list[pb.Mount]) -> pb.ContainerConfig:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=env.image),
        command=["sleep", "3600"],
        log_path=f"{name}.log",
        mounts=mounts,
    )
    config.kubernetes_resources.CopyFrom(SMALL)
    return config


def _exec(env: Env, script: str) -> str:
    r = env.shim.runtime.ExecSync(
        pb.ExecSyncRequest(container_id=env.container, cmd=["sh", "-c", script], timeout=30), timeout=60
    )
    assert r.exit_code == 0, (script, r.stdout, r.stderr)
    return r.stdout.decode()


@pytest.fixture(scope="module")
def running(env: Env) -> Env:
    rt = env.shim.runtime
    env.container = rt.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=env.sandbox, config=_container(env, "app", _mounts(env)), sandbox_config=env.config
        ),
        timeout=120,
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=env.container), timeout=120)
    return env


def test_configmap_secret_and_token_read_in_the_guest(running: Env) -> None:
    assert _exec(running, "cat /etc/cfg/greeting /etc/cfg/nested/key") == "hello\nn1\n"
    assert _exec(running, "readlink /etc/cfg/greeting; readlink /etc/cfg/..data").startswith("..data/greeting\n..")
    assert _exec(running, "cat /etc/sec/password") == "s3cret\n"
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert _exec(running, f"cat {sa}/token; echo; cat {sa}/namespace") == "token-1\ntest"
    assert _exec(running, f"cat {sa}/ca.crt").encode() == CA


def test_owners_and_modes_are_the_kubelets(running: Env) -> None:
    # defaultMode 0400 with fsGroup: the kubelet adds group read and gives the group
    assert _exec(running, "stat -L -c '%a %u %g' /etc/sec/password") == f"440 0 {FS_GROUP}\n"
    assert _exec(running, "stat -L -c '%a %u %g' /etc/cfg/greeting") == "644 0 0\n"
    top = _exec(running, "stat -L -c '%a %g' /etc/sec/..data").split()
    assert int(top[0], 8) & 0o2000 and top[1] == str(FS_GROUP)  # a setgid directory of the fsGroup


def test_an_update_on_the_host_reaches_the_running_container(running: Env) -> None:
    write_volume(running.cfg, {"greeting": b"updated\n", "added": b"new\n"})
    write_volume(
        running.token, {"token": b"token-2", "ca.crt": CA, "namespace": b"test"}, mode=0o644, fs_group=FS_GROUP
    )
    deadline = time.monotonic() + 30
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    script = f"cat /etc/cfg/greeting /etc/cfg/added {sa}/token 2>/dev/null; test ! -e /etc/cfg/nested && echo gone"
    while True:
        r = running.shim.runtime.ExecSync(
            pb.ExecSyncRequest(container_id=running.container, cmd=["sh", "-c", script], timeout=30), timeout=60
        )
        if r.stdout.decode() == "updated\nnew\ntoken-2gone\n":
            break
        assert time.monotonic() < deadline, f"the update did not reach the guest: {r.stdout!r} {r.stderr!r}"
        time.sleep(0.5)


def test_another_pods_volume_is_refused(running: Env) -> None:
    stranger = volume_dir(running.pods, "another-pod-uid", "secret", "theirs")
    write_volume(stranger, {"key": b"not yours"})
    mounts = [pb.Mount(container_path="/etc/cfg", host_path=str(stranger), readonly=True)]
    with pytest.raises(grpc.RpcError) as err:
        running.shim.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=running.sandbox,
                config=_container(running, "other", mounts),
                sandbox_config=running.config,
            ),
            timeout=120,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not allowed" in str(err.value.details())
