"""A container's log keeps reaching the kubelet's file across a shim restart (the guest keeps the
container running; the new shim carries on copying from where the old one stopped)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import container, pod, q, remove_all, require_host, start_shim, stop_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

RES = q({"cpu": "250m", "memory": "32Mi"})


def _numbers(path: Path) -> list[int]:
    out = []
    for line in path.read_text().splitlines():
        stamp, stream, tag, text = line.split(" ", 3)
        assert stamp.endswith("Z") and stream == "stdout" and tag == "F", line
        out.append(int(text))
    return out


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_log_copying_resumes_after_a_restart(tmp_path: Path, kill: bool) -> None:
    require_host()
    (tmp_path / "shim").mkdir()
    shim = start_shim(tmp_path / "shim")
    config = pod("logs", containers=[("ticker", RES)])
    config.log_directory = str(tmp_path / "logs")
    sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    c = container("ticker", RES)
    c.command[:] = ["sh", "-c", "i=0; while [ $i -lt 3000 ]; do echo $i; i=$((i+1)); sleep 0.2; done"]
    c.log_path = "ticker.log"
    cid = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
    ).container_id
    shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    log = tmp_path / "logs" / "ticker.log"

    def wait_for(n: int) -> list[int]:
        deadline = time.monotonic() + 90
        while len(got := _numbers(log) if log.exists() else []) < n:
            assert time.monotonic() < deadline, f"{len(got)} lines"
            time.sleep(0.2)
        return got

    before = wait_for(5)
    stop_shim(shim, kill=kill)
    time.sleep(2)  # the container keeps printing while no shim runs
    shim = start_shim(tmp_path / "shim")
    try:
        after = wait_for(len(before) + 20)
        if kill:  # nothing lost; a killed shim may copy its last batch again
            assert sorted(set(after)) == list(range(max(after) + 1)), after[:60]
            assert after == sorted(after) and len(after) - len(set(after)) <= 10, after[:60]
        else:  # every line once, in order
            assert after == list(range(len(after))), after[:60]
        assert after[: len(before)] == before
    finally:
        remove_all(shim)
        stop_shim(shim)
