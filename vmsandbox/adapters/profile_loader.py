"""Load sizing profiles from YAML files (the IO edge of ``profile``).

A file holds one or more YAML documents, each one profile. Errors name the file and, where
YAML can tell, the line of the offending key: ``profiles.yaml:12: vcpu.max: must be ...``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from vmsandbox.profile import Profile, ProfileError, profile_from_mapping


def _key_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, key + "."))
    return lines


def load_profile_file(path: str | Path) -> list[Profile]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(str(path), "(file)", f"cannot read: {exc.strerror}") from None
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ProfileError(where, "(syntax)", str(getattr(exc, "problem", exc))) from None
    profiles = []
    for node, doc in zip(nodes, docs, strict=True):
        if doc is None:
            continue
        lines = _key_lines(node)
        start = node.start_mark.line + 1 if node is not None else 1
        try:
            profiles.append(profile_from_mapping(doc, source=str(path)))
        except ProfileError as exc:
            line = lines.get(exc.key, start)
            raise ProfileError(f"{path}:{line}", exc.key, exc.problem) from None
    return profiles


def load_profiles(paths: Iterable[str | Path]) -> dict[str, Profile]:
    """All profiles by handler name; a handler or a name defined twice is an error naming both files,
    and so is an ``allowed_profiles`` entry that names no profile."""
    by_handler: dict[str, Profile] = {}
    origin: dict[str, str] = {}
    name_origin: dict[str, str] = {}
    for path in paths:
        for profile in load_profile_file(path):
            if profile.handler in by_handler:
                raise ProfileError(
                    str(path), "handler", f"{profile.handler!r} is already defined in {origin[profile.handler]}"
                )
            if profile.name in name_origin:
                raise ProfileError(
                    str(path), "name", f"profile {profile.name!r} is already defined in {name_origin[profile.name]}"
                )
            by_handler[profile.handler] = profile
            origin[profile.handler] = str(path)
            name_origin[profile.name] = str(path)
    for profile in by_handler.values():
        for allowed in profile.allowed_profiles:
            if allowed not in name_origin:
                raise ProfileError(
                    origin[profile.handler],
                    "allowed_profiles",
                    f"profile {profile.name!r} allows {allowed!r}, which is not defined "
                    f"(defined: {', '.join(sorted(name_origin))})",
                )
    return by_handler


def default_profiles(overrides: Mapping[str, Any] | None = None) -> dict[str, Profile]:
    """The built-in ``vmsandbox`` profile, used when no profile file is configured."""
    doc: dict[str, Any] = {"name": "vmsandbox", "handler": "vmsandbox", **(overrides or {})}
    profile = profile_from_mapping(doc, source="(built-in)")
    return {profile.handler: profile}
