"""The layout is the architecture: modules directly under ``vmsandbox`` are the pure core and import
no IO (files, sockets, processes, databases, libvirt, YAML, gRPC); the IO edge lives in
``vmsandbox.adapters``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "vmsandbox"
IO_MODULES = {
    "os",
    "io",
    "pathlib",
    "shutil",
    "socket",
    "select",
    "subprocess",
    "sqlite3",
    "threading",
    "time",
    "yaml",
    "libvirt",
    "grpc",
    "google",
    "shim",
    "vmsandbox.adapters",
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", sorted(p.name for p in CORE.glob("*.py")))
def test_core_module_imports_no_io(module: str) -> None:
    bad = {
        name for name in _imports(CORE / module) if any(name == io or name.startswith(io + ".") for io in IO_MODULES)
    }
    assert not bad, f"vmsandbox/{module} is part of the pure core but imports {sorted(bad)}"


SHIM = CORE.parent / "shim"


@pytest.mark.parametrize("module", sorted(p.name for p in SHIM.glob("*.py") if p.name != "__main__.py"))
def test_the_server_does_not_depend_on_the_admin_tools(module: str) -> None:
    # cli/ (the vmsandbox command, plan, validate, inspect, the demo) uses the server's
    # modules; the server never imports the tools
    bad = {name for name in _imports(SHIM / module) if name == "cli" or name.startswith("cli.")}
    assert not bad, f"shim/{module} is part of the server but imports {sorted(bad)}"


def test_metrics_do_not_import_the_sandboxes_owner() -> None:
    # Sandboxes counts its events in shim.metrics; the collector is given what it reads
    assert "shim.sandboxes" not in _imports(SHIM / "metrics.py")
