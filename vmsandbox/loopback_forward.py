"""The loopback of a pod's network namespace forwarded into its guest (pure): the rules and checks
``shim.loopback_forwards`` applies.

In shim mode containerd serves PortForward itself: it enters the pod's network namespace and dials
``localhost:<port>`` (IPv4 first, IPv6 only when IPv4 fails). The guest is not on that loopback: it
holds the pod's address through a macvtap on the namespace's ``eth0``. So the shim listens on one
TCP port of the namespace's loopback and one nat OUTPUT rule there redirects every TCP connection
to ``127.0.0.1`` to it (``redirect_rule``); the listener reads where each connection was going
(``SO_ORIGINAL_DST``, ``original_port``) and relays it to that port on the guest's own loopback.
Since every IPv4 dial succeeds, containerd never tries IPv6, which therefore needs no rule.
"""

from __future__ import annotations

import ipaddress
import struct

from vmsandbox.errors import InvalidArgument

LOOPBACK = "127.0.0.1"
MAX_CONNECTIONS_PER_POD = 32
"""Connections relayed at once for one pod; more are closed as they come."""
BACKLOG = 16
AF_INET = 2  # linux/socket.h
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h, at level SOL_IP
SOCKADDR_IN_LEN = 16
RULE_COMMENT = "vmsandbox port-forward"


def redirect_rule(listen_port: int) -> tuple[str, ...]:
    """The nat OUTPUT rule (iptables' words after ``-A``/``-I``/``-D``/``-C``) that sends every TCP
    connection to the loopback address to ``listen_port`` there."""
    if not 0 < listen_port < 65536:
        raise InvalidArgument(f"loopback forward: listening port {listen_port} is not a TCP port")
    return (
        "OUTPUT",
        "-o",
        "lo",
        "-p",
        "tcp",
        "-d",
        f"{LOOPBACK}/32",
        "-m",
        "comment",
        "--comment",
        RULE_COMMENT,
        "-j",
        "REDIRECT",
        "--to-ports",
        str(listen_port),
    )


def iptables_argv(action: str, listen_port: int, iptables: str = "/usr/sbin/iptables") -> list[str]:
    """``iptables`` adding (``-I``), checking (``-C``) or deleting (``-D``) the rule in the nat
    table, waiting for the xtables lock rather than failing on it."""
    if action not in ("-I", "-C", "-D"):
        raise InvalidArgument(f"loopback forward: iptables action {action!r} is not -I, -C or -D")
    return [iptables, "-w", "5", "-t", "nat", action, *redirect_rule(listen_port)]


def original_port(raw: bytes) -> int:
    """The port a redirected connection was dialled to, from the ``struct sockaddr_in`` that
    ``getsockopt(SOL_IP, SO_ORIGINAL_DST)`` gave; InvalidArgument unless it is an IPv4 address on
    the loopback and a port other than 0."""
    if len(raw) < SOCKADDR_IN_LEN:
        raise InvalidArgument(f"SO_ORIGINAL_DST: {len(raw)} bytes, not a struct sockaddr_in")
    (family,) = struct.unpack_from("=H", raw, 0)
    if family != AF_INET:
        raise InvalidArgument(f"SO_ORIGINAL_DST: address family {family}, not AF_INET")
    (port,) = struct.unpack_from("!H", raw, 2)
    address = ipaddress.IPv4Address(raw[4:8])
    if not address.is_loopback:
        raise InvalidArgument(f"SO_ORIGINAL_DST: {address} is not a loopback address")
    if port == 0:
        raise InvalidArgument("SO_ORIGINAL_DST: port 0")
    return int(port)


def admit(open_connections: int, closed: bool, cap: int = MAX_CONNECTIONS_PER_POD) -> bool:
    """Whether one more connection of a pod is relayed: not once its forward is closed, nor beyond
    ``cap`` at once."""
    return not closed and open_connections < cap
