"""containerd-shim-vmsandbox-v1 as containerd runs it, by a handler's launcher name (a link to it):
bootstrap on stdin, the answer alone on stdout; the handler from the name, the shim directory
from the file beside it."""

from __future__ import annotations

import json
import os
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
from vmsandbox.containerd_config import SHIM_DIR_FILE, launcher_name

REPO = Path(__file__).resolve().parents[3]
ARGS = ["-namespace", "k8s.io", "-address", "/run/containerd/containerd.sock", "-publish-binary", "/usr/bin/containerd",
        "-id", "a" * 64]  # fmt: skip


def params(body: str | None = None) -> bytes:
    p = boot.BootstrapParams(instance_id="a" * 64, namespace="k8s.io", containerd_ttrpc_address="/x.ttrpc")
    if body is not None:
        opts = runtimeoptions.Options(config_body=body.encode())
        value = any_pb2.Any(type_url="runtimeoptions.v1.Options", value=opts.SerializeToString())
        p.extensions.append(boot.Extension(value=value))
    return p.SerializeToString()


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A directory on containerd's PATH: the launcher (a script as the venv's) and, beside it, links
    named for the handlers "fast" and "absent"."""
    script = tmp_path / "launcher"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom shim.containerd.launch import main\nsys.exit(main())\n")
    script.chmod(0o755)
    d = tmp_path / "bin"
    d.mkdir()
    for handler in ("vmsandbox", "fast", "absent"):
        (d / launcher_name(handler)).symlink_to(script)
    return d


def launch(
    name: str, stdin: bytes, *action: str, bin_dir: Path, env_dir: Path | None = None
) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    if env_dir is not None:
        env["VMSANDBOX_CONTAINERD_SHIM_DIR"] = str(env_dir)
    return subprocess.run(
        [str(bin_dir / name), *ARGS, *action],
        input=stdin,
        capture_output=True,
        env=env,
        cwd="/",
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


@pytest.mark.parametrize("handler", ["vmsandbox", "fast"])
def test_start_answers_the_socket_of_the_handler_its_name_says(bin_dir: Path, served: Path, handler: str) -> None:
    done = launch(launcher_name(handler), params(), "start", bin_dir=bin_dir, env_dir=served)
    assert done.returncode == 0, done.stderr
    result = boot.BootstrapResult()
    result.ParseFromString(done.stdout)
    assert (result.version, result.protocol, result.address) == (3, "ttrpc", f"unix://{served}/{handler}.sock")


def test_the_shim_directory_is_the_files_beside_the_launcher_before_the_environments(
    bin_dir: Path, served: Path, tmp_path: Path
) -> None:
    (bin_dir / SHIM_DIR_FILE).write_text(f"{served}\n")
    done = launch(launcher_name("fast"), params(), "start", bin_dir=bin_dir, env_dir=tmp_path / "elsewhere")
    assert done.returncode == 0, done.stderr
    result = boot.BootstrapResult()
    result.ParseFromString(done.stdout)
    assert result.address == f"unix://{served}/fast.sock"


@pytest.mark.parametrize(
    ("name", "stdin", "beside", "says"),
    [
        (launcher_name("absent"), params(), None, "does not serve runtime handler 'absent'"),
        (launcher_name("fast"), params('Handler = "fast"'), None, "has options in containerd's configuration"),
        (launcher_name("fast"), params(), "relative\n", "must be an absolute path"),
        (launcher_name("fast"), params(), "/a\n/b\n", "control character"),
        ("containerd-shim-other-v1", params(), None, "no runtime handler is named"),
    ],
)
def test_start_refuses_with_a_reason_and_nothing_on_stdout(
    bin_dir: Path, served: Path, name: str, stdin: bytes, beside: str | None, says: str
) -> None:
    if not (bin_dir / name).exists():
        (bin_dir / name).symlink_to(os.readlink(bin_dir / launcher_name("fast")))
    if beside is not None:
        (bin_dir / SHIM_DIR_FILE).write_text(beside)
    done = launch(name, stdin, "start", bin_dir=bin_dir, env_dir=served)
    assert done.returncode == 1 and done.stdout == b""
    assert says in done.stderr.decode()


def test_delete_answers_a_delete_response(bin_dir: Path, tmp_path: Path) -> None:
    done = launch(launcher_name("fast"), b"", "delete", bin_dir=bin_dir, env_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    reply = task.DeleteResponse()
    reply.ParseFromString(done.stdout)
    assert reply.exit_status == 255 and reply.exited_at.seconds > 0


@pytest.mark.parametrize(
    ("handler", "runtime"), [("vmsandbox", "io.containerd.vmsandbox.v1"), ("fast", "io.containerd.vmsandbox-fast.v1")]
)
def test_info_answers_runtime_info(bin_dir: Path, handler: str, runtime: str) -> None:
    done = subprocess.run(
        [str(bin_dir / launcher_name(handler)), "-info"],
        input=b"",
        capture_output=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    reply = introspection_pb2.RuntimeInfo()
    reply.ParseFromString(done.stdout)
    assert reply.name == runtime and reply.version.version
    # the OCI features containerd reads its handler's features from: recursive read-only mounts,
    # and user namespaces (a user namespace plus idmapped mounts)
    assert reply.features.type_url == "types.containerd.io/opencontainers/runtime-spec/1/features/Features"
    features = json.loads(reply.features.value)
    assert "rro" in features["mountOptions"] and "rshared" in features["mountOptions"]
    assert "user" in features["linux"]["namespaces"]
    assert features["linux"]["mountExtensions"]["idmap"]["enabled"] is True
