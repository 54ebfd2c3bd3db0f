"""A downstream containerd for the proxy's tests: started by ``scripts/containerd.sh`` with its own
directory and socket, its sandbox (pause) image served by the session's local registry, so
nothing needs the internet; on the way out every pod it holds is removed and it is stopped."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from tests.shim_kit import REPO, busybox_registry

SCRIPT = REPO / "scripts" / "containerd.sh"
_PUSHED: dict[str, str] = {}
APPLETS = ("sh", "sleep", "echo", "cat", "nc", "ls")


def require_containerd() -> None:
    missing = [b for b in ("containerd", "runc", "containerd-shim-runc-v2") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/setup-host.sh installs containerd and runc)")


def _pushed(repo: str, cmd: tuple[str, ...]) -> str:
    if repo in _PUSHED:
        return _PUSHED[repo]
    import tempfile

    from tests.registry_kit import Layout, busybox_entries, push

    registry = busybox_registry()
    if registry is None:
        pytest.skip("no local registry (docker-registry, skopeo, busybox-static)")
    work = Path(tempfile.mkdtemp(prefix="vmsandbox-image-"))
    try:
        layout = Layout(work / "layout")
        layout.tag("img", layout.image([layout.layer(busybox_entries(APPLETS))], cmd=cmd))
        push(layout, "img", f"{registry}/{repo}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _PUSHED[repo] = f"{registry}/{repo}"
    return _PUSHED[repo]


def pause_image() -> str:
    """A sandbox image in the session's registry: busybox that sleeps (what a pause container does)."""
    return _pushed("vmsandbox/pause:1", ("/bin/sleep", "2147483647"))


def tools_image() -> str:
    """busybox with ``nc`` for containers that talk TCP, in the session's registry."""
    return _pushed("vmsandbox/nettools:1", ("/bin/sh",))


SOCKET_DIR_MAX = 64
"""containerd refuses a ttrpc socket path over 104 bytes (``containerd.sock.ttrpc`` in its
directory): a longer directory (pytest-xdist's temporary paths are) is replaced by a short one
under /tmp, which the given path then links to."""


@dataclass
class Containerd:
    dir: Path
    conf_dir: Path
    registry: str

    def __post_init__(self) -> None:
        if self.dir.is_symlink():  # a restart of one made before: its state is where the link says
            self.dir = self.dir.resolve()
        elif len(str(self.dir)) > SOCKET_DIR_MAX:
            short = Path(tempfile.mkdtemp(prefix="vmsandbox-ctrd-", dir="/tmp"))
            atexit.register(shutil.rmtree, short, ignore_errors=True)
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            self.dir.symlink_to(short)
            self.dir = short

    @property
    def socket(self) -> Path:
        return self.dir / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def up(self) -> None:
        done = subprocess.run(
            ["bash", str(SCRIPT), "up", str(self.dir), pause_image(), str(self.conf_dir), self.registry],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"containerd.sh up {self.dir} failed ({done.returncode}):\n{done.stdout}{done.stderr}")

    def down(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down", str(self.dir)], check=True, capture_output=True, timeout=60)

    def running(self) -> bool:
        """Whether its containerd runs (a zombie does not: whoever is pid 1 here may not reap it)."""
        try:
            pid = int((self.dir / "containerd.pid").read_text())
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            return False
        return state != "Z"

    def kill(self) -> None:
        """SIGKILL containerd alone (its shims and containers live on, as after a crash)."""
        pid = int((self.dir / "containerd.pid").read_text())
        subprocess.run(["kill", "-KILL", str(pid)], check=True)

    @contextmanager
    def hung(self) -> Iterator[None]:
        """containerd stopped (SIGSTOP, by the pid it was started with) for the block, continued after:
        its socket still accepts connections and its open ones stay up, but nothing is answered."""
        pid = int((self.dir / "containerd.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    @contextmanager
    def runtime(self) -> Iterator[pb_grpc.RuntimeServiceStub]:
        channel = grpc.insecure_channel(self.endpoint)
        try:
            yield pb_grpc.RuntimeServiceStub(channel)
        finally:
            channel.close()

    def remove_all(self) -> None:
        with self.runtime() as rt:
            for s in rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
                rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=60)
                rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=60)


@contextmanager
def containerd(tmp: Path, conf_dir: Path) -> Iterator[Containerd]:
    require_containerd()
    registry = busybox_registry()
    if registry is None:
        pytest.skip("no local registry (docker-registry, skopeo, busybox-static)")
    c = Containerd(tmp, conf_dir, registry)
    try:
        c.up()  # inside: one interrupted while it starts is stopped as well
        yield c
    finally:
        try:
            if c.running():
                c.remove_all()
        finally:
            c.down()
