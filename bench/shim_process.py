"""A real shim process on a private socket and state directory, for the benchmarks.

``with shim_process(tmp, "--profile", path) as runtime:`` starts ``python -m shim serve``, waits
for its socket, checks it answers ``Version`` and yields a RuntimeService stub; the process is
stopped (SIGTERM) when the block ends.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from shim.cri.runtime.v1 import api_pb2 as pb
from shim.cri.runtime.v1 import api_pb2_grpc as pb_grpc

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
    with open(log_path, "wb") as log:
        shim = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not sock.exists():
                if shim.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"shim did not start: {log_path.read_text()}")
                time.sleep(0.05)
            with grpc.insecure_channel(f"unix:{sock}") as channel:
                runtime = pb_grpc.RuntimeServiceStub(channel)
                runtime.Version(pb.VersionRequest(), timeout=30)
                yield runtime
        finally:
            shim.terminate()
            shim.wait(timeout=30)
