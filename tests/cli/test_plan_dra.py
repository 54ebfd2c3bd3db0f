"""``vmsandbox plan`` of a pod with ResourceClaims: the requests of vmsandbox.dev's class, the
networks that could serve them and their config, from the claim and template manifests beside it."""

from __future__ import annotations

from pathlib import Path

from tests.cli.vmsandbox_cmd import REPO, TWO_SOCKET, vmsandbox, vmsandbox_json

EXAMPLE = REPO / "deploy" / "dra" / "example-pod.yaml"
CONFIG = "dra:\n  networks:\n    - {name: net1, kind: bridge, interface: br1, subnet: 192.168.77.0/24}\n"


def test_plan_shows_the_claimed_network(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(CONFIG)
    code, doc = vmsandbox_json("plan", EXAMPLE, "--config", tmp_path / "config.yaml", "--host-sysfs", TWO_SOCKET)
    assert code == 0
    assert doc["claims"] == [
        {"claim": "net1", "source": "template net1", "request": "net", "device_class": "vmsandbox-network",
         "networks": ["net1"], "interface_name": "net1", "addresses": ["192.168.77.10/24"], "pci_device": None,
         "devices": ["net1"], "matching": ["net1"], "unselected": None, "selector_error": None}
    ]  # fmt: skip
    xml = doc["domain_xml"]  # the claimed NIC: a tap on the network's bridge, named and addressed by /init
    assert '<interface type="bridge">' in xml and '<source bridge="br1" />' in xml, xml
    assert ",net1,192.168.77.10/24" in xml
    text = vmsandbox("plan", EXAMPLE, "--config", tmp_path / "config.yaml", "--host-sysfs", TWO_SOCKET).stdout
    assert "claim      net1 (template net1) request net, class vmsandbox-network: a NIC on one of net1" in text


def test_plan_says_when_the_template_is_missing(tmp_path: Path) -> None:
    pod = EXAMPLE.read_text().split("---\n")[-1]
    (tmp_path / "pod.yaml").write_text(pod)
    code, doc = vmsandbox_json("plan", tmp_path / "pod.yaml", "--host-sysfs", TWO_SOCKET)
    assert code == 0
    assert any("resourceClaims net1: its ResourceClaim or template is not in the manifest" in n for n in doc["notes"])


def test_plan_refuses_a_claim_the_shim_cannot_attach(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "pod.yaml").write_text(EXAMPLE.read_text().replace("192.168.77.10/24", "10.1.0.7/24"))
    code, doc = vmsandbox_json(
        "plan", tmp_path / "pod.yaml", "--config", tmp_path / "config.yaml", "--host-sysfs", TWO_SOCKET
    )
    assert code == 1  # does not fit: as for any refusal
    assert doc["domain_xml"] is None
    reason = doc["refusal"]["reason"]
    assert '"10.1.0.7/24" is not in 192.168.77.0/24' in reason, doc
    assert reason.endswith("(the shim refuses RunPodSandbox)"), doc


def test_plan_of_a_claim_without_static_addresses_says_host_local_gives_them(tmp_path: Path) -> None:
    """host-local runs at NodePrepareResources: the plan has the NIC, named, with no address yet."""
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "pod.yaml").write_text(EXAMPLE.read_text().replace('addresses: ["192.168.77.10/24"]', "addresses: []"))
    args = ("plan", tmp_path / "pod.yaml", "--config", tmp_path / "config.yaml", "--host-sysfs", TWO_SOCKET)
    code, doc = vmsandbox_json(*args)
    assert code == 0, doc
    assert doc["claims"][0]["addresses"] == []
    assert '<source bridge="br1" />' in doc["domain_xml"] and ",net1</cmdline>" in doc["domain_xml"], doc["domain_xml"]
    assert "addresses from host-local at NodePrepareResources" in vmsandbox(*args).stdout
