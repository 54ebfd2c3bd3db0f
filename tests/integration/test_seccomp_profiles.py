"""Localhost seccomp profiles through the CRI socket with real guests: a profile under the
configured root is enforced by crun in the guest; one outside it, or not a profile, is refused
with INVALID_ARGUMENT naming it, and nothing is left behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import Shim, container, pod, q, require_host, run_to_exit, running_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration]

RES = q({"cpu": "250m", "memory": "32Mi"})
NO_MKDIR = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
}


@dataclass
class Env:
    shim: Shim
    sandbox: str
    config: pb.PodSandboxConfig
    root: Path
    outside: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("seccomp")
    root = tmp / "seccomp"
    (root / "profiles").mkdir(parents=True)
    (root / "profiles" / "no-mkdir.json").write_text(json.dumps(NO_MKDIR))
    (root / "profiles" / "broken.json").write_text(json.dumps({"defaultAction": "SCMP_ACT_PERHAPS"}))
    outside = tmp / "elsewhere.json"
    outside.write_text(json.dumps(NO_MKDIR))
    (tmp / "shim").mkdir()
    with running_shim(tmp / "shim", extra_config={"seccomp_profile_root": str(root)}) as shim:
        config = pod("sc", containers=[("app", RES)])
        config.log_directory = str(tmp / "logs")
        sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
        yield Env(shim, sid, config, root, outside)


def _config(env: Env, ref: str, attempt: int) -> pb.ContainerConfig:
    c = container("app", RES, attempt=attempt)
    c.command[:] = ["sh", "-c", "/bin/busybox mkdir /tmp/made && echo made || echo refused"]
    c.log_path = f"app-{attempt}.log"
    c.linux.security_context.seccomp.CopyFrom(
        pb.SecurityProfile(profile_type=pb.SecurityProfile.ProfileType.Localhost, localhost_ref=ref)
    )
    return c


def test_a_localhost_profile_is_enforced_in_the_guest(env: Env) -> None:
    config = _config(env, str(env.root / "profiles" / "no-mkdir.json"), 0)
    lines = run_to_exit(env.shim, env.sandbox, env.config, config)
    assert [text for stream, text in lines if stream == "stdout"] == ["refused"]


@pytest.mark.parametrize(
    ("which", "words"),
    [("outside", "is outside"), ("broken", "SCMP_ACT_PERHAPS"), ("missing", "cannot be read")],
)
def test_bad_localhost_profiles_are_refused(env: Env, which: str, words: str) -> None:
    ref = {
        "outside": str(env.outside),
        "broken": str(env.root / "profiles" / "broken.json"),
        "missing": str(env.root / "profiles" / "nope.json"),
    }[which]
    before = env.shim.runtime.ListContainers(pb.ListContainersRequest(), timeout=30).containers
    with pytest.raises(grpc.RpcError) as err:
        env.shim.runtime.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=env.sandbox, config=_config(env, ref, 1), sandbox_config=env.config
            ),
            timeout=120,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in str(err.value.details())
    assert env.shim.runtime.ListContainers(pb.ListContainersRequest(), timeout=30).containers == before
