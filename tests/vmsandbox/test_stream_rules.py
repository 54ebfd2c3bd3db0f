"""The streaming protocols' rules (``vmsandbox.stream_rules``) and the token cache
(``shim.streaming.tokens``)."""

from __future__ import annotations

import json

import pytest

from shim.streaming.tokens import TokenCache
from vmsandbox import stream_rules
from vmsandbox.errors import InvalidArgument


@pytest.mark.parametrize(
    "kind,cmd,flags,error",
    [
        ("Exec", ["echo"], {"stdout": True}, None),
        ("Exec", ["sh"], {"stdin": True, "stdout": True, "tty": True}, None),
        ("Exec", ["echo"], {}, "one of stdin, stdout or stderr"),
        ("Exec", ["echo"], {"stdout": True, "stderr": True, "tty": True}, "tty and stderr"),
        ("Exec", [], {"stdout": True}, "cmd is empty"),
        ("Exec", ["a\0b"], {"stdout": True}, "NUL"),
        ("Exec", ["x"] * 5000, {"stdout": True}, "over 4096 arguments"),
        ("Attach", [], {"stdin": True, "stdout": True}, None),
    ],
)
def test_stream_requests(kind: str, cmd: list[str], flags: dict[str, bool], error: str | None) -> None:
    kw = {k: flags.get(k, False) for k in ("tty", "stdin", "stdout", "stderr")}
    if error is None:
        req = stream_rules.check_stream_request(kind, "c1", cmd, **kw)
        assert req.cmd == tuple(cmd)
    else:
        with pytest.raises(InvalidArgument, match=error):
            stream_rules.check_stream_request(kind, "c1", cmd, **kw)


@pytest.mark.parametrize(
    "offered,supported,chosen",
    [
        (["v5.channel.k8s.io", "v4.channel.k8s.io"], stream_rules.REMOTECOMMAND_PROTOCOLS, "v5.channel.k8s.io"),
        (["channel.k8s.io", "v4.channel.k8s.io"], stream_rules.REMOTECOMMAND_PROTOCOLS, "v4.channel.k8s.io"),
        (["v9.channel.k8s.io"], stream_rules.REMOTECOMMAND_PROTOCOLS, None),
        ([], (stream_rules.PORTFORWARD_PROTOCOL,), None),
        (["portforward.k8s.io"], (stream_rules.PORTFORWARD_PROTOCOL,), "portforward.k8s.io"),
    ],
)
def test_negotiate(offered: list[str], supported: tuple[str, ...], chosen: str | None) -> None:
    assert stream_rules.negotiate(offered, supported) == chosen


def test_header_lists_split_on_commas() -> None:
    assert stream_rules.split_header_list(["a, b", "c"]) == ["a", "b", "c"]


@pytest.mark.parametrize(
    "tty,stdin,stderr,protocol,expected",
    [
        (False, False, True, stream_rules.V4, {"error", "stdout", "stderr"}),
        (True, True, False, stream_rules.V4, {"error", "stdin", "stdout", "resize"}),
        (True, True, False, stream_rules.V2, {"error", "stdin", "stdout"}),
    ],
)
def test_expected_streams(tty: bool, stdin: bool, stderr: bool, protocol: str, expected: set[str]) -> None:
    req = stream_rules.check_stream_request("Exec", "c", ["x"], tty=tty, stdin=stdin, stdout=True, stderr=stderr)
    assert stream_rules.expected_streams(req, protocol) == expected


def test_exit_status_documents() -> None:
    assert json.loads(stream_rules.exit_status(0)) == {"metadata": {}, "status": "Success"}
    failed = json.loads(stream_rules.exit_status(7))
    assert failed["reason"] == "NonZeroExitCode"
    assert failed["details"]["causes"] == [{"reason": "ExitCode", "message": "7"}]
    assert json.loads(stream_rules.exit_status(0, "guest gone"))["status"] == "Failure"
    assert stream_rules.error_stream_payload(stream_rules.V2, 0) == b""
    assert b"exit status 3" in stream_rules.error_stream_payload(stream_rules.V1, 3)


def test_resize_documents_split_across_chunks() -> None:
    s = stream_rules.ResizeSplitter()
    assert s.feed(b'{"Width":80,') == []
    assert s.feed(b'"Height":24}{"Width":100,"Height":30}') == [
        stream_rules.TerminalSize(80, 24),
        stream_rules.TerminalSize(100, 30),
    ]


@pytest.mark.parametrize("doc", [b"x" * 300, b'{"Width":0,"Height":1}', b"}{", b'{"Width":"80","Height":24}'])
def test_bad_resize_documents(doc: bytes) -> None:
    with pytest.raises(InvalidArgument):
        stream_rules.ResizeSplitter().feed(doc)


def test_websocket_channels() -> None:
    assert stream_rules.ws_encode(stream_rules.V5, 1, b"hi") == b"\x01hi"
    assert stream_rules.ws_encode("v4.base64.channel.k8s.io", 1, b"hi") == "1aGk="
    assert stream_rules.ws_decode(stream_rules.V5, b"\x00abc") == (0, b"abc")
    assert stream_rules.ws_decode("v4.base64.channel.k8s.io", "0aGk=") == (0, b"hi")
    for bad in (b"", "0aGk="):
        with pytest.raises(InvalidArgument):
            stream_rules.ws_decode(stream_rules.V5, bad)
    with pytest.raises(InvalidArgument):
        stream_rules.ws_decode("base64.channel.k8s.io", "0!!")


@pytest.mark.parametrize("value,ok", [("80", True), ("65535", True), ("0", False), ("65536", False), ("-1", False),
                                      ("8a", False), ("", False), ("0000080", False)])  # fmt: skip
def test_ports(value: str, ok: bool) -> None:
    if ok:
        assert stream_rules.parse_port(value) == int(value)
    else:
        with pytest.raises(InvalidArgument):
            stream_rules.parse_port(value)


def test_tokens_are_single_use_expire_and_are_bounded() -> None:
    now = [0.0]
    cache: TokenCache[str] = TokenCache(60, capacity=3, clock=lambda: now[0])
    t1 = cache.put("one")
    assert len(t1) >= 40 and cache.take(t1) == "one" and cache.take(t1) is None
    t2 = cache.put("two")
    now[0] = 61
    assert cache.take(t2) is None  # expired
    tokens = [cache.put(str(i)) for i in range(5)]
    assert len(cache) == 3 and cache.take(tokens[0]) is None and cache.take(tokens[4]) == "4"
    assert cache.take("nonsense") is None
