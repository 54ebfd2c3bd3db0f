"""Image references as the kubelet and crictl write them, normalised as containerd and Docker do. Pure.

``busybox`` is ``docker.io/library/busybox:latest``; ``quay.io/a/b@sha256:…`` is pinned by digest;
``name:tag@digest`` keeps both and is fetched by the digest. The grammar is the one of the
distribution reference format (lower-case path components separated by ``.``, ``_``, ``__`` or
dashes; a domain when the first component has a dot or a port or is ``localhost``). Image ids
(``sha256:`` + 64 hex, or the bare 64 hex) are recognised separately by ``parse_image_id``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vmsandbox.errors import InvalidArgument

DEFAULT_DOMAIN = "docker.io"
LEGACY_DOMAINS = frozenset({"index.docker.io", "registry-1.docker.io"})
OFFICIAL_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MAX_NAME = 255  # the distribution spec's limit on the repository name, domain included
MAX_INPUT = 1024  # longest reference text we read at all (echoed back bounded too)

_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_DOMAIN_LABEL = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(rf"{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})*(?::[0-9]{{1,5}})?|\[[0-9a-fA-F:.]+\](?::[0-9]{{1,5}})?")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
_ANY_DIGEST = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]+")
_HEX64 = re.compile(r"[a-f0-9]{64}")


def bounded(text: str, limit: int = 128) -> str:
    """``text`` as it may be echoed in an error message: repr'd and cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "…"


@dataclass(frozen=True, order=True)
class ImageReference:
    """A normalised reference: ``domain/path[:tag][@digest]`` with at least one of tag and digest."""

    domain: str
    path: str
    tag: str = ""
    digest: str = ""

    @property
    def name(self) -> str:
        """``docker.io/library/busybox``: what repo tags and repo digests start with."""
        return f"{self.domain}/{self.path}"

    def __str__(self) -> str:
        out = self.name
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out

    @property
    def tagged(self) -> str:
        """``name:tag`` (empty when the reference has no tag)."""
        return f"{self.name}:{self.tag}" if self.tag else ""

    def with_digest(self, digest: str) -> str:
        """``name@digest``: a repo digest."""
        return f"{self.name}@{digest}"

    @property
    def fetch_by(self) -> str:
        """What to ask the registry for: the digest when pinned, else the tag."""
        return self.digest or self.tag


def parse_image_id(text: str) -> str | None:
    """``sha256:<64 hex>`` or the bare 64 hex -> ``sha256:<hex>``; anything else -> None."""
    if _DIGEST.fullmatch(text):
        return text
    if _HEX64.fullmatch(text):
        return f"sha256:{text}"
    return None


def _split_domain(name: str) -> tuple[str, str]:
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        domain, path = first, rest
    elif sep and first != first.lower():
        raise InvalidArgument(f"image reference {bounded(name)}: repository names must be lower case")
    else:
        domain, path = DEFAULT_DOMAIN, name
    if domain in LEGACY_DOMAINS:
        domain = DEFAULT_DOMAIN
    if domain == DEFAULT_DOMAIN and "/" not in path:
        path = f"{OFFICIAL_NAMESPACE}/{path}"
    return domain, path


def parse_reference(text: str) -> ImageReference:
    """Parse and normalise ``text``; raises ``InvalidArgument`` saying what is wrong."""
    if not text:
        raise InvalidArgument("image reference is empty")
    if len(text) > MAX_INPUT:
        raise InvalidArgument(f"image reference {bounded(text)} is longer than {MAX_INPUT} characters")
    if text != text.strip() or any(c.isspace() for c in text):
        raise InvalidArgument(f"image reference {bounded(text)} contains white space")
    if parse_image_id(text) is not None:
        raise InvalidArgument(f"{bounded(text)} is an image id, not a reference a registry can serve")
    remainder, at, digest = text.partition("@")
    if at:
        if not _ANY_DIGEST.fullmatch(digest):
            raise InvalidArgument(f"image reference {bounded(text)}: {bounded(digest)} is not a digest")
        if not _DIGEST.fullmatch(digest):
            raise InvalidArgument(
                f"image reference {bounded(text)}: only sha256 digests (64 lower-case hex) are supported"
            )
    name, tag = remainder, ""
    colon = remainder.rfind(":")
    if colon > remainder.rfind("/"):
        name, tag = remainder[:colon], remainder[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise InvalidArgument(f"image reference {bounded(text)}: {bounded(tag)} is not a valid tag")
    if not name:
        raise InvalidArgument(f"image reference {bounded(text)} has no repository name")
    domain, path = _split_domain(name)
    if not _DOMAIN.fullmatch(domain):
        raise InvalidArgument(f"image reference {bounded(text)}: {bounded(domain)} is not a registry host[:port]")
    for component in path.split("/"):
        if not _COMPONENT.fullmatch(component):
            what = "is empty" if not component else "must be lower-case letters and digits separated by . _ __ or -"
            raise InvalidArgument(f"image reference {bounded(text)}: path component {bounded(component)} {what}")
    if len(domain) + 1 + len(path) > MAX_NAME:
        raise InvalidArgument(f"image reference {bounded(text)}: repository name longer than {MAX_NAME} characters")
    if not tag and not digest:
        tag = DEFAULT_TAG
    return ImageReference(domain=domain, path=path, tag=tag, digest=digest)
