"""The documentation stays a front door and true to the tree: README.md is at most 150 lines, every
relative link in README.md and docs/*.md reaches a file (and, into a Markdown file, a heading) that
exists, and every path docs/layout.md names in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
LAYOUT = DOCS / "layout.md"
README_MAX_LINES = 150

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\n]|\n(?!\n))*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, file: ...
BACKTICKED = re.compile(r"`([^`\n]+)`")
#: a backticked token that is a path: no spaces, no placeholders, and a slash or a file name of the tree
PATH_LIKE = re.compile(r"^\.?[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_.\-]+)*/?$")
#: a list item naming a top-level entry: "- `name`: what it is"
TOP_LEVEL_ITEM = re.compile(r"^- `([^`]+)`:", re.MULTILINE)


def documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where a ``[x](y)`` is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading counts as its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into docs/ and link it"
    )


def test_docs_exist_and_each_has_a_title() -> None:
    found = sorted(DOCS.glob("*.md"))
    assert found, "docs/ holds no Markdown file"
    untitled = [p.name for p in found if not p.read_text().startswith("# ")]
    assert untitled == [], f"docs without a '# Title' first line: {untitled}"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_what_exists(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: {dest.relative_to(REPO)} has no heading with the anchor #{anchor}")
    assert broken == [], f"{doc.relative_to(REPO)}: broken links:\n" + "\n".join(broken)


def test_readme_links_every_doc() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README) if not EXTERNAL.match(t)}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert unlinked == [], f"docs the README does not link: {unlinked}"


def test_layout_names_top_level_entries() -> None:
    top = TOP_LEVEL_ITEM.findall(LAYOUT.read_text())
    assert {"vmsandbox/", "shim/", "tests/"} <= set(top), f"docs/layout.md lists no top-level tree: {top}"


#: what is in the checkout but not of the project: caches, virtual environments, build output
NOT_OURS = re.compile(r"^(\.(?!ci$).*|__pycache__|.*\.egg-info|build)$")


def test_layout_names_every_top_level_entry_and_package() -> None:
    """The layout matches the tree: each top-level file and directory is a list item of its own, and
    each Python package of the code and the tests is named with its path."""
    text = LAYOUT.read_text()
    items = {i.rstrip("/").split("/")[0] for i in TOP_LEVEL_ITEM.findall(text)}
    unlisted = sorted(p.name for p in REPO.iterdir() if not NOT_OURS.match(p.name) and p.name not in items)
    assert unlisted == [], f"docs/layout.md has no item for these top-level entries: {unlisted}"
    named = set(BACKTICKED.findall(text))
    packages = sorted(
        str(init.parent.relative_to(REPO)) + "/"
        for top in ("vmsandbox", "shim", "cli", "gen", "tests", "bench")
        for init in (REPO / top).rglob("__init__.py")
        if init.parent != REPO / top
        and not any(NOT_OURS.match(part) for part in init.relative_to(REPO).parts)
        and not (top == "gen" and len(init.relative_to(REPO).parts) > 3)  # generated code's own tree
    )
    missing = [p for p in packages if p not in named]
    assert missing == [], f"docs/layout.md does not name these packages: {missing}"


def test_every_path_in_the_layout_exists() -> None:
    text = LAYOUT.read_text()
    paths = set(TOP_LEVEL_ITEM.findall(text))
    paths |= {p for p in BACKTICKED.findall(text) if PATH_LIKE.match(p) and ("/" in p or "." in p.lstrip("."))}
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == [], f"docs/layout.md names paths that do not exist: {missing}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Two commands", "two-commands"),
        ("Kubernetes and containerd for the one-node cluster", "kubernetes-and-containerd-for-the-one-node-cluster"),
        ("`Exec` and `Attach`", "exec-and-attach"),
        ("The CRI proxy's front", "the-cri-proxys-front"),
    ],
)
def test_slug_is_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
