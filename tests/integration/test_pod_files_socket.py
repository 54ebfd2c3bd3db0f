"""The files a pod's containers share, through the CRI socket with real guests: ``/etc/resolv.conf``
from the pod's DNSConfig and ``/etc/hostname`` (and the UTS host name) from its hostname, unless the
kubelet mounts its own file there."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.image_setup import one_image_registry
from tests.registry_kit import busybox_entries, file
from tests.shim_kit import Shim, pod, q, require_host, run_to_exit, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SMALL = q({"cpu": "250m", "memory": "32Mi"})
DNS = pb.DNSConfig(servers=["10.96.0.10", "fd00::a"], searches=["test.svc.cluster.local", "svc"], options=["ndots:5"])


@dataclass
class Env:
    shim: Shim
    image: str
    sandbox: str
    config: pb.PodSandboxConfig
    logs: Path
    allowed: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("podfiles")
    entries = [*busybox_entries(("sh", "cat", "hostname")), file("etc/resolv.conf", b"nameserver 192.0.2.1\n")]
    with one_image_registry(tmp, entries, "test/files:1") as ref:
        allowed = tmp / "allowed"
        allowed.mkdir()
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim", extra_config={"mount_allowlist": [str(allowed)]}, pull_busybox=False) as shim:
            shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            config = pod("files", containers=[("show", SMALL), ("own", SMALL)])
            (allowed / "resolv.conf").write_text("nameserver 198.51.100.7\n")
            for decl in config.pod_resources.containers:
                if decl.name == "own":
                    decl.mounts.append(_own_resolv_conf(allowed))
            config.hostname = "files-0"
            config.dns_config.CopyFrom(DNS)
            config.log_directory = str(tmp / "logs")
            sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            yield Env(shim, ref, sid, config, tmp / "logs", allowed)


def _own_resolv_conf(allowed: Path) -> pb.Mount:
    return pb.Mount(container_path="/etc/resolv.conf", host_path=str(allowed / "resolv.conf"), readonly=True)


def _output(env: Env, name: str, mounts: list[pb.Mount]) -> list[str]:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=env.image),
        command=["sh", "-c", "cat /etc/resolv.conf; echo --; cat /etc/hostname; echo --; hostname"],
        log_path=f"{name}.log",
        mounts=mounts,
    )
    config.kubernetes_resources.CopyFrom(SMALL)
    return [text for _, text in run_to_exit(env.shim, env.sandbox, env.config, config)]


def test_containers_see_the_pods_dns_settings_and_hostname(env: Env) -> None:
    assert _output(env, "show", []) == [
        "nameserver 10.96.0.10",
        "nameserver fd00::a",
        "search test.svc.cluster.local svc",
        "options ndots:5",
        "--",
        "files-0",
        "--",
        "files-0",
    ]


def test_a_kubelet_mount_on_resolv_conf_wins(env: Env) -> None:
    assert _output(env, "own", [_own_resolv_conf(env.allowed)]) == [
        "nameserver 198.51.100.7",
        "--",
        "files-0",
        "--",
        "files-0",
    ]
