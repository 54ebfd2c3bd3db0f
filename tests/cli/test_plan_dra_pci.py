"""``vmsandbox plan`` of a pod claiming a PCI passthrough device (``deploy/dra/example-pci-pod.yaml``)
on the vfio-two-node fixture host: the device the request would get, the placement aligned with it
and its ``<hostdev>``s in the domain XML; a request no free device is left for is refused."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.cli.vmsandbox_cmd import HERE, REPO, VFIO_HOST, vmsandbox, vmsandbox_json
from vmsandbox.adapters.ledger import Ledger
from vmsandbox.claims import Claim

EXAMPLE = REPO / "deploy" / "dra" / "example-pci-pod.yaml"


def config(tmp_path: Path, **dra: object) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "device_pools": {"a100": ["10de:2330", "10de:22a3"]},
                "profile_files": [str(HERE / "profiles.yaml")],
                "dra": {"pci_pools": ["a100"], **dra},
            }
        )
    )
    return path


def test_plan_shows_the_claimed_device_and_its_hostdevs(tmp_path: Path) -> None:
    code, doc = vmsandbox_json("plan", EXAMPLE, "--config", config(tmp_path), "--host-sysfs", VFIO_HOST)
    assert code == 0, doc
    assert doc["claims"] == [
        {"claim": "gpu", "source": "template gpu", "request": "gpu", "device_class": "vmsandbox-pci",
         "networks": [], "interface_name": "", "addresses": [], "pci_device": "pci-0000-3b-00-0",
         "devices": ["pci-0000-3b-00-0"], "matching": ["pci-0000-3b-00-0", "pci-0000-af-00-0", "pci-0000-d8-00-0"],
         "unselected": None, "selector_error": None}
    ]  # fmt: skip
    assert doc["placement"]["devices"] == [
        {"pool": "a100", "iommu_group": 12, "node": 0, "functions": ["0000:3b:00.0", "0000:3b:00.1"]}
    ]
    assert doc["placement"]["nodes"] == [0]  # the GPU's node
    xml = doc["domain_xml"]
    assert xml.count("<hostdev ") == 2 and 'bus="0x3b"' in xml, xml
    text = vmsandbox("plan", EXAMPLE, "--config", config(tmp_path), "--host-sysfs", VFIO_HOST).stdout
    assert "claim      gpu (template gpu) request gpu, class vmsandbox-pci: passthrough device pci-0000-3b-00-0" in text


def test_plan_skips_devices_a_running_shim_holds_and_refuses_when_none_is_free(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    ledger = Ledger(state / "state.db")
    ledger.claim("a" * 64, Claim(pci=("0000:3b:00.0", "0000:3b:00.1")), page_limits={}, memory_limits={})
    ledger.close()
    args = ("plan", EXAMPLE, "--config", config(tmp_path), "--host-sysfs", VFIO_HOST, "--state-dir", state)
    code, doc = vmsandbox_json(*args)
    assert code == 0, doc
    assert doc["claims"][0]["pci_device"] == "pci-0000-af-00-0"
    assert doc["claims"][0]["devices"] == ["pci-0000-af-00-0"]  # not the first match, which is held
    assert doc["placement"]["nodes"] == [1]
    ledger = Ledger(state / "state.db")
    ledger.claim(
        "b" * 64, Claim(pci=("0000:af:00.0", "0000:af:00.1", "0000:d8:00.0")), page_limits={}, memory_limits={}
    )
    ledger.close()
    code, doc = vmsandbox_json(*args)
    assert code == 1 and doc["domain_xml"] is None
    assert doc["refusal"]["reason"].startswith("resourceClaims gpu request gpu: no free passthrough device"), doc


def test_plan_without_pci_pools_shows_no_device(tmp_path: Path) -> None:
    path = config(tmp_path)
    path.write_text(path.read_text().replace("pci_pools:\n  - a100", "pci_pools: []"))
    code, doc = vmsandbox_json("plan", EXAMPLE, "--config", path, "--host-sysfs", VFIO_HOST)
    assert code == 1
    assert "no free passthrough device on this node (published: none)" in doc["refusal"]["reason"]
