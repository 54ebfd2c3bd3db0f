"""The shim configuration's ``dra`` key: off by default, parsed by vmsandbox.dra."""

from __future__ import annotations

import pytest

from shim.config import config_from_mapping
from vmsandbox.dra import DraConfig, NetworkAttachment
from vmsandbox.errors import InvalidArgument


def test_off_by_default() -> None:
    assert config_from_mapping({}, "c.yaml").dra == DraConfig()
    assert not config_from_mapping({}, "c.yaml").dra.enabled


def test_parsed() -> None:
    config = config_from_mapping(
        {"dra": {"kubeconfig": "/etc/vmsandbox/dra.kubeconfig",
                 "networks": [{"name": "lan", "kind": "bridge", "interface": "br0", "subnet": "10.1.0.0/24"}]}},
        "c.yaml",
    )  # fmt: skip
    assert config.dra.enabled
    assert config.dra.networks == (NetworkAttachment("lan", "bridge", "br0", "10.1.0.0/24"),)


def test_refused_naming_the_key() -> None:
    with pytest.raises(InvalidArgument, match=r"c.yaml: dra.networks\[0\].kind"):
        config_from_mapping(
            {"dra": {"networks": [{"name": "a", "kind": "x", "interface": "b", "subnet": "c"}]}}, "c.yaml"
        )
