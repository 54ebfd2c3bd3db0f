"""Read CDI spec files from the spec directories (the IO edge of ``vmsandbox.cdi``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vmsandbox.cdi import DEFAULT_SPEC_DIRS, SPEC_SUFFIXES, CdiRegistry, build_registry


def load_registry(dirs: Sequence[str | Path] = DEFAULT_SPEC_DIRS) -> CdiRegistry:
    """Read every ``*.json``, ``*.yaml`` and ``*.yml`` spec of ``dirs`` (missing directories are fine)."""
    specs: list[tuple[int, str, Any]] = []
    problems: list[str] = []
    for priority, directory in enumerate(dirs):
        base = Path(directory)
        if not base.is_dir():
            continue
        for path in sorted(base.iterdir()):
            if path.suffix not in SPEC_SUFFIXES or not path.is_file():
                continue
            try:
                text = path.read_text()
                data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            except (OSError, ValueError, yaml.YAMLError) as exc:
                problems.append(f"{path}: cannot read the CDI spec: {exc} (spec skipped)")
                continue
            specs.append((priority, str(path), data))
    registry = build_registry(specs, [str(d) for d in dirs])
    if problems:
        registry = CdiRegistry(registry.devices, (*problems, *registry.problems), registry.dirs)
    return registry
