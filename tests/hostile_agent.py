"""A guest agent that lies about container logs, for tests of the host's log copy: it listens on
a unix socket as QEMU's end of the agent channel does, says hello (protocol 3) and answers
``log_read`` according to its mode; other requests get an empty success.

    python -m tests.hostile_agent SOCKET MODE

Modes: ``flood`` (every answer as large as asked, a line end every 4000 bytes, never an end),
``noline`` (as large as asked, no line end ever), ``backwards`` (one honest answer, then an
offset before the one asked for), ``oversize`` (one byte more than asked), ``badb64``.
"""

from __future__ import annotations

import base64
import json
import socket
import sys

REPORT = {
    "agent": "hostile/3",
    "protocol": 3,
    "kernel": "6.1.0",
    "vcpus": 1,
    "mem_total_kib": 1,
    "hugepages": {},
    "cmdline": "",
    "boot_ms": 1,
}


def answer(mode: str, args: dict[str, object], answered: int) -> dict[str, object]:
    offset, max_bytes = int(str(args["offset"])), int(str(args["max_bytes"]))
    if mode == "flood":
        data = (b"x" * 3999 + b"\n") * (max_bytes // 4000) or b"x" * max_bytes
    elif mode == "noline":
        data = b"y" * max_bytes
    elif mode == "backwards":
        data = b"line\n"
        offset = offset - 1 if answered else offset
    elif mode == "oversize":
        data = b"z" * (max_bytes + 1)
    elif mode == "badb64":
        return {"offset": offset, "data": "!!not base64!!", "eof": False}
    else:
        raise SystemExit(f"unknown mode {mode}")
    return {"offset": offset, "data": base64.b64encode(data).decode(), "eof": False}


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen()
        conn, _ = server.accept()
        with conn, conn.makefile("rwb") as f:

            def send(obj: dict[str, object]) -> None:
                f.write(json.dumps({"v": 3, **obj}).encode() + b"\n")
                f.flush()

            send({"type": "hello", "body": REPORT})
            answered = 0
            for line in f:
                msg = json.loads(line)
                if msg.get("type") != "request":
                    continue
                body: dict[str, object] = {}
                if msg["op"] == "report":
                    body = REPORT
                elif msg["op"] == "log_read":
                    body = answer(mode, msg.get("args", {}), answered)
                    answered += 1
                send({"type": "response", "id": msg["id"], "ok": True, "body": body})


if __name__ == "__main__":
    main()
