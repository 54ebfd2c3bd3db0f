"""Record a real NRI plugin's conversation with us, for the golden tests of vmsandbox.ttrpc.

    .venv/bin/python tests/nri_plugin/capture_frames.py PLUGIN_BINARY OUT.json

Starts PLUGIN_BINARY as a runtime starts a plugin (NRI_PLUGIN_NAME=test, NRI_PLUGIN_IDX=10,
the socket as fd 3), plays the runtime's side by hand (answers RegisterPlugin, calls Configure,
Synchronize and CreateContainer) and writes the bytes each side sent on the trunk, in order,
as hex. tests/vmsandbox/test_ttrpc.py decodes them without Go.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from gen.nri import api_pb2 as api
from shim.nri import wire
from vmsandbox import ttrpc

CONFIG = "env=GOLDEN=1 annotation=example.com/golden=yes memory=134217728 rlimit=RLIMIT_NOFILE:1024:2048"


def main() -> None:
    binary, out = sys.argv[1], sys.argv[2]
    ours, theirs = socket.socketpair()
    fd = theirs.fileno()
    proc = subprocess.Popen(
        ["/bin/sh", "-c", f'exec "$0" 3<&{fd} {fd}<&-', binary],
        env={"NRI_PLUGIN_NAME": "test", "NRI_PLUGIN_IDX": "10", "NRI_PLUGIN_SOCKET": "3"},
        pass_fds=(fd,),
        stderr=subprocess.DEVNULL,
    )
    theirs.close()
    ours.settimeout(10)
    log: list[dict[str, str]] = []
    buffers = {1: b"", 2: b""}
    trunk = b""

    def send(conn: int, frame: ttrpc.Frame) -> None:
        data = ttrpc.encode_mux(conn, ttrpc.encode_frame(frame))
        log.append({"from": "runtime", "hex": data.hex()})
        ours.sendall(data)

    def receive(conn: int) -> ttrpc.Frame:
        nonlocal trunk
        while True:
            frames, buffers[conn] = ttrpc.decode_frames(buffers[conn])
            if frames:
                assert len(frames) == 1
                return frames[0]
            data = ours.recv(65536)
            assert data, "plugin closed the connection"
            log.append({"from": "plugin", "hex": data.hex()})
            chunks, trunk = ttrpc.decode_mux(trunk + data)
            for cid, chunk in chunks:
                buffers[cid] += chunk

    register = receive(ttrpc.RUNTIME_SERVICE_CONN)
    send(ttrpc.RUNTIME_SERVICE_CONN, wire.response_frame(register.stream_id, wire.Response(0, "", b"")))
    calls = [
        (
            "Configure",
            api.ConfigureRequest(
                config=CONFIG,
                runtime_name="vmsandbox",
                runtime_version="0.1.0",
                registration_timeout=5000,
                request_timeout=2000,
                NRI_version="v0.12.2",
            ),
        ),
        ("Synchronize", api.SynchronizeRequest()),
        (
            "CreateContainer",
            api.CreateContainerRequest(
                pod=api.PodSandbox(id="p" * 64, name="golden"), container=api.Container(id="c" * 64, name="app")
            ),
        ),
    ]
    for n, (method, req) in enumerate(calls):
        stream = 2 * n + 1
        send(
            ttrpc.PLUGIN_SERVICE_CONN,
            wire.request_frame(
                stream, wire.Request("nri.pkg.api.v1alpha1.Plugin", method, req.SerializeToString(), 2_000_000_000)
            ),
        )
        assert receive(ttrpc.PLUGIN_SERVICE_CONN).stream_id == stream
    ours.close()
    proc.wait(10)
    with open(out, "w") as f:
        json.dump({"plugin": "tests/nri_plugin/main.go", "config": CONFIG, "trunk": log}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
