"""Streaming Exec and PortForward through a real shim and guest, against their baselines.

    VMSANDBOX_IMAGE_DIR=/var/lib/vmsandbox/images/default python -m bench.streaming --runs 10
    python -m bench.streaming --smoke

- **exec**: ``Exec`` of ``echo hello`` end to end (the RPC, the WebSocket upgrade with the
  ``websocket-client`` package, the output and the exit status, the close) against ``ExecSync`` of
  the same command; ``ratio_exec_vs_execsync`` (target 1.3).
- **port-forward**: a server in the guest sends ``--mib`` MiB; read through the streaming server
  (SPDY, our framing, one forwarded connection) against a plain TCP connection from the node to
  the pod's address, which is what the forward dials; ``ratio_portforward_vs_direct`` is
  throughput over throughput (target 0.5). Under TCG the guest's side is CPU-bound.
- **interactive echo**: an exec of ``cat`` with stdin over WebSocket; one byte in, the same byte
  back out, p50 and p95.

Prints one JSON document. Uses a CNI bridge network and registry of its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import websocket

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.qemu_direct import percentile
from gen.cri.runtime.v1 import api_pb2 as pb
from tests import interrupts
from tests.integration.cni_kit import cni_env
from tests.registry_kit import Layout, Registry, busybox_entries, push
from tests.shim_kit import container, pod, q, running_shim
from vmsandbox import spdy

SMALL = q({"cpu": "250m", "memory": "64Mi"})
PORT = 8081


MARKS: dict[str, list[float]] = {"connected": [], "first_output": [], "status": []}


def _ws_exec(url: str, stdin: bytes = b"") -> bytes:
    t0 = time.perf_counter()
    ws = websocket.create_connection(url.replace("http://", "ws://"), subprotocols=["v5.channel.k8s.io"], timeout=120)
    MARKS["connected"].append(time.perf_counter() - t0)
    out = b""
    try:
        if stdin:
            ws.send_binary(b"\x00" + stdin)
        while True:
            try:
                opcode, data = ws.recv_data()
            except websocket.WebSocketConnectionClosedException:
                break
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                break
            if data[:1] == b"\x01":
                if not out:
                    MARKS["first_output"].append(time.perf_counter() - t0)
                out += data[1:]
            elif data[:1] == b"\x03":
                MARKS["status"].append(time.perf_counter() - t0)
    finally:
        ws.close()
    return out


def _spdy_forward_read(url: str, port: int, expect: int) -> int:
    """Reads ``expect`` bytes from ``port`` of the pod through the streaming URL (SPDY)."""
    host, _, rest = url.removeprefix("http://").partition("/")
    h, p = host.rsplit(":", 1)
    sock = socket.create_connection((h, int(p)), timeout=120)
    try:
        sock.sendall(
            f"POST /{rest} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
            "X-Stream-Protocol-Version: portforward.k8s.io\r\nContent-Length: 0\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        codec = spdy.HeaderCodec()
        for sid, kind in ((1, "error"), (3, "data")):
            sock.sendall(spdy.encode_syn_stream(codec, sid, {"streamtype": kind, "port": str(port), "requestid": "0"}))
        parser = spdy.FrameParser(spdy.HeaderCodec())
        got = 0
        while got < expect:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            for f in parser.feed(chunk):
                if isinstance(f, spdy.Data) and f.stream_id == 3:
                    got += len(f.data)
                    if f.fin:
                        return got
        return got
    finally:
        sock.close()


def _direct_read(ip: str, port: int, expect: int) -> int:
    got = 0
    with socket.create_connection((ip, port), timeout=120) as s:
        while got < expect and (chunk := s.recv(1 << 16)):
            got += len(chunk)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="3 runs, 1 MiB: a quick check that the paths work")
    args = ap.parse_args()
    runs, mib = (3, 1) if args.smoke else (args.runs, args.mib)
    size = mib << 20
    tmp = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        layout.tag("bb", layout.image([layout.layer(busybox_entries(("sh", "echo", "cat", "nc", "head")))]))
        ref = f"{registry.host}/bench/busybox:streaming"
        push(layout, "bb", ref)
        with cni_env(tmp, bridge="vmsbr-strm2", subnet="10.235.0.0/24") as cni:
            (tmp / "shim").mkdir()
            with running_shim(tmp / "shim", extra_config=cni.shim_config(), pull_busybox=False) as shim:
                rt = shim.runtime
                shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=120)
                config = pod("bench", containers=[("c", SMALL)])
                config.log_directory = str(tmp / "logs")
                sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
                ip = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=30).status.network.ip
                c = container("c", SMALL)
                c.image.image = ref
                # -ll: a persistent server, one forked sender per connection
                c.command[:] = ["nc", "-ll", "-p", str(PORT), "-e", "sh", "-c", f"head -c {size} /dev/zero"]
                c.log_path = "c.log"
                cid = rt.CreateContainer(
                    pb.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config), timeout=120
                ).container_id
                rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)

                stream_s, sync_s = [], []
                for _ in range(runs):
                    t = time.perf_counter()
                    url = rt.Exec(pb.ExecRequest(container_id=cid, cmd=["echo", "hello"], stdout=True), timeout=60).url
                    assert _ws_exec(url) == b"hello\n"
                    stream_s.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    r = rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["echo", "hello"], timeout=60), timeout=90)
                    assert r.stdout == b"hello\n"
                    sync_s.append(time.perf_counter() - t)

                deadline = time.monotonic() + 60  # the server in the guest is listening
                while True:
                    try:
                        if _direct_read(ip, PORT, size) == size:
                            break
                    except OSError:
                        pass
                    if time.monotonic() > deadline:
                        raise SystemExit(f"no server on {ip}:{PORT} in the guest")
                    time.sleep(0.5)
                time.sleep(0.3)
                pf_mbs, direct_mbs = [], []
                for _ in range(runs):
                    t = time.perf_counter()
                    got = _direct_read(ip, PORT, size)
                    direct_mbs.append(got / (time.perf_counter() - t) / 1e6)
                    assert got == size, got
                    t = time.perf_counter()
                    url = rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=sid), timeout=60).url
                    got = _spdy_forward_read(url, PORT, size)
                    pf_mbs.append(got / (time.perf_counter() - t) / 1e6)
                    assert got == size, got

                url = rt.Exec(pb.ExecRequest(container_id=cid, cmd=["cat"], stdin=True, stdout=True), timeout=60).url
                ws = websocket.create_connection(url.replace("http://", "ws://"), subprotocols=["v5.channel.k8s.io"])
                echo_s = []
                try:
                    for i in range(runs * 10):
                        byte = bytes([ord("a") + i % 26])
                        t = time.perf_counter()
                        ws.send_binary(b"\x00" + byte)
                        while True:
                            _, data = ws.recv_data()
                            if data == b"\x01" + byte:
                                break
                        echo_s.append(time.perf_counter() - t)
                finally:
                    ws.close()
                result = {
                    "runs": runs,
                    "mib": mib,
                    "exec_echo_p50_ms": round(percentile(stream_s, 50) * 1000, 1),
                    "execsync_echo_p50_ms": round(percentile(sync_s, 50) * 1000, 1),
                    "ratio_exec_vs_execsync": round(percentile(stream_s, 50) / percentile(sync_s, 50), 3),
                    # from the client's connect: upgraded, first output, exit status
                    **{f"exec_{k}_p50_ms": round(percentile(v, 50) * 1000, 1) for k, v in MARKS.items() if v},
                    "portforward_mb_s_median": round(statistics.median(pf_mbs), 2),
                    "direct_mb_s_median": round(statistics.median(direct_mbs), 2),
                    "ratio_portforward_vs_direct": round(statistics.median(pf_mbs) / statistics.median(direct_mbs), 3),
                    "interactive_echo_p50_ms": round(percentile(echo_s, 50) * 1000, 1),
                    "interactive_echo_p95_ms": round(percentile(echo_s, 95) * 1000, 1),
                }
                print(json.dumps(result, indent=2))
    finally:
        registry.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
