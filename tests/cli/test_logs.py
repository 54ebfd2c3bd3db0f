"""Structured logs: the pod a line is about is on the line, in text and JSON, and does not leak
from one RPC's scope into the next (in-process: the formatter and the filter are pure)."""

from __future__ import annotations

import contextvars
import io
import json
import logging
from collections.abc import Iterator

import pytest

from shim import logs


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, logging.Handler]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.PodFilter())
    log = logging.getLogger("test.vmsandbox.logs")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield stream, handler
    finally:
        log.removeHandler(handler)


@pytest.mark.parametrize(
    "formatter,check",
    [
        pytest.param(
            logs.JsonFormatter(),
            lambda line: json.loads(line) | {"ts": "-"}
            == {"ts": "-", "level": "INFO", "logger": "test.vmsandbox.logs", "msg": "booted 2",
                "sandbox_id": "ab" * 32, "pod": "shop/web"},
            id="json",
        ),
        pytest.param(
            logs.TextFormatter(),
            lambda line: line.endswith(" INFO test.vmsandbox.logs [sandbox=abababababab pod=shop/web]: booted 2"),
            id="text",
        ),
    ],
)  # fmt: skip
def test_pod_on_every_line(
    captured: tuple[io.StringIO, logging.Handler], formatter: logging.Formatter, check: object
) -> None:
    stream, handler = captured
    handler.setFormatter(formatter)
    log = logging.getLogger("test.vmsandbox.logs")
    with logs.scope():
        logs.bind(pod="shop/web")
        logs.bind(sandbox_id="ab" * 32)
        log.info("booted %d", 2)
    assert callable(check) and check(stream.getvalue().strip())


def test_scope_ends_the_binding(captured: tuple[io.StringIO, logging.Handler]) -> None:
    stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("test.vmsandbox.logs")

    def body() -> tuple[str, str]:  # in a fresh context: other tests may have bound this thread's
        with logs.scope():
            logs.bind(sandbox_id="s1", pod="a/b")
            log.info("inside")
        log.info("outside")
        return logs.current()

    assert contextvars.Context().run(body) == ("", "")
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (inside["sandbox_id"], inside["pod"]) == ("s1", "a/b")
    assert "sandbox_id" not in outside and "pod" not in outside


def test_exceptions_stay_on_one_json_line(captured: tuple[io.StringIO, logging.Handler]) -> None:
    stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("test.vmsandbox.logs").exception("failed")
    (line,) = stream.getvalue().splitlines()
    assert "RuntimeError: boom" in json.loads(line)["exc"]
