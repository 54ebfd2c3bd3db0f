"""vmsandbox.loopback_forward: the nat rule that sends a namespace's loopback TCP to the shim's
listener, the original destination read back from SO_ORIGINAL_DST, and the bound on connections."""

from __future__ import annotations

import socket
import struct

import pytest

from vmsandbox.errors import InvalidArgument
from vmsandbox.loopback_forward import (
    MAX_CONNECTIONS_PER_POD,
    SOCKADDR_IN_LEN,
    admit,
    iptables_argv,
    original_port,
    redirect_rule,
)

RULE_40000 = (
    "OUTPUT -o lo -p tcp -d 127.0.0.1/32 -m comment --comment vmsandbox port-forward -j REDIRECT --to-ports 40000"
)


def test_the_rule_redirects_loopback_tcp_to_the_listener() -> None:
    rule = redirect_rule(40000)
    assert rule[rule.index("--comment") + 1] == "vmsandbox port-forward"  # one word to iptables
    assert " ".join(rule) == RULE_40000


@pytest.mark.parametrize("port", [0, -1, 65536, 70000])
def test_a_listening_port_that_is_no_tcp_port_is_refused(port: int) -> None:
    with pytest.raises(InvalidArgument, match="not a TCP port"):
        redirect_rule(port)


@pytest.mark.parametrize(
    ("action", "want"),
    [
        ("-I", ["/usr/sbin/iptables", "-w", "5", "-t", "nat", "-I", *RULE_40000.split(" ")]),
        ("-D", ["/usr/sbin/iptables", "-w", "5", "-t", "nat", "-D", *RULE_40000.split(" ")]),
        ("-C", ["/usr/sbin/iptables", "-w", "5", "-t", "nat", "-C", *RULE_40000.split(" ")]),
    ],
)
def test_iptables_adds_checks_and_deletes_the_same_rule(action: str, want: list[str]) -> None:
    got = iptables_argv(action, 40000)
    # the comment is one argument: rejoin it as the expected list split it
    i = got.index("--comment")
    assert [*got[: i + 1], *got[i + 1].split(" "), *got[i + 2 :]] == want


@pytest.mark.parametrize("action", ["-A", "-F", "", "-X"])
def test_other_iptables_actions_are_refused(action: str) -> None:
    with pytest.raises(InvalidArgument):
        iptables_argv(action, 40000)


def sockaddr_in(port: int, address: str = "127.0.0.1", family: int = socket.AF_INET) -> bytes:
    return struct.pack("=H", family) + struct.pack("!H", port) + socket.inet_aton(address) + bytes(8)


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (sockaddr_in(8080), 8080),
        (sockaddr_in(1), 1),
        (sockaddr_in(65535), 65535),
        (sockaddr_in(443, "127.0.0.53"), 443),
        (sockaddr_in(80) + b"more", 80),
    ],
)
def test_the_original_port_is_read(raw: bytes, want: int) -> None:
    assert original_port(raw) == want


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"", "0 bytes"),
        (sockaddr_in(80)[: SOCKADDR_IN_LEN - 1], "15 bytes"),
        (sockaddr_in(80, family=socket.AF_INET6), "family 10"),
        (sockaddr_in(80, "10.0.0.5"), "not a loopback"),
        (sockaddr_in(0), "port 0"),
    ],
)
def test_an_original_destination_that_is_not_a_loopback_port_is_refused(raw: bytes, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        original_port(raw)


@pytest.mark.parametrize(
    ("open_now", "closed", "cap", "want"),
    [
        (0, False, MAX_CONNECTIONS_PER_POD, True),
        (MAX_CONNECTIONS_PER_POD - 1, False, MAX_CONNECTIONS_PER_POD, True),
        (MAX_CONNECTIONS_PER_POD, False, MAX_CONNECTIONS_PER_POD, False),
        (0, True, MAX_CONNECTIONS_PER_POD, False),
        (1, False, 1, False),
    ],
)
def test_connections_are_admitted_within_the_cap_while_open(open_now: int, closed: bool, cap: int, want: bool) -> None:
    assert admit(open_now, closed, cap) is want
