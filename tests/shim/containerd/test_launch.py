"""containerd-shim-vmsandbox-v1 as containerd runs it: bootstrap on stdin, the answer alone on stdout."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import any_pb2

from gen.containerd.runtime.bootstrap.v1 import bootstrap_pb2 as boot
from gen.containerd.runtime.task.v3 import shim_pb2 as task
from gen.containerd.types import introspection_pb2
from gen.containerd.types.runtimeoptions.v1 import api_pb2 as runtimeoptions

ARGS = ["-namespace", "k8s.io", "-address", "/run/containerd/containerd.sock", "-publish-binary", "/usr/bin/containerd",
        "-id", "a" * 64]  # fmt: skip


def params(body: str | None) -> bytes:
    p = boot.BootstrapParams(instance_id="a" * 64, namespace="k8s.io", containerd_ttrpc_address="/x.ttrpc")
    if body is not None:
        opts = runtimeoptions.Options(config_body=body.encode())
        value = any_pb2.Any(type_url="runtimeoptions.v1.Options", value=opts.SerializeToString())
        p.extensions.append(boot.Extension(value=value))
    return p.SerializeToString()


def launch(stdin: bytes, *action: str, env_dir: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin"}
    if env_dir is not None:
        env["VMSANDBOX_CONTAINERD_SHIM_DIR"] = str(env_dir)
    return subprocess.run(
        [sys.executable, "-m", "shim.containerd.launch", *ARGS, *action],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=Path(__file__).resolve().parents[3],
        timeout=60,
        check=False,
    )


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Path]:
    """A shim directory where handlers "vmsandbox" and "fast" are served."""
    socks = []
    for name in ("vmsandbox", "fast"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(tmp_path / f"{name}.sock"))
        s.listen(4)
        socks.append(s)
    yield tmp_path
    for s in socks:
        s.close()


@pytest.mark.parametrize(
    ("body", "handler"),
    [(None, "vmsandbox"), ('Handler = "fast"', "fast"), ("", "vmsandbox")],
)
def test_start_answers_the_handlers_socket(served: Path, body: str | None, handler: str) -> None:
    done = launch(params(body), "start", env_dir=served)
    assert done.returncode == 0, done.stderr
    result = boot.BootstrapResult()
    result.ParseFromString(done.stdout)
    assert (result.version, result.protocol, result.address) == (3, "ttrpc", f"unix://{served}/{handler}.sock")


def test_shim_dir_from_the_options(served: Path) -> None:
    done = launch(params(f'Handler = "fast"\nShimDir = "{served}"'), "start")
    assert done.returncode == 0, done.stderr
    result = boot.BootstrapResult()
    result.ParseFromString(done.stdout)
    assert result.address == f"unix://{served}/fast.sock"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('Handler = "absent"', "does not serve runtime handler 'absent'"),
        ('Handlr = "fast"', "unknown key 'Handlr'"),
        ('Handler = "Not_A_Label"', "runtime handler"),
        ("Handler = [", "not TOML"),
        ('ShimDir = "relative"', "ShimDir must be an absolute path"),
    ],
)
def test_start_refuses_with_a_reason_and_nothing_on_stdout(served: Path, body: str, says: str) -> None:
    done = launch(params(body), "start", env_dir=served)
    assert done.returncode == 1 and done.stdout == b""
    assert says in done.stderr.decode()


def test_delete_answers_a_delete_response(tmp_path: Path) -> None:
    done = launch(b"", "delete", env_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    reply = task.DeleteResponse()
    reply.ParseFromString(done.stdout)
    assert reply.exit_status == 255 and reply.exited_at.seconds > 0


def test_info_answers_runtime_info(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shim.containerd.launch", "-info"],
        input=b"",
        capture_output=True,
        cwd=Path(__file__).resolve().parents[3],
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    reply = introspection_pb2.RuntimeInfo()
    reply.ParseFromString(done.stdout)
    assert reply.name == "io.containerd.vmsandbox.v1" and reply.version.version
    # the OCI features containerd reads its handler's features from: recursive read-only mounts
    # yes, user namespaces (a user namespace plus idmapped mounts) no
    assert reply.features.type_url == "types.containerd.io/opencontainers/runtime-spec/1/features/Features"
    features = json.loads(reply.features.value)
    assert "rro" in features["mountOptions"] and "rshared" in features["mountOptions"]
    assert "user" not in features["linux"]["namespaces"]
    assert features["linux"]["mountExtensions"]["idmap"]["enabled"] is False
