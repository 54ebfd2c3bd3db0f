"""A containerd 2.4 (the pinned build) with vmsandbox as its runtime shim, for the shim-mode
integration tests: containerd finds vmsandbox's launcher on its PATH, a drop-in maps the
``vmsandbox`` handler to it, and one vmsandbox serves the handler's ttrpc socket (and, with
``proxy``, its own CRI socket too, with that containerd downstream: both modes on one core).
crictl drives either socket."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.cluster_support import kube_bin
from tests.integration.cni_kit import CniEnv, cni_env
from tests.integration.downstream_kit import Containerd, containerd, tools_image
from tests.shim_kit import REPO, Shim, busybox_registry, require_host, start_shim, stop_shim
from vmsandbox.containerd_config import SHIM_DIR_FILE, drop_in, launcher_name, shim_dir_text

SHIM_BINARY = REPO / ".venv" / "bin" / "containerd-shim-vmsandbox-v1"


@dataclass
class Env:
    tmp: Path
    ctd: Containerd
    shim: Shim
    cni: CniEnv
    crictl_bin: str
    image: str
    shim_config: dict[str, object]

    def crictl_on(self, endpoint: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """crictl on ``endpoint`` (runtime and image service); with ``check``, a failure shows
        both daemons' logs."""
        done = subprocess.run(
            [self.crictl_bin, "--runtime-endpoint", endpoint, "--image-endpoint", endpoint, "--timeout", "240s", *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if check:
            assert done.returncode == 0, (
                f"crictl {' '.join(args)}: {done.stderr}\n--- vmsandbox:\n{self.shim.log_text()[-3000:]}"
                f"\n--- containerd:\n{(self.ctd.dir / 'containerd.log').read_text()[-3000:]}"
            )
        return done

    def crictl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """crictl on containerd's socket."""
        return self.crictl_on(self.ctd.endpoint, *args, check=check)

    def until_listening(self, endpoint: str, cid: str, port: int, timeout_s: float = 90) -> None:
        """Wait until container ``cid`` has a socket listening on ``port`` (its /proc/net/tcp or
        tcp6, read with crictl exec on ``endpoint``)."""
        deadline = time.monotonic() + timeout_s
        while not listening(self.crictl_on(endpoint, "exec", cid, "sh", "-c", "cat /proc/net/tcp*").stdout, port):
            assert time.monotonic() < deadline, f"container {cid[:12]} never listened on {port}"
            time.sleep(0.5)

    def write(self, name: str, doc: dict[str, object]) -> str:
        path = self.tmp / name
        path.write_text(json.dumps(doc))
        return str(path)


@contextmanager
def shim_mode(prefix: str, bridge: str, subnet: str, *, proxy: bool = False) -> Iterator[Env]:
    """containerd with the ``vmsandbox`` handler through vmsandbox's runtime shim, on a CNI bridge of
    its own; with ``proxy``, vmsandbox's CRI socket also answers, containerd its downstream. Every
    pod either holds is removed at the end, and vmsandbox stopped."""
    require_host()
    if busybox_registry() is None:
        pytest.skip("no local registry (docker-registry, skopeo, busybox-static)")
    bin_dir = kube_bin()
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    (tmp / "cni").mkdir()
    shim_dir = tmp / "shim-sockets"
    # containerd finds a runtime type's shim binary on its PATH, as it finds runc's: the pinned
    # containerd and runc shim, and vmsandbox's launcher under the handler's name, the shim
    # directory's file beside it
    path_dir = tmp / "bin"
    path_dir.mkdir()
    for name in ("containerd", "containerd-shim-runc-v2"):
        (path_dir / name).symlink_to(Path(bin_dir) / name)
    (path_dir / launcher_name("vmsandbox")).symlink_to(SHIM_BINARY)
    (path_dir / SHIM_DIR_FILE).write_text(shim_dir_text(str(shim_dir)))
    old = os.environ.get("CONTAINERD_BIN_DIR")
    os.environ["CONTAINERD_BIN_DIR"] = str(path_dir)
    try:
        with cni_env(tmp / "cni", bridge=bridge, subnet=subnet) as cni:
            ctd_dir = tmp / "ctd"
            (ctd_dir / "conf.d").mkdir(parents=True)
            (ctd_dir / "conf.d" / "vmsandbox.toml").write_text(drop_in(["vmsandbox"]))
            with containerd(ctd_dir, cni.conf_dir) as ctd:
                (tmp / "shim").mkdir()
                config: dict[str, object] = {
                    **cni.shim_config(),
                    "containerd_address": str(ctd.socket),
                    "containerd_root": str(ctd.dir / "root"),
                    "containerd_shim_dir": str(shim_dir),
                    "containerd_image_prune_s": 2,
                }
                if proxy:
                    config["downstream_endpoint"] = ctd.endpoint
                    config["registries"] = [
                        {"prefix": ctd.registry, "insecure": True},
                        {"prefix": "docker.io", "location": ctd.registry, "insecure": True},
                    ]
                shim = start_shim(tmp / "shim", extra_config=config, pull_busybox=False)
                env = Env(tmp, ctd, shim, cni, os.path.join(bin_dir, "crictl"), tools_image(), config)
                try:
                    yield env
                finally:
                    try:
                        ctd.remove_all()
                    finally:
                        stop_shim(env.shim)
    finally:
        if old is None:
            os.environ.pop("CONTAINERD_BIN_DIR", None)
        else:
            os.environ["CONTAINERD_BIN_DIR"] = old
        if not os.environ.get("VMSANDBOX_KEEP_TMP"):
            shutil.rmtree(tmp, ignore_errors=True)


def pod_config(name: str, cpu_millis: int = 500, memory: int = 128 << 20) -> dict[str, object]:
    """A crictl pod config: one namespace, a unique uid, the sandbox's CPU and memory limits."""
    return {
        "metadata": {"name": name, "namespace": "shimtest", "uid": f"uid-{name}-{time.time_ns()}", "attempt": 0},
        "log_directory": "/tmp",
        "linux": {
            "cgroup_parent": "",
            "resources": {"cpu_period": 100000, "cpu_quota": cpu_millis * 100, "memory_limit_in_bytes": memory},
        },
    }


def container_config(name: str, command: list[str], image: str, memory: int = 64 << 20) -> dict[str, object]:
    """A crictl container config: ``command`` from ``image``, a memory limit and a fifth of a CPU."""
    return {
        "metadata": {"name": name},
        "image": {"image": image},
        "command": command,
        "log_path": f"{name}.log",
        "linux": {"resources": {"memory_limit_in_bytes": memory, "cpu_period": 100000, "cpu_quota": 20000}},
    }


def listening(proc_net_tcp: str, port: int) -> bool:
    """Whether ``/proc/net/tcp`` or ``tcp6`` text (one or both, headers anywhere) has a socket
    listening on ``port`` (state 0A)."""
    for line in proc_net_tcp.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[0] != "sl" and fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
            return True
    return False
