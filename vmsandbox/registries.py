"""Registry configuration the way ``containers-registries.conf(5)`` writes it, and where to pull from. Pure.

A ``registries`` list in the shim's config holds entries of ``prefix`` (a host, or host/namespace),
optional ``location`` (rewrites the prefix), ``insecure`` (plain HTTP or unverified TLS allowed),
``blocked`` and ``mirrors`` (each a ``location`` and ``insecure``). The longest matching prefix wins;
``endpoints`` returns the mirrors in order, then the registry itself, as containers/image tries
them. Loopback registries (``localhost``, ``127.0.0.0/8``, ``[::1]``) are insecure by default, as
Docker and containerd treat them. ``Credentials`` are what one PullImage carried.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vmsandbox.errors import InvalidArgument, PermissionDenied
from vmsandbox.image_ref import ImageReference

_LOCATION = re.compile(r"[A-Za-z0-9.\-\[\]:]+(?:/[a-z0-9._\-/]+)?")


@dataclass(frozen=True)
class Mirror:
    location: str
    insecure: bool = False


@dataclass(frozen=True)
class RegistryEntry:
    prefix: str
    location: str = ""
    insecure: bool = False
    blocked: bool = False
    mirrors: tuple[Mirror, ...] = ()


@dataclass(frozen=True)
class Registries:
    entries: tuple[RegistryEntry, ...] = ()

    def match(self, name: str) -> RegistryEntry | None:
        """The entry whose prefix is the longest one ending at a component boundary of ``name``."""
        best: RegistryEntry | None = None
        for e in self.entries:
            if (name == e.prefix or name.startswith(e.prefix + "/")) and (
                best is None or len(e.prefix) > len(best.prefix)
            ):
                best = e
        return best


@dataclass(frozen=True)
class Endpoint:
    """One place to ask for the image: ``repository`` is ``host[:port]/path`` there."""

    repository: str
    insecure: bool
    mirror: bool

    @property
    def host(self) -> str:
        return self.repository.split("/", 1)[0]


def is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]", 1)[0] + "]"
    return name in ("localhost", "[::1]") or bool(re.fullmatch(r"127(?:\.\d{1,3}){3}", name))


def _location(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _LOCATION.fullmatch(value) or value.endswith("/"):
        raise InvalidArgument(f"{where}: {str(value)[:100]!r} is not host[:port][/namespace]")
    return value


def _flag(doc: Mapping[str, Any], key: str, where: str) -> bool:
    value = doc.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{where}.{key}: must be true or false")
    return value


def parse_registries(data: Any, where: str = "registries") -> Registries:
    """Validate the ``registries`` list of the shim's config."""
    if data is None:
        return Registries()
    if not isinstance(data, list):
        raise InvalidArgument(f"{where}: must be a list of {{prefix, location, insecure, blocked, mirrors}}")
    entries: list[RegistryEntry] = []
    seen: set[str] = set()
    for i, doc in enumerate(data):
        at = f"{where}[{i}]"
        if not isinstance(doc, dict):
            raise InvalidArgument(f"{at}: must be a mapping")
        unknown = sorted(set(doc) - {"prefix", "location", "insecure", "blocked", "mirrors"})
        if unknown:
            raise InvalidArgument(f"{at}.{unknown[0]}: unknown key")
        prefix = _location(doc.get("prefix"), f"{at}.prefix")
        if prefix in seen:
            raise InvalidArgument(f"{at}.prefix: {prefix!r} is listed twice")
        seen.add(prefix)
        mirrors_doc = doc.get("mirrors") or []
        if not isinstance(mirrors_doc, list):
            raise InvalidArgument(f"{at}.mirrors: must be a list")
        mirrors = []
        for j, m in enumerate(mirrors_doc):
            mat = f"{at}.mirrors[{j}]"
            if not isinstance(m, dict) or sorted(set(m) - {"location", "insecure"}):
                raise InvalidArgument(f"{mat}: must be a mapping of location and insecure")
            mirrors.append(Mirror(_location(m.get("location"), f"{mat}.location"), _flag(m, "insecure", mat)))
        entries.append(
            RegistryEntry(
                prefix=prefix,
                location=_location(doc["location"], f"{at}.location") if doc.get("location") else "",
                insecure=_flag(doc, "insecure", at),
                blocked=_flag(doc, "blocked", at),
                mirrors=tuple(mirrors),
            )
        )
    return Registries(tuple(entries))


def _rewrite(name: str, prefix: str, location: str) -> str:
    return location + name[len(prefix) :]


def endpoints(ref: ImageReference, registries: Registries) -> Sequence[Endpoint]:
    """Where to pull ``ref`` from, in order: the matching entry's mirrors, then its location."""
    name = ref.name
    entry = registries.match(name)
    if entry is None:
        return (Endpoint(name, is_loopback(ref.domain), mirror=False),)
    if entry.blocked:
        raise PermissionDenied(f"pulling {ref} is blocked by the registries configuration (prefix {entry.prefix!r})")
    out = [
        Endpoint(_rewrite(name, entry.prefix, m.location), m.insecure or is_loopback(m.location), mirror=True)
        for m in entry.mirrors
    ]
    location = entry.location or entry.prefix
    out.append(
        Endpoint(
            _rewrite(name, entry.prefix, location),
            entry.insecure or is_loopback(location.split("/", 1)[0]),
            mirror=False,
        )
    )
    return tuple(out)


@dataclass(frozen=True)
class Credentials:
    """What a PullImage carried in ``AuthConfig``; ``repr`` never shows a secret."""

    username: str = ""
    password: str = ""
    auth: str = ""  # base64 of "username:password"
    identity_token: str = ""

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, secrets=<redacted>)"

    def auth_entry(self) -> dict[str, str]:
        entry: dict[str, str] = {}
        if self.identity_token:
            entry["identitytoken"] = self.identity_token
        if self.username or self.password:
            entry["auth"] = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        elif self.auth:
            entry["auth"] = self.auth
        return entry
