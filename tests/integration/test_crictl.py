"""crictl (cri-tools) against a real shim on a private socket: run / create / start / ps / logs /
exec -s / stats / stop / rm on real guests, with an image from a registry on 127.0.0.1.

crictl comes from $CRICTL or PATH (the cri-tools build is not part of scripts/setup-host.sh); the
test skips without it."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.cluster_support import built_crictl
from tests.integration.image_setup import require_image_tools
from tests.registry_kit import Layout, Registry, busybox_entries, push
from tests.shim_kit import Shim, require_host, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CRICTL = built_crictl()


@dataclass
class Env:
    shim: Shim
    image: str
    tmp: Path

    def crictl(self, *args: str, timeout: float = 180, stderr: bool = False) -> str:
        """crictl's stdout (and its stderr after it, with ``stderr``: ``logs`` writes the
        container's stderr there)."""
        assert CRICTL is not None
        sock = f"unix://{self.shim.socket}"
        argv = [CRICTL, "--runtime-endpoint", sock, "--image-endpoint", sock, "--timeout", "120s", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"crictl {' '.join(args)}: {done.stderr}\n{self.shim.log_text()[-2000:]}"
        return done.stdout + (done.stderr if stderr else "")

    def write(self, name: str, doc: dict[str, object]) -> str:
        path = self.tmp / name
        path.write_text(json.dumps(doc))
        return str(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if CRICTL is None:
        pytest.skip("crictl not found (set CRICTL or put cri-tools' crictl on PATH)")
    require_host()
    require_image_tools()
    tmp = tmp_path_factory.mktemp("crictl")
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        layout.tag("bb", layout.image([layout.layer(busybox_entries(("sh", "echo", "sleep", "cat", "dd", "true")))]))
        ref = f"{registry.host}/test/busybox:crictl"
        push(layout, "bb", ref)
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim") as shim:
            yield Env(shim, ref, tmp)
    finally:
        registry.stop()


def _pod(env: Env, name: str) -> str:
    return env.write(
        f"{name}-pod.json",
        {
            "metadata": {"name": name, "namespace": "crictl", "uid": f"uid-{name}", "attempt": 0},
            "log_directory": str(env.tmp / "logs" / name),
            "linux": {},
        },
    )


def _ctr(env: Env, name: str, argv: list[str]) -> str:
    return env.write(
        f"{name}-ctr.json",
        {"metadata": {"name": name}, "image": {"image": env.image}, "command": argv, "log_path": f"{name}.log"},
    )


def _wait_log(env: Env, cid: str, text: str) -> str:
    deadline = time.monotonic() + 60
    while text not in (out := env.crictl("logs", cid, stderr=True)):
        assert time.monotonic() < deadline, out
        time.sleep(0.3)
    return out


def test_pull_runp_create_start_ps_logs_exec_stats_stop_rm(env: Env) -> None:
    env.crictl("pull", env.image)
    pod_json = _pod(env, "web")
    pod = env.crictl("runp", pod_json).strip()
    ctr_json = _ctr(env, "greeter", ["sh", "-c", "echo hello from the guest; echo to stderr >&2; sleep 300"])
    cid = env.crictl("create", pod, ctr_json, pod_json).strip()
    env.crictl("start", cid)
    assert cid[:13] in env.crictl("ps")
    _wait_log(env, cid, "hello from the guest")
    _wait_log(env, cid, "to stderr")  # the streams are copied apart: stderr's line may come second
    assert env.crictl("exec", "-s", cid, "sh", "-c", "echo exec works").strip() == "exec works"
    stats = json.loads(env.crictl("stats", "-o", "json", cid))
    assert stats["stats"][0]["attributes"]["id"] == cid
    assert int(stats["stats"][0]["memory"]["workingSetBytes"]["value"]) > 0
    env.crictl("stop", "-t", "5", cid)
    inspect = json.loads(env.crictl("inspect", cid))
    assert inspect["status"]["state"] == "CONTAINER_EXITED"
    env.crictl("rm", cid)
    assert cid[:13] not in env.crictl("ps", "-a")
    env.crictl("stopp", pod)
    env.crictl("rmp", pod)


def test_run_exits_with_its_code(env: Env) -> None:
    pod_json = _pod(env, "batch")
    ctr_json = _ctr(env, "job", ["sh", "-c", "echo job ran; exit 3"])
    cid = env.crictl("run", "--no-pull", ctr_json, pod_json).strip().splitlines()[-1]
    deadline = time.monotonic() + 60
    while (state := json.loads(env.crictl("inspect", cid))["status"])["state"] != "CONTAINER_EXITED":
        assert time.monotonic() < deadline, state
        time.sleep(0.3)
    assert (state["exitCode"], state["reason"]) == (3, "Error")
    assert "job ran" in env.crictl("logs", cid)
