"""A free TCP port on 127.0.0.1 that no other test will be given by chance.

A port the kernel picks (bind to port 0) comes from the ephemeral range, from which every other
test's outgoing connections take their local ports too: once released, under parallel workers it
may be taken before the test binds it again. These come from below that range, where only an
explicit bind takes a port.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def quiet_port() -> int:
    """A port in [10000, ephemeral range) that is free now."""
    low, high = 10000, _ephemeral_low()
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) after 200 tries")


def answer_when_listening(port: int, send: bytes, timeout_s: float) -> bytes:
    """The first answer to ``send`` on 127.0.0.1:``port``, trying again every half second while
    nothing listens there or nothing answers yet (b"" if nothing did within ``timeout_s``)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
                c.sendall(send)
                answer = c.recv(100)
            if answer:
                return answer
        except OSError:
            pass
        time.sleep(0.5)
    return b""
