"""What every benchmark's ``--smoke`` mode shares: the check of its JSON against a shape, and the
prerequisites it names when the host cannot run it.

A benchmark declares the shape of the document it prints beside its code and ends with
``report(doc, SHAPE, smoke=args.smoke)``: the document is printed; in smoke mode (the same
production path, the fewest runs that still give every figure) it is then read back from its JSON
and checked, and the process exits with status 1 and one line per problem on stderr, each naming
the key and what is wrong with it. ``tests/integration/test_bench_smoke.py`` runs every benchmark so.

A shape is a dict of exactly the document's keys (a missing key and an unexpected one are both
problems); a leaf is a ``Kind`` (``POSITIVE``, ``FINITE``, ``BOOL``, ...) or a literal the value must
equal; ``Each(shape)`` is a non-empty list of values of one shape, ``Keyed(shape)`` a non-empty dict
whose keys the benchmark chooses, each value of one shape, ``Maybe(shape)`` null or a value of it.

``require(...)`` exits with status 77 (``SKIPPED``) and a message naming what is missing, so a
host without QEMU, libvirt or the image tools is told so instead of shown a traceback; the smoke
test skips on that status where the integration tests skip, and fails under CI.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SKIPPED = 77  # the exit status of a benchmark the host cannot run (automake's "skipped")
REPO = Path(__file__).resolve().parents[1]
FAILED = 1


@dataclass(frozen=True)
class Kind:
    """A kind of leaf value: ``what`` names it in a problem, ``accepts`` decides."""

    what: str
    accepts: Callable[[object], bool]


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


POSITIVE = Kind("a finite number > 0", lambda v: _number(v) and v > 0)  # type: ignore[operator]
NON_NEGATIVE = Kind("a finite number >= 0", lambda v: _number(v) and v >= 0)  # type: ignore[operator]
FINITE = Kind("a finite number", _number)  # a difference, which noise can make negative
PERCENT = Kind("a percentage from 0 to 100", lambda v: _number(v) and 0 <= v <= 100)  # type: ignore[operator]
COUNT = Kind("an integer >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
TEXT = Kind("a non-empty string", lambda v: isinstance(v, str) and v != "")


@dataclass(frozen=True)
class Each:
    """A non-empty list (of exactly ``length`` items if given), every item of ``shape``."""

    shape: Any
    length: int | None = None


@dataclass(frozen=True)
class Maybe:
    """null, or a value of ``shape`` (a figure a host may not have, e.g. a TCG cache size under KVM)."""

    shape: Any


@dataclass(frozen=True)
class Keyed:
    """A non-empty dict with keys the benchmark chooses (exactly ``keys`` if given), every value of ``shape``."""

    shape: Any
    keys: frozenset[str] | None = None


def _shown(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def problems(value: object, shape: Any, path: str = "") -> list[str]:
    """What is wrong with ``value`` against ``shape``: one line per problem, naming its key path."""
    where = path or "the document"
    if isinstance(shape, Kind):
        return [] if shape.accepts(value) else [f"{where}: expected {shape.what}, got {_shown(value)}"]
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {_shown(value)}"]
        out = [f"{_join(path, k)}: missing" for k in shape if k not in value]
        out += [f"{_join(path, k)}: unexpected key (not in the benchmark's shape)" for k in value if k not in shape]
        for k, sub in shape.items():
            if k in value:
                out += problems(value[k], sub, _join(path, k))
        return out
    if isinstance(shape, Each):
        if not isinstance(value, list) or not value:
            return [f"{where}: expected a non-empty list, got {_shown(value)}"]
        out = []
        if shape.length is not None and len(value) != shape.length:
            out.append(f"{where}: expected {shape.length} items, got {len(value)}")
        for i, item in enumerate(value):
            out += problems(item, shape.shape, f"{path}[{i}]")
        return out
    if isinstance(shape, Maybe):
        return [] if value is None else problems(value, shape.shape, path)
    if isinstance(shape, Keyed):
        if not isinstance(value, dict) or not value:
            return [f"{where}: expected a non-empty object, got {_shown(value)}"]
        out = []
        if shape.keys is not None and set(value) != shape.keys:
            out.append(f"{where}: expected the keys {sorted(shape.keys)}, got {sorted(value)}")
        for k, item in value.items():
            out += problems(item, shape.shape, _join(path, k))
        return out
    if type(value) is not type(shape) or value != shape:
        return [f"{where}: expected {_shown(shape)}, got {_shown(value)}"]
    return []


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def report(
    doc: dict[str, Any],
    shape: dict[str, Any],
    *,
    smoke: bool,
    invariants: Callable[[dict[str, Any]], list[str]] | None = None,
) -> None:
    """Print ``doc`` as JSON; in smoke mode check what was printed against ``shape`` (and the
    benchmark's own ``invariants``, run only on a document of the right shape) and exit 1 naming
    every problem."""
    text = json.dumps(doc, indent=2)
    print(text, flush=True)
    if not smoke:
        return
    printed = json.loads(text)  # what a reader of the output gets (NaN and Infinity included)
    found = problems(printed, shape)
    if not found and invariants is not None:
        found = invariants(printed)
    if found:
        lines = "\n".join(f"  - {p}" for p in found[:50])
        more = f"\n  ... and {len(found) - 50} more" if len(found) > 50 else ""
        print(f"{_script()} --smoke: the JSON is not what the benchmark promises:\n{lines}{more}", file=sys.stderr)
        raise SystemExit(FAILED)


# -- prerequisites -------------------------------------------------------------------------------------
def require(*missing: Iterable[str]) -> None:
    """Exit with ``SKIPPED`` and say what is missing (each argument: a list from a ``missing_*`` below)."""
    found = [m for group in missing for m in group]
    if found:
        print(f"{_script()}: this host cannot run it: {'; '.join(found)}", file=sys.stderr)
        raise SystemExit(SKIPPED)


def missing_tools(*names: str) -> list[str]:
    return [f"{n} (not on PATH; scripts/setup-host.sh installs it)" for n in names if shutil.which(n) is None]


def missing_files(*paths: str | Path) -> list[str]:
    return [f"{p} (scripts/setup-host.sh installs it)" for p in paths if not Path(p).exists()]


def missing_guest_host() -> list[str]:
    """What booting the shim's guests needs (the integration tests' check): the guest image,
    libvirt, free hugepages."""
    from tests.shim_kit import missing_prerequisites

    return [f"{m} (run scripts/setup-host.sh)" for m in missing_prerequisites()]


def missing_image_tools() -> list[str]:
    """What ``tests/registry_kit.py``'s local registry and images need."""
    return missing_tools("docker-registry", "skopeo") + missing_files("/bin/busybox")


def missing_guest_image(image_dir: str | Path) -> list[str]:
    return missing_files(*(Path(image_dir) / f for f in ("vmlinux", "initramfs.img")))


def _script() -> str:
    argv0 = Path(sys.argv[0]).resolve()
    try:
        return str(argv0.relative_to(REPO))
    except ValueError:
        return os.path.basename(sys.argv[0])
