"""Tests of vmsandbox.cdi: qualified names, spec parsing (JSON and YAML), directory precedence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from vmsandbox.adapters.cdi_specs import load_registry
from vmsandbox.cdi import (
    DEFAULT_SPEC_DIRS,
    CdiDevice,
    CdiError,
    build_registry,
    parse_qualified_name,
    parse_spec,
)

SPEC: dict[str, Any] = {
    "cdiVersion": "0.6.0",
    "kind": "nvidia.com/gpu",
    "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/vfio/12"}]}},
        # hostPath is the node on the host; path is where a container would see it
        {"name": "gpu-af", "containerEdits": {"deviceNodes": [{"path": "/dev/vfio/1", "hostPath": "/dev/vfio/40"}]}},
        {"name": "plain", "containerEdits": {"env": ["A=1"]}},
    ],
    "containerEdits": {"deviceNodes": [{"path": "/dev/vfio/vfio"}]},
}


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        pytest.param("nvidia.com/gpu=0", ("nvidia.com", "gpu", "0"), id="simple"),
        pytest.param("vendor.example.com/fpga-x=card_1.a:b", ("vendor.example.com", "fpga-x", "card_1.a:b"), id="rich"),
    ],
)
def test_parse_qualified_name(name: str, parts: tuple[str, str, str]) -> None:
    assert parse_qualified_name(name) == parts


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("nvidia.com/gpu", id="no-device"),
        pytest.param("gpu=0", id="no-class"),
        pytest.param("nvidia.com/=0", id="empty-class"),
        pytest.param("nvidia.com/gpu=", id="empty-name"),
        pytest.param("nvidia.com/gpu=-0", id="name-starts-badly"),
        pytest.param("/gpu=0", id="empty-vendor"),
        pytest.param("nvidia.com/g/pu=0", id="two-slashes"),
    ],
)
def test_parse_qualified_name_rejects(name: str) -> None:
    with pytest.raises(CdiError):
        parse_qualified_name(name)


def test_parse_spec_takes_device_nodes_host_paths_first() -> None:
    assert parse_spec(SPEC, "/etc/cdi/nvidia.yaml") == (
        CdiDevice("nvidia.com/gpu=0", ("/dev/vfio/12", "/dev/vfio/vfio"), "/etc/cdi/nvidia.yaml"),
        CdiDevice("nvidia.com/gpu=gpu-af", ("/dev/vfio/40", "/dev/vfio/vfio"), "/etc/cdi/nvidia.yaml"),
        CdiDevice("nvidia.com/gpu=plain", ("/dev/vfio/vfio",), "/etc/cdi/nvidia.yaml"),
    )


def _with(**changes: Any) -> dict[str, Any]:
    return {**SPEC, **changes}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param([], "s: a CDI spec must be a mapping", id="not-a-mapping"),
        pytest.param(_with(cdiVersion=""), "s: cdiVersion is missing", id="no-version"),
        pytest.param({k: v for k, v in SPEC.items() if k != "kind"}, "s: kind is missing", id="no-kind"),
        pytest.param(_with(kind="nvidia.com"), "s: kind 'nvidia.com' is not vendor.com/class", id="bad-kind"),
        pytest.param(_with(devices=[]), "s: devices must be a non-empty list", id="no-devices"),
        pytest.param(_with(devices=[{"containerEdits": {}}]), "s: devices[0] needs a name", id="unnamed"),
        pytest.param(_with(devices=[{"name": "a b"}]), "s: devices[0]: device name 'a b' is not valid", id="bad-name"),
        pytest.param(_with(devices=[{"name": "a"}, {"name": "a"}]), "s: device 'a' is defined twice", id="twice"),
        pytest.param(
            _with(containerEdits={"deviceNodes": {"path": "/dev/x"}}),
            "s: containerEdits: containerEdits.deviceNodes must be a list",
            id="nodes-not-a-list",
        ),
        pytest.param(
            _with(devices=[{"name": "a", "containerEdits": {"deviceNodes": [{"path": "dev/vfio/1"}]}}]),
            "s: devices[0] (a): deviceNodes[0] needs an absolute path",
            id="relative-path",
        ),
        pytest.param(
            _with(devices=[{"name": "a", "containerEdits": []}]),
            "s: devices[0] (a): containerEdits must be a mapping",
            id="edits-not-a-mapping",
        ),
    ],
)
def test_parse_spec_rejects(data: Any, message: str) -> None:
    with pytest.raises(CdiError) as exc:
        parse_spec(data, "s")
    assert str(exc.value) == message


def _spec(kind: str, **nodes: str) -> dict[str, Any]:
    return {
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": [{"name": n, "containerEdits": {"deviceNodes": [{"path": p}]}} for n, p in nodes.items()],
    }


def test_registry_later_directory_wins_and_ties_conflict() -> None:
    registry = build_registry(
        [
            (0, "/etc/cdi/a.yaml", _spec("x.com/gpu", a="/dev/vfio/1", b="/dev/vfio/2", c="/dev/vfio/3")),
            (0, "/etc/cdi/b.yaml", _spec("x.com/gpu", b="/dev/vfio/20", d="/dev/vfio/4")),
            (1, "/var/run/cdi/c.json", _spec("x.com/gpu", c="/dev/vfio/30")),
            (0, "/etc/cdi/d.yaml", _spec("x.com/gpu", b="/dev/vfio/21")),  # still conflicting: stays out
            (0, "/etc/cdi/e.yaml", {"cdiVersion": "0.6.0"}),
        ]
    )
    assert {name: dev.node_paths for name, dev in registry.devices.items()} == {
        "x.com/gpu=a": ("/dev/vfio/1",),
        "x.com/gpu=c": ("/dev/vfio/30",),
        "x.com/gpu=d": ("/dev/vfio/4",),
    }
    assert registry.problems == (
        "CDI device x.com/gpu=b is defined by both /etc/cdi/a.yaml and /etc/cdi/b.yaml; left out",
        "/etc/cdi/e.yaml: kind is missing (spec skipped)",
    )
    assert registry.resolve("x.com/gpu=b") is None
    assert registry.dirs == DEFAULT_SPEC_DIRS


def test_load_registry_reads_json_and_yaml(tmp_path: Path) -> None:
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    run.mkdir()
    (etc / "gpu.yaml").write_text(yaml.safe_dump(_spec("x.com/gpu", g0="/dev/vfio/12", g1="/dev/vfio/40")))
    (run / "gpu.json").write_text(json.dumps(_spec("x.com/gpu", g1="/dev/vfio/41")))
    (run / "broken.json").write_text("{not json")
    (run / "README.txt").write_text("not a spec")
    (run / "dir.yaml").mkdir()
    registry = load_registry([etc, run, tmp_path / "missing"])
    assert registry.resolve("x.com/gpu=g0") == CdiDevice("x.com/gpu=g0", ("/dev/vfio/12",), str(etc / "gpu.yaml"))
    assert registry.resolve("x.com/gpu=g1") == CdiDevice("x.com/gpu=g1", ("/dev/vfio/41",), str(run / "gpu.json"))
    assert len(registry.problems) == 1
    assert registry.problems[0].startswith(f"{run / 'broken.json'}: cannot read the CDI spec: ")
    assert registry.dirs == (str(etc), str(run), str(tmp_path / "missing"))


def test_load_registry_without_directories(tmp_path: Path) -> None:
    registry = load_registry([tmp_path / "nothing"])
    assert registry.devices == {} and registry.problems == ()
