"""Human output for the admin commands: sizes, page sizes, ages and aligned tables (pure)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vmsandbox.quantity import format_quantity


def size(nbytes: int) -> str:
    """Bytes as a Kubernetes binary quantity: 301989888 -> '288Mi'."""
    return format_quantity(nbytes, "BinarySI")


def page_label(page_size: int) -> str:
    """4096 -> '4Ki', 2097152 -> '2Mi', 1073741824 -> '1Gi'."""
    return size(page_size)


def plural(count: int, word: str) -> str:
    """``plural(1, "vCPU")`` -> '1 vCPU', ``plural(2, "vCPU")`` -> '2 vCPUs'."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def age(seconds: float) -> str:
    """Like kubectl: 42s, 5m, 3h, 2d."""
    s = max(int(seconds), 0)
    if s < 120:
        return f"{s}s"
    if s < 2 * 3600:
        return f"{s // 60}m"
    if s < 2 * 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart, no trailing blanks."""
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    lines = []
    for r in (header, *rows):
        cells = [str(c).ljust(w) for c, w in zip(r, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def fields(pairs: Sequence[tuple[str, str]], indent: str = "", width: int = 0) -> str:
    """``key  value`` lines with the keys padded to one width (at least ``width``)."""
    width = max([width, *(len(k) for k, _ in pairs)])
    return "\n".join(f"{indent}{k.ljust(width)}  {v}".rstrip() for k, v in pairs)


def to_json(doc: Any) -> str:
    return json.dumps(doc, indent=2, sort_keys=True)
