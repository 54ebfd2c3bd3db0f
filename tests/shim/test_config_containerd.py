"""The shim-mode keys of vmsandbox's configuration: defaults, and bounds refused with the key named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shim.config import load_config
from vmsandbox.errors import InvalidArgument


def load(tmp_path: Path, doc: dict[str, object]) -> object:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_config(str(path))


def test_defaults(tmp_path: Path) -> None:
    config = load_config(None)
    assert config.containerd_address == "" and config.containerd_image_prune_s == 300
    assert load(tmp_path, {"containerd_image_prune_s": 0}).containerd_image_prune_s == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [-1, 86401, "5", True, 1.5])
def test_prune_interval_out_of_bounds_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(InvalidArgument, match="containerd_image_prune_s: must be a number of seconds"):
        load(tmp_path, {"containerd_image_prune_s": value})
