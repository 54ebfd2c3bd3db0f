"""Soak: mixed RunPodSandbox / CreateContainer / StopPodSandbox / RemovePodSandbox from two clients,
with the shim killed by SIGKILL at a random moment, several times over. After each restart the
ledger, libvirt and the host's hugepages agree (``state_check.assert_consistent``); at the end,
with everything removed, a pod asking for every CPU fits, so the rebuilt free state leaks nothing.

Bounded and local: ``VMSANDBOX_SOAK_ROUNDS`` rounds (default 4) of at most a few seconds of
traffic each, only to the shim's unix socket; the seed is printed so a failure can be replayed
with ``VMSANDBOX_SOAK_SEED``.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.state_check import assert_consistent, vmsandbox_free_baseline
from tests.integration.test_crash_recovery import fresh_pod_fits, remove_everything
from tests.shim_kit import Shim, container, pod, q, require_host, start_shim, stop_shim

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.exclusive]

ROUNDS = int(os.environ.get("VMSANDBOX_SOAK_ROUNDS", "4"))
APP = q({"cpu": "500m", "memory": "32Mi"})


def _traffic(shim: Shim, rng: random.Random, stop: threading.Event, n: int) -> None:
    """Random CRI calls until ``stop`` or the shim dies; errors (refusals, the kill) are expected."""
    mine: list[str] = []
    i = 0
    while not stop.is_set():
        i += 1
        try:
            op = rng.choice(["run", "run", "create", "stop", "remove"]) if mine else "run"
            if op == "run":
                config = pod(f"soak-{n}-{i}", containers=[("app", APP)])
                req = pb.RunPodSandboxRequest(config=config)
                mine.append(shim.runtime.RunPodSandbox(req, timeout=120).pod_sandbox_id)
            elif op == "create":
                req_c = pb.CreateContainerRequest(pod_sandbox_id=rng.choice(mine), config=container("app", APP))
                shim.runtime.CreateContainer(req_c, timeout=30)
            elif op == "stop":
                shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=rng.choice(mine)), timeout=120)
            else:
                victim = mine.pop(rng.randrange(len(mine)))
                shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=victim), timeout=120)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and shim.process.poll() is not None:
                return  # killed under us
        except ValueError:  # the channel was closed by the kill
            return


def test_soak_with_kill_9_at_random_moments(tmp_path: Path) -> None:
    require_host()
    seed = int(os.environ.get("VMSANDBOX_SOAK_SEED", str(random.SystemRandom().randrange(1 << 30))))
    print(f"soak seed {seed} (VMSANDBOX_SOAK_SEED={seed} replays it)")
    rng = random.Random(seed)
    baseline = vmsandbox_free_baseline()
    shim = start_shim(tmp_path)
    try:
        for r in range(ROUNDS):
            stop = threading.Event()
            clients = [
                threading.Thread(target=_traffic, args=(shim, random.Random(rng.random()), stop, 10 * r + k))
                for k in range(2)
            ]
            for t in clients:
                t.start()
            time.sleep(rng.uniform(0.5, 6.0))
            stop_shim(shim, kill=True)
            stop.set()
            for t in clients:
                t.join(timeout=180)
            shim = start_shim(tmp_path)
            assert_consistent(shim.state_dir, baseline)
        remove_everything(shim)
        assert_consistent(shim.state_dir, baseline)
        fresh_pod_fits(shim, "after-soak")
    finally:
        try:
            remove_everything(shim)
        finally:
            stop_shim(shim)
            shutil.rmtree(tmp_path, ignore_errors=True)
