"""vmsandbox.cni: choosing a network configuration, each plugin's input and environment, and the
ADD result read into the guest's NIC (the CNI specification's formats)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmsandbox.cni import (
    CniError,
    PodArgs,
    bandwidth,
    choose_network,
    error_message,
    parse_config,
    plugin_env,
    plugin_input,
    pod_network,
    runtime_config,
)
from vmsandbox.network import GuestNic, PodNetwork, PortMapping, Route

BRIDGE = {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local"}}
PORTMAP = {"type": "portmap", "capabilities": {"portMappings": True}}


def conflist(**kw: Any) -> str:
    return json.dumps({"cniVersion": "1.0.0", "name": "pods", "plugins": [BRIDGE, PORTMAP], **kw})


@pytest.mark.parametrize(
    ("files", "chosen", "skipped"),
    [
        ([], None, 0),
        ([("10-a.conflist", conflist(name="a")), ("20-b.conflist", conflist(name="b"))], "a", 0),
        ([("20-b.conflist", conflist(name="b")), ("10-a.conflist", conflist(name="a"))], "a", 0),  # lexical order
        ([("05-bad.conflist", "{"), ("10-a.conflist", conflist(name="a"))], "a", 1),
        ([("README", "x"), ("10-a.txt", conflist(name="x"))], None, 0),  # not configuration files
        (
            [("10-single.conf", json.dumps({"cniVersion": "0.4.0", "name": "one", **BRIDGE}))],
            "one",
            0,
        ),
    ],
)
def test_choose_network(files: list[tuple[str, str]], chosen: str | None, skipped: int) -> None:
    network, why = choose_network(files)
    assert (network.name if network else None) == chosen
    assert len(why) == skipped


def test_a_single_plugin_conf_is_a_list_of_one() -> None:
    network = parse_config(json.dumps({"cniVersion": "0.4.0", "name": "one", **BRIDGE}), "10-one.conf")
    assert network.plugins == (BRIDGE,)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[]", "not a JSON object"),
        (json.dumps({"cniVersion": "1.0.0", "plugins": [BRIDGE]}), "name"),
        (json.dumps({"cniVersion": "9.9.9", "name": "n", "plugins": [BRIDGE]}), "cniVersion"),
        (json.dumps({"cniVersion": "1.0.0", "name": "n", "plugins": []}), "non-empty"),
        (json.dumps({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "../../bin/sh"}]}), "not a plugin name"),
        (json.dumps({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "/bin/sh"}]}), "not a plugin name"),
        (json.dumps({"cniVersion": "1.0.0", "name": "n", "plugins": [{}]}), "not a plugin name"),
    ],
)
def test_bad_configurations_are_refused(text: str, words: str) -> None:
    with pytest.raises(CniError, match=words):
        parse_config(text, "f.conflist")


def test_each_plugin_gets_only_the_capabilities_it_declares_and_the_previous_result() -> None:
    network = parse_config(conflist(), "f")
    caps = runtime_config(
        (PortMapping("tcp", 80, 8080), PortMapping("udp", 53, 0)), {"kubernetes.io/ingress-bandwidth": "10M"}
    )
    assert caps == {
        "portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp", "hostIP": ""}],
        "bandwidth": {"ingressRate": 10_000_000, "ingressBurst": 2**31 - 1},
    }
    first = json.loads(plugin_input(network, 0, caps, None))
    assert first == {**BRIDGE, "name": "pods", "cniVersion": "1.0.0"}
    prev = {"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/24"}]}
    second = json.loads(plugin_input(network, 1, caps, prev))
    assert second["runtimeConfig"] == {"portMappings": caps["portMappings"]}
    assert second["prevResult"] == prev


def test_bad_bandwidth_annotation() -> None:
    with pytest.raises(CniError, match="ingress-bandwidth"):
        bandwidth({"kubernetes.io/ingress-bandwidth": "fast"})


def test_plugin_env() -> None:
    env = plugin_env(
        "ADD", PodArgs("ab" * 32, "/run/netns/x", "ns", "web-0", "uid-1"), ["/opt/cni/bin", "/usr/lib/cni"]
    )
    assert env == {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "ab" * 32,
        "CNI_NETNS": "/run/netns/x",
        "CNI_IFNAME": "eth0",
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID={'ab' * 32};"
        "K8S_POD_UID=uid-1",
        "CNI_PATH": "/opt/cni/bin:/usr/lib/cni",
    }


@pytest.mark.parametrize(
    ("stdout", "stderr", "text"),
    [
        (
            b'{"code": 11, "msg": "no IPs left", "details": "range full"}',
            b"",
            "no IPs left: range full (CNI error code 11)",
        ),
        (b"", b"panic: boom\n  at x", "panic: boom at x"),
        (b"", b"", "exit status 1"),
        (b"", b"x" * 5000, "x" * 1023 + "…"),
    ],
)
def test_error_message(stdout: bytes, stderr: bytes, text: str) -> None:
    assert error_message(stdout, stderr, 1) == text


RESULT = {
    "cniVersion": "1.0.0",
    "interfaces": [
        {"name": "cni0", "mac": "aa:aa:aa:aa:aa:aa"},
        {"name": "veth1", "mac": "bb:bb:bb:bb:bb:bb"},
        {"name": "eth0", "mac": "0a:58:0a:00:00:05", "sandbox": "/run/netns/x"},
    ],
    "ips": [
        {"address": "fd00::5/64", "gateway": "fd00::1", "interface": 2},
        {"address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 2},
        {"address": "192.168.9.9/24", "interface": 0},  # the bridge's, not the pod's
    ],
    "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.9"}, {"dst": "10.96.0.0/12"}, {"dst": "::/0"}],
}


def test_the_result_becomes_the_guests_nic_with_ipv4_first() -> None:
    assert pod_network(RESULT, "0a:58:0a:00:00:05", 1450) == PodNetwork(
        nic=GuestNic(
            "0a:58:0a:00:00:05",
            ("10.0.0.5/24", "fd00::5/64"),
            # a route without "gw" goes through its family's gateway, as the plugins configure eth0
            (Route("0.0.0.0/0", "10.0.0.9"), Route("10.96.0.0/12", "10.0.0.1"), Route("::/0", "fd00::1")),
            mtu=1450,
        ),
        ips=("10.0.0.5", "fd00::5"),
    )


def test_a_route_without_gw_stays_on_link_when_no_address_names_a_gateway() -> None:
    result = {"ips": [{"address": "10.0.0.5/24"}], "routes": [{"dst": "0.0.0.0/0"}]}
    assert pod_network(result, "0a:58:0a:00:00:05").nic == GuestNic(
        "0a:58:0a:00:00:05", ("10.0.0.5/24",), (Route("0.0.0.0/0"),)
    )


@pytest.mark.parametrize(
    ("result", "words"),
    [
        ({"ips": []}, "got no IP address"),
        ({"ips": "x"}, "ips is not a list"),
        ({"ips": [{"address": "nope"}]}, "not a CIDR"),
        ({"ips": [{"address": "10.0.0.5/24"}], "routes": [{"dst": "x"}]}, "is not a route"),
        ({"ips": [{"address": "10.0.0.5/24", "gateway": "x"}]}, "is not an address"),
        ({"routes": 5}, "routes is not a list"),
        ({"interfaces": {}}, "interfaces is not a list"),
    ],
)
def test_bad_results_are_refused(result: dict[str, Any], words: str) -> None:
    with pytest.raises(CniError, match=words):
        pod_network(result, "0a:58:0a:00:00:05")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["address", "gateway", "interface", "dst", "gw", "name", "sandbox"]), inner)
    ),
    max_leaves=12,
)


# generating nested JSON is slow on a busy 2-CPU machine: that is not what this test is about
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["ips", "routes", "interfaces", "dns", "cniVersion"]), JSON))
def test_any_result_is_read_or_refused_with_a_cni_error(result: dict[str, object]) -> None:
    with contextlib.suppress(CniError):
        pod_network(result, "0a:58:0a:00:00:05")
