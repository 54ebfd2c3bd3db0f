"""Helpers for tests that drive a real shim process over its real unix socket (their fixtures:
``tests/conftest.py``).

The shim runs as a subprocess (``python -m shim serve``) against the host's libvirtd, with a
private state directory and profile file. Prerequisites come from ``scripts/setup-host.sh``;
when they are missing the tests skip locally and fail under CI, so a broken set-up never
passes silently.

A test run told to stop (SIGTERM as well as Ctrl-C: ``tests.interrupts``) tears its fixtures down
as pytest does on Ctrl-C; the shims run in sessions of their own, so they are still there to
remove their sandboxes, and when the run ends every guest left of its states is removed before the
states themselves (``state_dir``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from gen.cri.apimachinery.resource.generated_pb2 import Quantity
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.sandbox_dirs import SandboxDirs
from tests import interrupts
from vmsandbox.domain import DOMAIN_PREFIX

interrupts.install()

IMAGE_DIR = Path(os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default"))
_BUSYBOX_REGISTRY: list[str] = []  # host:port of the session's registry serving docker.io/library/busybox
LIBVIRT_URI = os.environ.get("VMSANDBOX_LIBVIRT_URI", "qemu:///system")
REPO = Path(__file__).resolve().parents[1]


def missing_prerequisites() -> list[str]:
    missing = []
    for f in ("vmlinux", "initramfs.img"):
        if not (IMAGE_DIR / f).is_file():
            missing.append(f"guest image {IMAGE_DIR / f}")
    try:
        import libvirt

        libvirt.open(LIBVIRT_URI).close()
    except Exception as exc:
        missing.append(f"libvirt at {LIBVIRT_URI} ({exc})")
    if hugepages_free() < 256:
        missing.append("at least 256 free 2 MiB hugepages")
    return missing


def require_host() -> None:
    missing = missing_prerequisites()
    if missing:
        message = "host not set up (run scripts/setup-host.sh): " + "; ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def hugepages_free() -> int:
    try:
        return int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())
    except OSError:
        return 0


def q(requests: dict[str, str], limits: dict[str, str] | None = None) -> pb.KubernetesResources:
    return pb.KubernetesResources(
        requests={k: Quantity(string=v) for k, v in requests.items()},
        limits={k: Quantity(string=v) for k, v in (limits if limits is not None else requests).items()},
    )


def pod(
    name: str,
    *,
    init: list[tuple[str, pb.KubernetesResources]] | None = None,
    containers: list[tuple[str, pb.KubernetesResources]] | None = None,
    labels: dict[str, str] | None = None,
    declared: bool = True,
) -> pb.PodSandboxConfig:
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace="test", uid=str(uuid.uuid4()), attempt=0),
        labels=labels or {},
    )
    if declared:
        config.pod_resources.CopyFrom(
            pb.PodResourceConfig(
                init_containers=[pb.ContainerResourceConfig(name=n, kubernetes_resources=r) for n, r in init or []],
                containers=[
                    pb.ContainerResourceConfig(name=n, kubernetes_resources=r)
                    for n, r in containers or [("app", q({"cpu": "1", "memory": "64Mi"}))]
                ],
            )
        )
    return config


def container(name: str, res: pb.KubernetesResources | None, attempt: int = 0) -> pb.ContainerConfig:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=attempt), image=pb.ImageSpec(image="busybox")
    )
    if res is not None:
        config.kubernetes_resources.CopyFrom(res)
    return config


@dataclass
class Shim:
    process: subprocess.Popen[bytes]
    socket: Path
    state_dir: Path
    log: Path
    runtime: pb_grpc.RuntimeServiceStub
    images: pb_grpc.ImageServiceStub
    channel: grpc.Channel

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


SNAPSHOT_HANDLER = "snap"
"""The tests' one handler whose pods restore from snapshots (and make them on first use). The others
turn snapshots off: the tests that use them count pages, CPUs and domains exactly, which a snapshot
being made in the background (a guest of the pod's shape) would upset."""


#: a profile that reserves resize headroom (one vCPU, 128 MiB) beside what its pods ask
HEADROOM_HANDLER = "headroom"


def write_profiles(path: Path) -> None:
    docs = [
        {
            "name": "vmsandbox",
            "handler": "vmsandbox",
            "snapshots": False,
            "guest": {"image_dir": str(IMAGE_DIR), "boot_timeout_s": 60},
        },
        {
            "name": "broken-guest",
            "handler": "broken",
            "snapshots": False,
            "guest": {"image_dir": str(IMAGE_DIR), "kernel_cmdline": "rdinit=/does-not-exist", "boot_timeout_s": 8},
        },
        {
            "name": "shared",
            "handler": "shared",
            "cpu_policy": "shared",
            "snapshots": False,
            "guest": {"image_dir": str(IMAGE_DIR)},
        },
        {"name": "snap", "handler": SNAPSHOT_HANDLER, "guest": {"image_dir": str(IMAGE_DIR), "boot_timeout_s": 60}},
        {
            "name": "headroom",
            "handler": HEADROOM_HANDLER,
            "snapshots": False,
            "resize_headroom": {"vcpus": 1, "memory": "128Mi"},
            "guest": {"image_dir": str(IMAGE_DIR), "boot_timeout_s": 60},
        },
    ]
    path.write_text(yaml.safe_dump_all(docs))


def busybox_registry() -> str | None:
    """A registry on 127.0.0.1 (one per session) serving a busybox image as
    ``docker.io/library/busybox:latest``, so containers of the image "busybox" can be created; None
    without the image tools."""
    if _BUSYBOX_REGISTRY:
        return _BUSYBOX_REGISTRY[0]
    from tests.registry_kit import BUSYBOX, Layout, Registry, busybox_entries, push

    if shutil.which("docker-registry") is None or shutil.which("skopeo") is None or not BUSYBOX.is_file():
        return None
    import atexit
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="vmsandbox-busybox-registry-"))
    registry = Registry(work / "registry").start()
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    atexit.register(registry.stop)  # atexit runs last-registered first: stop, then delete
    layout = Layout(work / "layout")
    layout.tag("busybox", layout.image([layout.layer(busybox_entries())]))
    push(layout, "busybox", f"{registry.host}/library/busybox:latest")
    _BUSYBOX_REGISTRY.append(registry.host)
    return registry.host


STATE_ROOT = Path("/var/tmp/vmsandbox-test-state")
"""Where the shims of the tests keep their state: each sandbox's QEMU, as a uid of its own, must
pass through every directory above its sandbox's, and pytest keeps its temporary directories 0700."""


def state_dir(tmp: Path) -> Path:
    """``tmp/state``: a link to a directory of this test's below STATE_ROOT (made once, so that a
    restarted shim finds the same state; when the test process ends, the guests libvirt still has
    of it are removed, then the directory)."""
    link = tmp / "state"
    if link.is_symlink() or link.exists():
        return link
    STATE_ROOT.mkdir(exist_ok=True)
    STATE_ROOT.chmod(0o711)
    real = Path(tempfile.mkdtemp(prefix="state-", dir=STATE_ROOT))
    real.chmod(0o711)
    link.symlink_to(real)
    atexit.register(_remove_state, real)
    return link


def _remove_state(real: Path) -> None:
    interrupts.remove_guests(real)
    # each sandbox's directory is a file system of its own: unmounted and its image deleted, never
    # deleted through (a shim stopped with sandboxes left them mounted)
    SandboxDirs(str(real)).sweep(set())
    shutil.rmtree(real, ignore_errors=True)


def start_shim(
    tmp: Path,
    *,
    extra_config: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
    pull_busybox: bool = True,
) -> Shim:
    """Start ``python -m shim serve`` on ``tmp``; ``env`` adds environment variables (e.g. VMSANDBOX_FAULT).
    The image "busybox" is pulled (from the session's registry) when the image tools exist, unless
    ``pull_busybox`` is False (tests of the image store that start from an empty one)."""
    profiles = tmp / "profiles.yaml"
    write_profiles(profiles)
    config = {
        "socket_path": str(tmp / "cri.sock"),
        "state_dir": str(state_dir(tmp)),
        "console_dir": str(tmp / "console"),
        "libvirt_uri": LIBVIRT_URI,
        "profile_files": [str(profiles)],
        # pods without a NIC, unless a test brings a CNI configuration (tests/integration/cni_kit.py)
        "pod_network": "none",
        **(extra_config or {}),
    }
    registry = busybox_registry()
    if registry is not None and "registries" not in config:
        config["registries"] = [{"prefix": "docker.io", "location": registry}]
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    log = tmp / "shim.log"
    sock = tmp / "cri.sock"
    sock.unlink(missing_ok=True)  # a killed shim leaves its socket behind: wait for the new one
    process = subprocess.Popen(
        [sys.executable, "-m", "shim", "serve", "--config", str(tmp / "config.yaml")],
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **env} if env else None,
        start_new_session=True,  # a signal to the test run's group leaves it to remove its sandboxes
    )
    deadline = time.monotonic() + 60
    while not sock.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"shim did not start:\n{log.read_text()}")
        time.sleep(0.05)
    channel = grpc.insecure_channel(f"unix:{sock}")
    grpc.channel_ready_future(channel).result(timeout=30)
    if pull_busybox and registry is not None and "registries" not in (extra_config or {}):
        pb_grpc.ImageServiceStub(channel).PullImage(
            pb.PullImageRequest(image=pb.ImageSpec(image="busybox")), timeout=120
        )
    return Shim(
        process=process,
        socket=sock,
        state_dir=tmp / "state",
        log=log,
        runtime=pb_grpc.RuntimeServiceStub(channel),
        images=pb_grpc.ImageServiceStub(channel),
        channel=channel,
    )


def exit_code(shim: Shim, timeout_s: float) -> int | None:
    """The shim's exit status if it ended by itself within ``timeout_s`` (a fault point's SIGKILL),
    else None; either way it is stopped after: no shim outlives its test."""
    try:
        return shim.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        stop_shim(shim)


def stop_shim(shim: Shim, *, kill: bool = False) -> None:
    shim.channel.close()
    if shim.process.poll() is None:
        shim.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            shim.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            shim.process.kill()
            shim.process.wait()


def state_domains(state_dir: Path) -> list[str]:
    """libvirt domains, of any name, defined by the shim whose state database is in ``state_dir``
    (told by the owner its metadata names)."""
    import libvirt

    from vmsandbox.domain_xml import read_identity

    db = sqlite3.connect(f"{(state_dir / 'state.db').resolve().as_uri()}?mode=ro", uri=True, timeout=10)
    try:
        owner = str(db.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()[0])
    finally:
        db.close()
    conn = libvirt.open(LIBVIRT_URI)
    try:
        names = []
        for d in conn.listAllDomains(0):
            try:
                ident = read_identity(d.XMLDesc(0))
            except libvirt.libvirtError:
                continue  # gone while we looked
            if ident is not None and ident.owner == owner:
                names.append(d.name())
        return names
    finally:
        conn.close()


def our_domains(shim: Shim | None = None) -> list[str]:
    """vmsandbox domains on libvirt; with ``shim``, only those its state database defined (other
    test runs may share this libvirt)."""
    if shim is not None:
        return [n for n in state_domains(shim.state_dir) if n.startswith(DOMAIN_PREFIX)]
    import libvirt

    conn = libvirt.open(LIBVIRT_URI)
    try:
        return [d.name() for d in conn.listAllDomains(0) if d.name().startswith(DOMAIN_PREFIX)]
    finally:
        conn.close()


def remove_all(shim: Shim) -> None:
    for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=120)


@contextmanager
def running_shim(
    tmp: Path, *, extra_config: dict[str, object] | None = None, pull_busybox: bool = True
) -> Iterator[Shim]:
    """A shim for the block: on the way out it removes every sandbox it holds, stops, and cleans ``tmp``."""
    running = start_shim(tmp, extra_config=extra_config, pull_busybox=pull_busybox)
    try:
        yield running
    finally:
        try:
            remove_all(running)
        finally:
            stop_shim(running)
            shutil.rmtree(tmp, ignore_errors=True)


def run_to_exit(
    shim: Shim, sandbox_id: str, sandbox_config: pb.PodSandboxConfig, config: pb.ContainerConfig, timeout_s: float = 90
) -> list[tuple[str, str]]:
    """Create and start ``config`` in the sandbox, wait until it exits, and return its CRI log as
    (stream, text) lines (the log is ``sandbox_config.log_directory``/``config.log_path``)."""
    rt = shim.runtime
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox_config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    deadline = time.monotonic() + timeout_s
    while (
        rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status.state != pb.CONTAINER_EXITED
    ):
        assert time.monotonic() < deadline, f"container {config.metadata.name} did not exit\n{shim.log_text()[-3000:]}"
        time.sleep(0.2)
    out = []
    for line in (Path(sandbox_config.log_directory) / config.log_path).read_text().splitlines():
        _, stream, _, text = line.split(" ", 3)
        out.append((stream, text))
    return out
