"""The network part of RunPodSandbox's request: namespace modes, port mappings and DNS, read and refused;
and the pod's sysctls it keeps for its containers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.model import PodMeta, SandboxRecord
from shim.translate import inbound, outbound
from vmsandbox.errors import InvalidArgument
from vmsandbox.network import (
    POD_FILES,
    DnsConfig,
    GuestNic,
    NamespaceOptions,
    PodNetwork,
    PortMapping,
    Route,
    pod_files,
    resolv_conf,
)


def config(**kw: object) -> pb.PodSandboxConfig:
    c = pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="p", namespace="default", uid="u-1"))
    for key, value in kw.items():
        if key == "namespaces":
            c.linux.security_context.namespace_options.CopyFrom(value)  # type: ignore[arg-type]
        elif key == "ports":
            c.port_mappings.extend(value)  # type: ignore[arg-type]
        elif key == "dns":
            c.dns_config.CopyFrom(value)  # type: ignore[arg-type]
    return c


def test_defaults_are_a_pod_network_with_nothing_mapped() -> None:
    spec = inbound.sandbox_spec(config(), "")
    assert spec.namespaces == NamespaceOptions()
    assert not spec.namespaces.host_network
    assert spec.port_mappings == ()
    assert spec.dns.empty


@pytest.mark.parametrize(
    ("msg", "want"),
    [
        (pb.NamespaceOption(network=pb.NODE), NamespaceOptions(network="NODE")),
        (pb.NamespaceOption(pid=pb.CONTAINER, ipc=pb.NODE), NamespaceOptions(pid="CONTAINER", ipc="NODE")),
        (pb.NamespaceOption(pid=pb.TARGET, target_id="ab12"), NamespaceOptions(pid="TARGET", target_id="ab12")),
    ],
)
def test_namespace_modes_are_read(msg: pb.NamespaceOption, want: NamespaceOptions) -> None:
    assert inbound.sandbox_spec(config(namespaces=msg), "").namespaces == want


def test_ports_and_dns_are_read() -> None:
    spec = inbound.sandbox_spec(
        config(
            ports=[
                pb.PortMapping(protocol=pb.TCP, container_port=80, host_port=8080),
                pb.PortMapping(protocol=pb.UDP, container_port=53, host_port=5353, host_ip="127.0.0.1"),
            ],
            dns=pb.DNSConfig(servers=["10.96.0.10"], searches=["default.svc.cluster.local"], options=["ndots:5"]),
        ),
        "",
    )
    assert spec.port_mappings == (PortMapping("tcp", 80, 8080), PortMapping("udp", 53, 5353, "127.0.0.1"))
    assert spec.dns == DnsConfig(("10.96.0.10",), ("default.svc.cluster.local",), ("ndots:5",))


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"namespaces": pb.NamespaceOption(network=7)}, "network is 7"),  # type: ignore[arg-type]
        ({"namespaces": pb.NamespaceOption(pid=pb.TARGET, target_id="../x")}, "target_id"),
        ({"ports": [pb.PortMapping(protocol=9, container_port=1)]}, "protocol is 9"),  # type: ignore[arg-type]
        ({"ports": [pb.PortMapping(container_port=70000)]}, "container_port is 70000"),
        ({"ports": [pb.PortMapping(container_port=1, host_port=-1)]}, "host_port is -1"),
        ({"ports": [pb.PortMapping(container_port=1, host_ip="localhost")]}, "host_ip"),
        ({"dns": pb.DNSConfig(servers=["dns.example"])}, "not an IP address"),
        ({"dns": pb.DNSConfig(searches=["a b"])}, "white space"),
        ({"dns": pb.DNSConfig(options=[""])}, "empty"),
        ({"dns": pb.DNSConfig(searches=["s"] * 65)}, "65 entries"),
    ],
)
def test_bad_network_requests_are_refused(kw: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        inbound.sandbox_spec(config(**kw), "")


@pytest.mark.parametrize(
    ("dns", "text"),
    [
        (DnsConfig(), ""),
        (DnsConfig(servers=("10.0.0.10", "fd00::a")), "nameserver 10.0.0.10\nnameserver fd00::a\n"),
        (
            DnsConfig(servers=("1.1.1.1",), searches=("a.svc", "svc"), options=("ndots:5", "edns0")),
            "nameserver 1.1.1.1\nsearch a.svc svc\noptions ndots:5 edns0\n",
        ),
    ],
)
def test_resolv_conf(dns: DnsConfig, text: str) -> None:
    assert resolv_conf(dns) == text


macs = st.from_regex(r"\A[0-9a-f]{2}(:[0-9a-f]{2}){5}\Z")
v4 = st.ip_addresses(v=4).map(str)


@given(
    st.one_of(
        st.none(),
        st.builds(
            GuestNic,
            mac=macs,
            addresses=st.lists(v4.map(lambda a: a + "/24"), max_size=3).map(tuple),
            routes=st.lists(st.builds(Route, dst=st.just("0.0.0.0/0"), gw=v4), max_size=2).map(tuple),
            mtu=st.integers(0, 9000),
        ),
    ),
    st.lists(v4, max_size=3).map(tuple),
)
def test_pod_network_survives_its_record(nic: GuestNic | None, ips: tuple[str, ...]) -> None:
    network = PodNetwork(nic=nic, ips=ips)
    assert PodNetwork.from_doc(network.to_doc()) == network


@pytest.mark.parametrize(
    ("namespaces", "network", "ip", "more"),
    [
        (NamespaceOptions(network="NODE"), None, "", []),
        (NamespaceOptions(), PodNetwork(ips=("10.88.0.4", "fd00::4")), "10.88.0.4", ["fd00::4"]),
        (NamespaceOptions(pid="CONTAINER"), PodNetwork(ips=("10.88.0.5",)), "10.88.0.5", []),
    ],
)
def test_status_echoes_the_namespace_modes_and_reports_the_ips(
    namespaces: NamespaceOptions, network: PodNetwork | None, ip: str, more: list[str]
) -> None:
    record = SandboxRecord(
        id="a" * 64,
        meta=PodMeta("p", "default", "u-1"),
        state="SANDBOX_READY",
        created_ns=1,
        runtime_handler="",
        profile="default",
        domain="vmsandbox-" + "a" * 32,
        namespaces=namespaces,
        network=network,
    )
    status = outbound.pod_sandbox_status(record)
    options = status.linux.namespaces.options
    assert (options.network, options.pid, options.ipc) == tuple(
        pb.NamespaceMode.Value(m) for m in (namespaces.network, namespaces.pid, namespaces.ipc)
    )
    assert status.network.ip == ip
    assert [p.ip for p in status.network.additional_ips] == more


@pytest.mark.parametrize(
    ("dns", "hostname", "files"),
    [
        (DnsConfig(), "", {"/etc/resolv.conf": "nameserver 192.0.2.53\n"}),
        (
            DnsConfig(servers=("10.96.0.10",)),
            "web-0",
            {"/etc/resolv.conf": "nameserver 10.96.0.10\n", "/etc/hostname": "web-0\n"},
        ),
    ],
)
def test_pod_files(dns: DnsConfig, hostname: str, files: dict[str, str]) -> None:
    assert pod_files(dns, hostname, "nameserver 192.0.2.53\n") == files
    assert set(files) <= set(POD_FILES)


@pytest.mark.parametrize(
    ("sysctls", "want"),
    [
        ({}, {}),
        ({"kernel.shm_rmid_forced": "1"}, {"kernel.shm_rmid_forced": "1"}),
        ({"fs.mqueue.msg_max": "100", "net.ipv4.ip_forward": "1"},
         {"fs.mqueue.msg_max": "100", "net.ipv4.ip_forward": "1"}),
    ],
)  # fmt: skip
def test_the_pods_sysctls_are_kept_for_its_containers(sysctls: dict[str, str], want: dict[str, str]) -> None:
    """Kept in the pod's record: containerd's tasks (shim mode) carry no pod config to take them from."""
    c = config()
    c.linux.sysctls.update(sysctls)
    assert inbound.sandbox_spec(c, "").sysctls == want
