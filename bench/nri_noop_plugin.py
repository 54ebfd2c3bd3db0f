"""An NRI plugin that registers, subscribes to every event and answers each with nothing.

    NRI_PLUGIN_NAME=noop NRI_PLUGIN_IDX=10 NRI_PLUGIN_SOCKET=3 bench/nri_noop_plugin.py   # started by the runtime
    bench/nri_noop_plugin.py /var/run/nri/nri.sock                                      # external

bench/nri.py uses it when ``NRI_PLUGIN`` names no plugin built from containerd/nri's stub
(tests/nri_plugin/build.sh): it speaks the same protocol (ttrpc both ways over NRI's
multiplexer) with vmsandbox's framing, so the benchmark runs on a host without Go.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gen.nri import api_pb2 as api
from shim.nri import wire
from vmsandbox import ttrpc

REPLIES = {
    "Configure": api.ConfigureResponse(events=0),
    "Synchronize": api.SynchronizeResponse(),
    "CreateContainer": api.CreateContainerResponse(),
    "UpdateContainer": api.UpdateContainerResponse(),
    "StopContainer": api.StopContainerResponse(),
}


def main() -> None:
    if len(sys.argv) > 1:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(sys.argv[1])
    else:
        sock = socket.socket(fileno=int(os.environ["NRI_PLUGIN_SOCKET"]))
    name, idx = os.environ.get("NRI_PLUGIN_NAME", "noop"), os.environ.get("NRI_PLUGIN_IDX", "10")
    register = api.RegisterPluginRequest(plugin_name=name, plugin_idx=idx, NRI_version="v0.12.2")
    req = wire.Request("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin", register.SerializeToString())
    sock.sendall(ttrpc.encode_mux(ttrpc.RUNTIME_SERVICE_CONN, ttrpc.encode_frame(wire.request_frame(1, req))))
    trunk, streams = b"", {1: b"", 2: b""}
    while data := sock.recv(65536):
        chunks, trunk = ttrpc.decode_mux(trunk + data)
        for cid, chunk in chunks:
            frames, streams[cid] = ttrpc.decode_frames(streams[cid] + chunk)
            if cid != ttrpc.PLUGIN_SERVICE_CONN:
                continue  # the answer to RegisterPlugin
            out = b""
            for frame in frames:
                method = wire.parse_request(frame).method
                reply = REPLIES.get(method, api.Empty()).SerializeToString()
                out += ttrpc.encode_frame(wire.response_frame(frame.stream_id, wire.Response(ttrpc.OK, "", reply)))
            if out:
                sock.sendall(ttrpc.encode_mux(ttrpc.PLUGIN_SERVICE_CONN, out))


if __name__ == "__main__":
    main()
