"""containerd/nri's own sample plugins against a real shim and a real guest.

``NRI_STOCK_PLUGINS`` names a directory with ``logger`` and ``ulimit-adjuster`` built from the
nri repository's plugins/ by tests/nri_plugin/build-stock.sh (unchanged sources, built offline
against the nri that containerd vendors); these tests skip without it. Both connect to the
shim's NRI socket as external plugins, as they are deployed on a node.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import Shim, pod, q, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STOCK = Path(os.environ.get("NRI_STOCK_PLUGINS", "/nonexistent"))
SMALL = q({"cpu": "250m", "memory": "32Mi"})


@dataclass
class Env:
    shim: Shim
    tmp: Path
    log: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if not all((STOCK / p).is_file() for p in ("logger", "ulimit-adjuster")):
        pytest.skip("set NRI_STOCK_PLUGINS to the directory tests/nri_plugin/build-stock.sh built")
    require_host()
    tmp = tmp_path_factory.mktemp("nri-stock")
    sock = tmp / "nri.sock"
    (tmp / "shim").mkdir()
    config: dict[str, object] = {"nri": {"enable": True, "socket_path": str(sock), "plugin_path": ""}}
    log = tmp / "logger.log"
    with running_shim(tmp / "shim", extra_config=config) as shim:
        plugins = [
            subprocess.Popen(
                [str(STOCK / "logger"), "-idx", "05", "-socket-path", str(sock), "-log-file", str(log)],
                stdout=subprocess.DEVNULL,
                stderr=(tmp / "logger.out").open("wb"),
            ),
            subprocess.Popen(
                [str(STOCK / "ulimit-adjuster"), "-idx", "10", "-socket", str(sock)],
                stdout=subprocess.DEVNULL,
                stderr=(tmp / "ulimit.out").open("wb"),
            ),
        ]
        try:
            deadline = time.monotonic() + 30
            while True:
                info = shim.runtime.Status(pb.StatusRequest(verbose=True), timeout=30).info["info"]
                if set(json.loads(info)["nri_plugins"]) >= {"05-logger", "10-ulimit-adjuster"}:
                    break
                assert time.monotonic() < deadline, f"registered: {json.loads(info)['nri_plugins']}"
                time.sleep(0.1)
            yield Env(shim, tmp, log)
        finally:
            for p in plugins:
                p.kill()
                p.wait(10)


def test_ulimit_adjuster_and_logger_see_and_adjust_a_vm_pod(env: Env) -> None:
    config = pod("stock", containers=[("app", SMALL)])
    config.annotations["ulimits.noderesource.dev/container.app"] = "- type: RLIMIT_NOFILE\n  soft: 1000\n  hard: 2000\n"
    config.log_directory = str(env.tmp / "logs")
    rt = env.shim.runtime
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    try:
        c = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"),
            image=pb.ImageSpec(image="busybox"),
            command=["sleep", "3600"],
            log_path="app.log",
        )
        c.kubernetes_resources.CopyFrom(SMALL)
        cid = rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
        ).container_id
        rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        res = rt.ExecSync(
            pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "ulimit -n; ulimit -Hn"], timeout=30), timeout=60
        )
        assert (res.exit_code, res.stdout) == (0, b"1000\n2000\n")
    finally:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    text = env.log.read_text()
    for event in (
        "RunPodSandbox",
        "CreateContainer",
        "PostCreateContainer",
        "StartContainer",
        "PostStartContainer",
        "StopContainer",
        "StopPodSandbox",
        "RemoveContainer",
        "RemovePodSandbox",
    ):
        assert f"{event}: pod:" in text, event
    assert sid in text
    assert "pod_resources" in text  # the pod's whole size, as the VM was sized from it
