"""State names have one home (vmsandbox/states.py): no other module of the product spells one as a
string of its own, so a renamed state cannot leave a copy behind that still compares."""

from __future__ import annotations

import ast
from pathlib import Path

from vmsandbox import states

REPO = Path(__file__).resolve().parents[2]
NAMES = set(states.SANDBOX_STATES) | set(states.CONTAINER_STATES)


def spelled_out(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant in ``source`` that is a state name."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
    ]


def test_no_module_but_states_spells_a_state_name() -> None:
    found = []
    for package in ("vmsandbox", "shim", "bench"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or path == REPO / "vmsandbox" / "states.py":
                continue
            found += [f"{path.relative_to(REPO)}:{line}: {name!r}" for line, name in spelled_out(path.read_text())]
    assert found == []


def test_the_check_finds_a_copy() -> None:
    assert spelled_out('if record.state == "SANDBOX_READY":\n    pass\n') == [(1, "SANDBOX_READY")]
