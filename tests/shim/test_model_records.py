"""Tests of shim.model's records: typed values in memory, the same JSON documents in the state database.

A record read back from its stored document equals the record written, for every field, and the
documents that earlier versions of the shim wrote still decode.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shim.model import ContainerRecord, PassedGroup, PodMeta, SandboxRecord
from tests.vmsandbox.test_record_docs import DECLARATION, RESOURCES, SHAPES, declarations
from vmsandbox.network import DnsConfig, GuestNic, NamespaceOptions, PodNetwork, PortMapping, Route
from vmsandbox.sizing import LinuxResources

MI = 1024**2


def via_json(doc: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(json.dumps(doc, sort_keys=True))
    return result


INTS = st.integers(0, 2**40)
LINUX = st.builds(
    LinuxResources,
    cpu_period=INTS,
    cpu_quota=st.integers(-1, 2**40),
    cpu_shares=INTS,
    memory_limit_bytes=INTS,
    hugepage_limits=st.lists(st.tuples(st.sampled_from([2 * MI, 1024 * MI]), INTS), max_size=2).map(tuple),
    cpuset_cpus=st.sampled_from(["", "0", "1-3"]),
)
TEXT = st.text(alphabet="abc-./0123456789", max_size=12)
NETWORKS = st.one_of(
    st.none(),
    st.builds(PodNetwork, nic=st.none(), ips=st.just(())),
    st.builds(
        PodNetwork,
        nic=st.builds(
            GuestNic,
            mac=st.just("02:00:00:00:00:01"),
            addresses=st.just(("10.88.0.5/16",)),
            routes=st.just((Route("0.0.0.0/0", "10.88.0.1"),)),
            mtu=st.integers(0, 9000),
        ),
        ips=st.just(("10.88.0.5",)),
    ),
)
SANDBOXES = st.builds(
    SandboxRecord,
    id=st.just("a" * 64),
    meta=st.builds(PodMeta, name=TEXT, namespace=TEXT, uid=TEXT, attempt=st.integers(0, 9)),
    state=st.sampled_from(["SANDBOX_READY", "SANDBOX_NOTREADY", "creating"]),
    created_ns=INTS,
    runtime_handler=TEXT,
    profile=TEXT,
    domain=TEXT,
    labels=st.dictionaries(TEXT, TEXT, max_size=2),
    annotations=st.dictionaries(TEXT, TEXT, max_size=2),
    hostname=TEXT,
    log_directory=TEXT,
    declaration=st.one_of(st.none(), declarations()),
    shape=st.one_of(st.none(), SHAPES),
    cpus=st.lists(st.integers(0, 255), max_size=4).map(tuple),
    emulator_cpus=st.lists(st.integers(0, 255), max_size=4).map(tuple),
    hugepages=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([2 * MI]), INTS), max_size=2).map(tuple),
    devices=st.lists(
        st.builds(
            PassedGroup,
            pool=TEXT,
            iommu_group=st.integers(0, 99),
            node=st.integers(-1, 3),
            functions=st.just(("0000:01:00.0",)),
        ),
        max_size=2,
    ).map(tuple),
    guest=st.dictionaries(TEXT, st.one_of(TEXT, st.integers(0, 9)), max_size=3),
    accel=st.sampled_from(["", "tcg", "kvm"]),
    boot_ms=INTS,
    linux_overhead=LINUX,
    updated_resources=LINUX,
    namespaces=st.builds(NamespaceOptions, network=st.sampled_from(["POD", "NODE"]), target_id=TEXT),
    port_mappings=st.lists(
        st.builds(PortMapping, protocol=st.sampled_from(["tcp", "udp"]), container_port=st.integers(1, 65535)),
        max_size=2,
    ).map(tuple),
    dns=st.builds(
        DnsConfig, servers=st.lists(TEXT, max_size=2).map(tuple), options=st.lists(TEXT, max_size=2).map(tuple)
    ),
    network=NETWORKS,
    cgroup_parent=TEXT,
    sysctls=st.dictionaries(TEXT, TEXT, max_size=2),
)


@settings(max_examples=100, deadline=None)
@given(SANDBOXES)
def test_sandbox_records_round_trip_through_their_stored_document(record: SandboxRecord) -> None:
    assert SandboxRecord.from_doc(via_json(record.to_doc())) == record


@settings(max_examples=100, deadline=None)
@given(RESOURCES, LINUX, st.integers(-1, 255))
def test_container_records_round_trip_through_their_stored_document(
    resources: Any, linux: LinuxResources, exit_code: int
) -> None:
    record = ContainerRecord(
        "c" * 64, "a" * 64, "app", 1, "CONTAINER_EXITED", 5, resources=resources, linux=linux, exit_code=exit_code
    )
    assert ContainerRecord.from_doc(via_json(record.to_doc())) == record


# a sandbox and a container as the state database held them before records were typed
EARLIER_SANDBOX: dict[str, Any] = {
    "id": "b" * 64,
    "meta": {"name": "web", "namespace": "shop", "uid": "u-1", "attempt": 0},
    "state": "SANDBOX_READY",
    "created_ns": 7,
    "runtime_handler": "vmsandbox",
    "profile": "vmsandbox",
    "domain": "vmsandbox-" + "b" * 32,
    "labels": {},
    "annotations": {},
    "hostname": "web",
    "log_directory": "/var/log/pods/x",
    "declaration": None,
    "shape": {
        "vcpus": 1,
        "memory_bytes": 320 * MI,
        "backing_page_size": 2 * MI,
        "guest_hugepages": [],
        "cpu_policy": "shared",
        "demand": {
            "cpu_millis": 500,
            "memory_bytes": 64 * MI,
            "hugepages": [],
            "ephemeral_storage_bytes": 0,
            "extended": [],
            "mode": "linux-resources",
        },
    },
    "cpus": [0, 1],
    "emulator_cpus": [0, 1],
    "hugepages": [[0, 2 * MI, 160]],
    "devices": [],
    "guest": {"instance": "abc", "vcpus": 1},
    "accel": "tcg",
    "boot_ms": 2100,
    "linux_overhead": {},
    "updated_resources": {
        "cpu_period": 100000,
        "cpu_quota": 50000,
        "cpu_shares": 0,
        "memory_limit_bytes": 64 * MI,
        "hugepage_limits": [],
        "cpuset_cpus": "",
    },
    "namespaces": {"network": "POD", "pid": "POD", "ipc": "POD", "target_id": ""},
    "port_mappings": [{"protocol": "tcp", "container_port": 80, "host_port": 8080, "host_ip": ""}],
    "dns": {"servers": ["10.96.0.10"], "searches": [], "options": []},
    "network": {
        "ips": ["10.88.0.5"],
        "nic": {"mac": "02:00:00:00:00:01", "addresses": ["10.88.0.5/16"], "routes": [], "mtu": 0},
    },
}


def test_documents_of_earlier_versions_still_decode() -> None:
    record = SandboxRecord.from_doc(EARLIER_SANDBOX)
    assert record.shape is not None and record.shape.vcpus == 1 and record.shape.demand.mode == "linux-resources"
    assert record.hugepages == ((0, 2 * MI, 160),) and record.agent_instance == "abc"
    assert record.updated_resources == LinuxResources(cpu_period=100000, cpu_quota=50000, memory_limit_bytes=64 * MI)
    assert record.port_mappings == (PortMapping("tcp", 80, 8080),)
    assert record.network is not None and record.network.ips == ("10.88.0.5",)
    assert record.dns == DnsConfig(servers=("10.96.0.10",))
    # the document written back is the one read, field for field, plus what later versions added
    assert via_json(record.to_doc()) == via_json(
        {
            **EARLIER_SANDBOX,
            "qemu_uid": 0,
            "growth": {"cpu_millis": 0, "memory_bytes": 0},
            "userns": None,
            "cgroup_parent": "",
            "sysctls": {},
        }
    )
    container = ContainerRecord.from_doc(
        {
            "id": "c" * 64,
            "sandbox_id": "b" * 64,
            "name": "app",
            "attempt": 0,
            "state": "CONTAINER_RUNNING",
            "created_ns": 9,
            "resources": {"requests": {"cpu": "500m"}, "limits": {}, "mounts": [], "devices": [], "cdi_devices": []},
            "linux": {
                "cpu_period": 0,
                "cpu_quota": 0,
                "cpu_shares": 2,
                "memory_limit_bytes": 0,
                "hugepage_limits": [[2 * MI, 4 * MI]],
                "cpuset_cpus": "",
            },
            "copy_back": [],
        }
    )
    assert container.resources.requests.as_strings() == {"cpu": "500m"}
    assert container.linux == LinuxResources(cpu_shares=2, hugepage_limits=((2 * MI, 4 * MI),))


def test_a_declared_sandbox_keeps_its_declaration_typed() -> None:
    record = SandboxRecord.from_doc(
        via_json(
            SandboxRecord(
                "d" * 64, PodMeta("p", "n", "u"), "SANDBOX_READY", 1, "", "", "", declaration=DECLARATION
            ).to_doc()
        )
    )
    assert record.declaration == DECLARATION
    assert record.init_container_names == ("init",)
