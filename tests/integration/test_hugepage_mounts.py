"""Hugepages in containers, through the CRI socket with real guests: a container that declared
hugepages-2Mi finds a hugetlbfs of that page size at /dev/hugepages (from its guest's own pool),
and a kubelet-style HugePages emptyDir (a host path on a hugetlbfs mount) becomes a hugetlbfs
mount in the guest; a container that declared none gets no such mount."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import Shim, container, pod, q, require_host, run_to_exit, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

HUGE = q({"cpu": "250m", "memory": "32Mi", "hugepages-2Mi": "4Mi"})
PLAIN = q({"cpu": "250m", "memory": "32Mi"})


@dataclass
class Env:
    shim: Shim
    sandbox: str
    config: pb.PodSandboxConfig
    empty_dir: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("hugepages")
    allowed = tmp / "allowed"
    empty_dir = allowed / "hp"
    empty_dir.mkdir(parents=True)
    # what the kubelet makes for a `medium: HugePages-2Mi` emptyDir
    subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "nodev", str(empty_dir)], check=True)
    try:
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim", extra_config={"mount_allowlist": [str(allowed)]}) as shim:
            config = pod("hp", containers=[("huge", HUGE), ("dir", HUGE), ("plain", PLAIN)])
            for decl in config.pod_resources.containers:
                if decl.name == "dir":
                    decl.mounts.append(pb.Mount(container_path="/hp", host_path=str(empty_dir)))
            config.log_directory = str(tmp / "logs")
            sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            yield Env(shim, sid, config, empty_dir)
    finally:
        subprocess.run(["umount", str(empty_dir)], check=False)


def _mounts_seen(env: Env, name: str, res: pb.KubernetesResources, mounts: list[pb.Mount]) -> list[str]:
    c = container(name, res)
    c.command[:] = ["sh", "-c", "cat /proc/mounts"]
    c.log_path = f"{name}.log"
    c.mounts.extend(mounts)
    if "hugepages-2Mi" in res.limits:
        c.linux.resources.hugepage_limits.append(pb.HugepageLimit(page_size="2MB", limit=4 << 20))
    return [text for _, text in run_to_exit(env.shim, env.sandbox, env.config, c) if " hugetlbfs " in text]


def test_declared_hugepages_are_mounted_at_dev_hugepages(env: Env) -> None:
    (line,) = _mounts_seen(env, "huge", HUGE, [])
    fields = line.split()
    assert fields[1] == "/dev/hugepages" and fields[2] == "hugetlbfs" and "pagesize=2M" in fields[3]


def test_a_hugepages_empty_dir_becomes_the_guests_hugetlbfs(env: Env) -> None:
    mounts = _mounts_seen(env, "dir", HUGE, [pb.Mount(container_path="/hp", host_path=str(env.empty_dir))])
    assert [m.split()[1] for m in mounts] == ["/hp"]
    assert "pagesize=2M" in mounts[0]


def test_no_hugepages_no_mount(env: Env) -> None:
    assert _mounts_seen(env, "plain", PLAIN, []) == []
