"""``EventPublisher``: task events to containerd (``containerd.services.events.ttrpc.v1.Events``,
``Forward``, on containerd's ttrpc socket), as a runtime shim publishes them.

containerd's CRI plugin learns that a container exited from ``/tasks/exit`` (it also waits on
the task, so a lost event delays nothing for long). Publishing never blocks its caller: events
wait in a bounded queue for one sender thread, which connects when it has something to send,
sends each as one unary call with a timeout, and on a failure reconnects and tries again up to
``ATTEMPTS`` times before it drops the event with a warning. An event's ``Any`` is typed by its
message's full name (``containerd.events.TaskExit``), as containerd's typeurl names them.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time

from google.protobuf import any_pb2
from google.protobuf.message import Message

from gen.containerd.services.ttrpc.events.v1 import events_pb2
from gen.containerd.types import event_pb2
from shim.containerd.wire import timestamp
from shim.nri import wire
from vmsandbox import ttrpc

log = logging.getLogger(__name__)

SERVICE = "containerd.services.events.ttrpc.v1.Events"
QUEUE_MAX = 4096
ATTEMPTS = 5
CALL_TIMEOUT_S = 10.0


class EventPublisher:
    def __init__(self, address: str, namespace: str) -> None:
        self.address = address.removeprefix("unix://")
        self.namespace = namespace
        self._queue: queue.Queue[tuple[str, Message] | None] = queue.Queue(QUEUE_MAX)
        self._sock: socket.socket | None = None
        self._stream = 1
        self._dropping = threading.Event()  # close's time is up: what is still queued is dropped
        self._thread = threading.Thread(target=self._run, name="containerd-events", daemon=True)
        self._thread.start()

    def publish(self, topic: str, event: Message) -> None:
        """Queues ``event`` under ``topic`` (e.g. "/tasks/exit"); a full queue drops it, warning."""
        try:
            self._queue.put_nowait((topic, event))
        except queue.Full:
            log.warning("containerd events: queue full, %s of %s dropped", topic, getattr(event, "container_id", "?"))

    def close(self, wait_s: float = 5.0) -> None:
        """Lets the queued events go for at most ``wait_s`` in all; what is left then is dropped."""
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=wait_s)
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._dropping.set()
            log.warning("containerd events: %d not delivered to %s by close", self._queue.qsize(), self.address)
        else:
            self._disconnect()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._dropping.is_set():
                self._disconnect()
                return
            topic, event = item
            envelope = event_pb2.Envelope(
                timestamp=timestamp(time.time_ns()),
                namespace=self.namespace,
                topic=topic,
                event=any_pb2.Any(type_url=event.DESCRIPTOR.full_name, value=event.SerializeToString()),
            )
            payload = events_pb2.ForwardRequest(envelope=envelope).SerializeToString()
            for attempt in range(ATTEMPTS):
                try:
                    self._call(payload)
                    break
                except (OSError, ttrpc.ProtocolError, EventRefused) as exc:
                    self._disconnect()
                    if attempt == ATTEMPTS - 1 or self._dropping.is_set():
                        log.warning("containerd events: %s not delivered to %s: %s", topic, self.address, exc)
                        break
                    time.sleep(0.2 * (attempt + 1))

    def _call(self, payload: bytes) -> None:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(CALL_TIMEOUT_S)
            try:
                sock.connect(self.address)
            except OSError:
                sock.close()
                raise
            self._sock, self._stream = sock, 1
        stream = self._stream
        self._stream += 2
        request = wire.Request(SERVICE, "Forward", payload, int(CALL_TIMEOUT_S * 1e9))
        self._sock.sendall(ttrpc.encode_frame(wire.request_frame(stream, request)))
        buf = b""
        while True:
            data = self._sock.recv(65536)
            if not data:
                raise OSError("containerd closed the connection")
            frames, buf = ttrpc.decode_frames(buf + data)
            for frame in frames:
                if frame.stream_id != stream:
                    continue
                reply = wire.parse_response(frame)
                if reply.code != ttrpc.OK:
                    raise EventRefused(f"code {reply.code}: {reply.message[:200]}")
                return

    def _disconnect(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


class EventRefused(Exception):
    """containerd answered the Forward with an error."""
