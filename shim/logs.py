"""Logging set-up: text or JSON lines, and the pod a line is about on every line about a pod.

The orchestrator calls ``bind(sandbox_id=..., pod=...)`` as soon as it knows who a request is for;
a filter on the handler copies the bound values onto every record emitted in that context (the
hypervisor's and tenacity's lines included). The RPC wrapper (``shim.status.rpc``) opens a fresh
context per call with ``scope()``, so one RPC's pod never leaks into the next on the same thread.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")

_pod: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("vmsandbox_pod", default=("", ""))


def bind(*, sandbox_id: str | None = None, pod: str | None = None) -> None:
    """Attach the sandbox id and/or the pod (``namespace/name``) to the lines logged from here on."""
    current_id, current_pod = _pod.get()
    _pod.set((current_id if sandbox_id is None else sandbox_id, current_pod if pod is None else pod))


def current() -> tuple[str, str]:
    return _pod.get()


@contextmanager
def scope() -> Iterator[None]:
    """A context whose bindings end with it (one per RPC)."""
    token = _pod.set(("", ""))
    try:
        yield
    finally:
        _pod.reset(token)


class PodFilter(logging.Filter):
    """Adds ``sandbox_id`` and ``pod`` to every record (empty strings when none is bound)."""

    def filter(self, record: logging.LogRecord) -> bool:
        sandbox_id, pod = _pod.get()
        if not getattr(record, "sandbox_id", ""):
            record.sandbox_id = sandbox_id
        if not getattr(record, "pod", ""):
            record.pod = pod
        return True


class TextFormatter(logging.Formatter):
    """``2026-01-02T03:04:05.678Z INFO shim.sandboxes [sandbox=0123abcd4567 pod=ns/web]: message``."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        tags = []
        sandbox_id, pod = str(getattr(record, "sandbox_id", "")), str(getattr(record, "pod", ""))
        if sandbox_id:
            tags.append(f"sandbox={sandbox_id[:12]}")
        if pod:
            tags.append(f"pod={pod}")
        where = f" [{' '.join(tags)}]" if tags else ""
        line = f"{stamp} {record.levelname} {record.name}{where}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, sandbox_id/pod when bound, and any ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in ("sandbox_id", "pod"):
            value = getattr(record, key, "")
            if value:
                doc[key] = value
        fields = getattr(record, "fields", None)  # structured values a caller passed as extra={"fields": {...}}
        if isinstance(fields, dict):
            doc.update({k: v for k, v in fields.items() if k not in doc})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def setup(level: str = "INFO", fmt: str = "text") -> None:
    """(Re)configure the root logger: one stderr handler with the pod filter and the chosen format."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(PodFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
