"""The VMM memory benchmark boots the shim's own domain, changed in one way per candidate: the
clone of the domain, each candidate's change, and the TCG cache's share read from smaps."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench.vmm_memory import CANDIDATES, clone_xml, tcg_code_kib
from vmsandbox.domain import METADATA_NS

GOLDEN = Path(__file__).parents[1] / "golden"
SHIM_DOMAIN = (GOLDEN / "shared-4k-tcg.xml").read_text()


def _canonical(xml: str) -> str:
    root = ET.fromstring(xml)
    for tag in ("name", "uuid"):
        root.find(tag).text = ""  # type: ignore[union-attr]
    for source in root.iterfind("devices/serial/source"):
        source.set("path", "")
    return ET.tostring(root, encoding="unicode")


def test_the_baseline_is_the_shim_domain_under_another_name(tmp_path: Path) -> None:
    clone = ET.fromstring(clone_xml(SHIM_DOMAIN, "base", tmp_path, None))
    original = ET.fromstring(SHIM_DOMAIN)
    assert clone.findtext("name", "").startswith("vmsandbox-vmmbench-base-")
    assert clone.findtext("uuid") != original.findtext("uuid")
    sandbox = clone.find(f"metadata/{{{METADATA_NS}}}sandbox")
    assert sandbox is not None and sandbox.findtext(f"{{{METADATA_NS}}}owner") == "vmm-bench"
    assert clone.find("devices/serial/source").get("path", "").startswith(str(tmp_path))  # type: ignore[union-attr]
    assert clone.find("devices/channel/source").get("path") is None  # type: ignore[union-attr]
    for tag in ("memory", "vcpu", "os/cmdline", "features", "cpu"):
        assert ET.tostring(clone.find(tag)) == ET.tostring(original.find(tag)), tag  # type: ignore[arg-type]
    assert len(clone.findall("devices/controller")) == len(original.findall("devices/controller"))


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_each_candidate_changes_the_domain(name: str, tmp_path: Path) -> None:
    base = clone_xml(SHIM_DOMAIN, "x", tmp_path, None)
    changed = clone_xml(SHIM_DOMAIN, "x", tmp_path, CANDIDATES[name])
    assert _canonical(changed) != _canonical(base)


SMAPS = """55b2e4d6b000-55b2e66d0000 rw-p 00000000 00:00 0                          [heap]
Anonymous:          5768 kB
7f564b800000-7f564bfff000 rwxp 00000000 00:00 0
Anonymous:          8188 kB
7f564c000000-7f564c200000 rwxp 00000000 00:00 0
Anonymous:          2048 kB
7f5652ea7000-7f5652fef000 r-xp 004a6000 fe:00 15630499                   /usr/lib/x86_64-linux-gnu/libcapstone.so.4
Anonymous:          1312 kB
7f5652ff0000-7f5652fff000 rwxp 00000000 fe:00 15630499                   /usr/lib/x86_64-linux-gnu/libx.so
Anonymous:             4 kB
"""


def test_tcg_code_is_the_anonymous_executable_mappings() -> None:
    assert tcg_code_kib(SMAPS) == 8188 + 2048
