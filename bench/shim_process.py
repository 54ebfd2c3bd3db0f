"""A real shim process on a private socket and state directory, for the benchmarks.

``with shim_process(tmp, "--profile", path) as runtime:`` starts ``python -m shim serve``, waits
for its socket, checks it answers ``Version`` and yields a RuntimeService stub. When the block
ends, however it ends (an error, SIGTERM or SIGINT: ``tests.interrupts``), every sandbox the shim
still holds is removed through it, the shim is stopped (SIGTERM), and any guest of its state that
libvirt still has (one it was still starting) is removed by its metadata. The shim runs in a
session of its own, so a signal to the benchmark's process group reaches the benchmark only and the
shim is stopped after the sandboxes, not before.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from tests import interrupts

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def shim_process(
    tmp: str | Path, *serve_args: str, log_level: str = "INFO", pod_network: str | None = "none"
) -> Iterator[pb_grpc.RuntimeServiceStub]:
    """``pod_network``: the shim's --pod-network (None: what its --config says)."""
    tmp = Path(tmp)
    for d in (tmp.resolve(), *tmp.resolve().parents):  # each sandbox's QEMU, as its own uid, passes
        if not d.stat().st_mode & 0o001:  # through to its directory in the state below
            d.chmod((d.stat().st_mode & 0o7777) | 0o001)
    sock = tmp / "cri.sock"
    log_path = tmp / "shim.log"
    argv = [
        sys.executable,
        "-m",
        "shim",
        "--log-level",
        log_level,
        "serve",
        "--socket",
        str(sock),
        "--state-dir",
        str(tmp / "state"),
        "--console-dir",
        str(tmp / "console"),
        *(("--pod-network", pod_network) if pod_network else ()),
        *serve_args,
    ]
    interrupts.install()
    with open(log_path, "wb") as log:
        shim = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not sock.exists():
                if shim.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"shim did not start: {log_path.read_text()}")
                time.sleep(0.05)
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                runtime = pb_grpc.RuntimeServiceStub(channel)
                runtime.Version(pb.VersionRequest(), timeout=30)
                try:
                    yield runtime
                finally:
                    if shim.poll() is None:
                        _remove_sandboxes(runtime)
        finally:
            shim.terminate()
            try:
                shim.wait(timeout=60)
            except subprocess.TimeoutExpired:
                shim.kill()
                shim.wait()
            interrupts.remove_guests(tmp / "state")


def _remove_sandboxes(runtime: pb_grpc.RuntimeServiceStub) -> None:
    """Every sandbox the shim holds, removed (each failure printed; the next one is still tried)."""
    try:
        sandboxes = runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
    except grpc.RpcError as exc:
        print(f"clean-up: ListPodSandbox failed: {exc.code().name}", file=sys.stderr)
        return
    for s in sandboxes:
        try:
            runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=120)
            runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=120)
        except grpc.RpcError as exc:
            print(f"clean-up: sandbox {s.id[:12]} not removed: {exc.code().name}", file=sys.stderr)
