"""``vmsandbox plan`` evaluates the DRA CEL selectors of a pod's claims (the DeviceClass's and the
request's) over the devices this node's vmsandbox publishes: the devices each request would get, in
text and JSON, and a selector that fails as a refusal naming the claim, request and expression."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cli.test_plan_dra_pci import config as pci_config
from tests.cli.vmsandbox_cmd import REPO, TWO_SOCKET, VFIO_HOST, vmsandbox, vmsandbox_json

NET_POD = REPO / "deploy" / "dra" / "example-pod.yaml"
PCI_POD = REPO / "deploy" / "dra" / "example-pci-pod.yaml"
CONFIG = """dra:
  networks:
    - {name: lan, kind: bridge, interface: br1, subnet: 192.168.77.0/24}
    - {name: fast, kind: macvlan, interface: eth1, subnet: 192.168.77.0/24}
"""
A = 'device.attributes["vmsandbox.dev"]'


def pod_with(tmp_path: Path, example: Path, selector: str, **request: object) -> Path:
    """The example pod with ``selector`` (and ``request``'s fields) on its one request."""
    docs = list(yaml.safe_load_all(example.read_text()))
    exactly = docs[0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    exactly.update(request)
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def plan_net(tmp_path: Path, selector: str, **request: object) -> tuple[int, dict[str, Any], str]:
    (tmp_path / "config.yaml").write_text(CONFIG)
    args = ("plan", pod_with(tmp_path, NET_POD, selector, **request), "--config", tmp_path / "config.yaml")
    code, doc = vmsandbox_json(*args, "--host-sysfs", TWO_SOCKET)
    return code, doc, vmsandbox(*args, "--host-sysfs", TWO_SOCKET).stdout


@pytest.mark.parametrize(
    ("selector", "network", "xml"),
    [
        ("", "lan", '<source bridge="br1" />'),  # the class alone: both match, the first published is taken
        (f'{A}.kind == "macvlan"', "fast", '<source dev="eth1" mode="bridge" />'),
        (f'{A}.interface == "br1"', "lan", '<source bridge="br1" />'),
    ],
)
def test_a_request_selector_picks_the_network(tmp_path: Path, selector: str, network: str, xml: str) -> None:
    code, doc, text = plan_net(tmp_path, selector)
    assert code == 0, doc
    (claim,) = doc["claims"]
    assert claim["devices"] == [network] and claim["networks"] == [network]
    assert claim["matching"] == (["lan", "fast"] if not selector else [network])
    assert claim["selector_error"] is None and claim["unselected"] is None
    assert xml in str(doc["domain_xml"]), doc["domain_xml"]
    assert f"(plan: {network}), interface net1" in text


def test_a_request_no_network_matches_is_refused(tmp_path: Path) -> None:
    code, doc, text = plan_net(tmp_path, f'{A}.subnet == "10.0.0.0/8"')
    assert code == 1 and doc["domain_xml"] is None
    assert doc["refusal"]["reason"] == (
        "resourceClaims net1 request net: no vmsandbox.dev device of this node matches (published: lan, fast)"
        " (the scheduler allocates the claim no devices on this node)"
    )
    assert "request net, class vmsandbox-network: no vmsandbox.dev device of this node matches" in text


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        (f"{A}.kind ==", 'request selector 0 "device.attributes[\\"vmsandbox.dev\\"].kind ==": does not compile'),
        (f'{A}.vendor == "10de"', "device lan: no such member in mapping: 'vendor'"),
        (f"{A}.kind", "device lan: the result is StringType, not a bool"),
        ("true || " * 1300 + "true", "characters, more than the API's 10240"),
    ],
)
def test_a_selector_that_fails_is_refused_by_claim_request_and_expression(
    tmp_path: Path, selector: str, message: str
) -> None:
    code, doc, text = plan_net(tmp_path, selector)
    assert code == 1 and doc["domain_xml"] is None
    reason = doc["refusal"]["reason"]
    assert reason.startswith("resourceClaims net1 request net: request selector 0 "), reason
    assert message in reason and reason.endswith("(the scheduler allocates the claim no devices on this node)")
    assert len(reason) < 700  # a long expression is quoted in part
    (claim,) = doc["claims"]
    assert message in claim["selector_error"]
    assert "does not fit: resourceClaims net1 request net: request selector 0" in text


def test_count_and_all_give_that_many_networks(tmp_path: Path) -> None:
    code, doc, _ = plan_net(tmp_path, "", allocationMode="All")
    (claim,) = doc["claims"]
    assert claim["devices"] == ["lan", "fast"] and claim["networks"] == ["lan", "fast"]
    code, doc, _ = plan_net(tmp_path, "", count=3)
    assert code == 1
    assert "asks for 3, 2 of this node's vmsandbox.dev devices match" in doc["refusal"]["reason"]


@pytest.mark.parametrize(
    ("selector", "device", "node"),
    [
        ('device.attributes["resource.kubernetes.io"].pciBusID == "0000:af:00.0"', "pci-0000-af-00-0", 1),
        (f'{A}.vendor == "10de" && {A}.deviceID == "2330" && {A}.functions == 1', "pci-0000-d8-00-0", 1),
        (f'{A}.vendor == "10de"', "pci-0000-3b-00-0", 0),
    ],
)
def test_a_pci_selector_picks_the_device_and_the_placement_follows(
    tmp_path: Path, selector: str, device: str, node: int
) -> None:
    pod = pod_with(tmp_path, PCI_POD, selector)
    code, doc = vmsandbox_json("plan", pod, "--config", pci_config(tmp_path), "--host-sysfs", VFIO_HOST)
    assert code == 0, doc
    (claim,) = doc["claims"]
    assert claim["pci_device"] == device and claim["devices"] == [device]
    assert doc["placement"]["nodes"] == [node]


def test_a_pci_selector_no_device_matches_is_refused(tmp_path: Path) -> None:
    pod = pod_with(tmp_path, PCI_POD, f'{A}.vendor == "8086"')
    code, doc = vmsandbox_json("plan", pod, "--config", pci_config(tmp_path), "--host-sysfs", VFIO_HOST)
    assert code == 1
    assert doc["refusal"]["reason"] == (
        "resourceClaims gpu request gpu: no free passthrough device on this node "
        "(published: pci-0000-3b-00-0, pci-0000-af-00-0, pci-0000-d8-00-0); its selectors match: none"
    )
