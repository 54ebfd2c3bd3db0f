"""Input checks match the whole value: ``re.fullmatch``, never a pattern ending in ``$``, which
also matches before a final newline (so ``"eth1\\n"`` passed as an interface name, and
``"sha256:<hex>\\n"`` as an image id). A ``$`` is allowed only with ``re.MULTILINE``, where it
marks line ends inside a searched text."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vmsandbox import cdi, dra, image_ref, registries
from vmsandbox.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]
RE_CALLS = {"compile", "match", "search", "fullmatch"}


def _dollar_patterns(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in RE_CALLS or not (isinstance(node.func.value, ast.Name) and node.func.value.id == "re"):
            continue
        if not node.args or not isinstance(node.args[0], ast.Constant):
            continue
        pattern = node.args[0].value
        text = pattern.decode() if isinstance(pattern, bytes) else str(pattern)
        multiline = any("MULTILINE" in ast.unparse(arg) or ast.unparse(arg) == "re.M" for arg in node.args[1:])
        if text.endswith("$") and not text.endswith("\\$") and not multiline:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:60]}")
    return found


def test_no_pattern_ends_in_dollar() -> None:
    found = [
        hit for d in ("vmsandbox", "shim") for p in sorted((ROOT / d).rglob("*.py")) for hit in _dollar_patterns(p)
    ]
    assert found == [], "use re.fullmatch (or \\Z) instead of a final $:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "check, value",
    [
        (image_ref.parse_reference, "busybox:latest\n"),
        (image_ref.parse_reference, "registry.local:5000\n/busybox"),
        (cdi.parse_qualified_name, "vendor.com/class=dev\n"),
        (cdi.parse_kind, "vendor.com/class\n"),
        (lambda v: dra.parse_network_config({"interfaceName": v}, "config"), "net1\n"),
        (
            lambda v: dra.parse_network(
                {"name": "lan", "kind": "bridge", "interface": v, "subnet": "10.0.0.0/24"}, "n"
            ),
            "br0\n",
        ),
    ],
)
def test_a_final_newline_is_refused(check, value) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises((InvalidArgument, cdi.CdiError, ValueError)):
        check(value)


@pytest.mark.parametrize("host, loopback", [("127.0.0.1:5000", True), ("127.0.0.1\n:5000", False), ("localhost", True)])
def test_loopback_registry_host(host: str, loopback: bool) -> None:
    assert registries.is_loopback(host) is loopback


@pytest.mark.parametrize("text", ["sha256:" + "a" * 64 + "\n", "a" * 64 + "\n"])
def test_an_image_id_with_a_final_newline_is_no_id(text: str) -> None:
    assert image_ref.parse_image_id(text) is None
    assert image_ref.parse_image_id(text.rstrip("\n")) is not None
