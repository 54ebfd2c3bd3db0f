"""What a client string must look like before the shim uses it, and how an error message echoes it.

Pure: every check raises ``InvalidArgument`` naming the field, and echoes the offending value only
through ``quote`` (bounded, escaped), so a message never grows with the input.

The name rules are Kubernetes' own (apimachinery ``validation``), because the kubelet sends what the
API server accepted and nothing else is meaningful:

* DNS-1123 label (namespaces): at most 63 characters of ``[a-z0-9-]``, starting and ending with
  an alphanumeric character.
* DNS-1123 subdomain: at most 253 characters; DNS-1123 labels joined by dots.
* Pod names are DNS-1123 subdomains and container names DNS-1123 labels, with two allowances
  made for cri-tools' conformance suite (critest), which a CRI runtime must pass and which names
  pods "PodSandbox-with-attributes-<uuid>" and containers
  "container-with-RunAsGroup-without-RunAsUser-test-<uuid>" (86 characters): upper case letters
  are accepted, and a container name may be as long as a subdomain (253). Nothing else is: the
  character set, the shape and the bounds are what keeps them safe in paths, XML and log lines.
* Qualified name (label and annotation keys): an optional DNS-1123 subdomain prefix and ``/``, then
  a name of at most 63 characters of ``[A-Za-z0-9._-]`` starting and ending alphanumeric.
* Label value: empty, or at most 63 characters shaped like a qualified name's name part; except
  the kubelet's own ``io.kubernetes.pod.name`` and ``io.kubernetes.container.name`` labels,
  which carry a pod's and a container's name and follow their rules.
* Annotations: keys are qualified names; keys and values together at most 256 KiB.

A pod uid has no syntax in Kubernetes beyond being generated (a UUID, or a hash for static pods):
we accept 1 to 128 characters of ``[A-Za-z0-9._-]``, which covers both.

Ids are ours: 64 lowercase hex characters. A client may give a unique prefix of one (as containerd
accepts); ``resolve_prefix`` turns it into the full id.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping

from vmsandbox.errors import InvalidArgument, NotFound

ID_LENGTH = 64
QUOTE_LIMIT = 64  # characters of a client string an error message echoes
MESSAGE_LIMIT = 2048  # characters of a whole error message
ANNOTATIONS_TOTAL_LIMIT = 256 * 1024
UID_LIMIT = 128
TEXT_LIMIT = 4096  # free text (image names, paths, hostnames)

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_ANY_CASE_LABEL = re.compile(r"[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?")
_ANY_CASE_SUBDOMAIN = re.compile(r"[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_UID = re.compile(r"[A-Za-z0-9._-]+")
_ID_PREFIX = re.compile(r"[0-9a-f]+")
# the characters ``unsafe`` names, as one class: searching with it is what keeps validation cheap
_UNSAFE_CLASS = "\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\ufdd0-\ufdef" + "".join(
    f"{chr(plane << 16 | 0xFFFE)}{chr(plane << 16 | 0xFFFF)}" for plane in range(17)
)
_UNSAFE = re.compile(f"[{_UNSAFE_CLASS}]")
_UNSAFE_OR_BACKSLASH = re.compile(f"[{_UNSAFE_CLASS}\\\\]")


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def unsafe(ch: str) -> bool:
    """A character a log line or a message must not carry raw: controls (C0, DEL, C1), line and
    paragraph separators, lone surrogates and the noncharacters (U+FDD0..U+FDEF, U+xFFFE, U+xFFFF)."""
    code = ord(ch)
    return (
        code < 0x20
        or 0x7F <= code <= 0x9F
        or code in (0x2028, 0x2029)
        or 0xD800 <= code <= 0xDFFF
        or 0xFDD0 <= code <= 0xFDEF
        or (code & 0xFFFE) == 0xFFFE
    )


def escape(text: str) -> str:
    """``text`` with every unsafe character written as a Python-style escape (``\\n`` -> ``\\x0a``)."""
    return _UNSAFE_OR_BACKSLASH.sub(lambda m: "\\\\" if m.group() == "\\" else _escape_char(m.group()), text)


def quote(text: str, limit: int = QUOTE_LIMIT) -> str:
    """A client string for a message: double-quoted, escaped, cut after ``limit`` characters with
    the number of characters left out."""
    shown = text[:limit]
    more = f"...(+{len(text) - limit} characters)" if len(text) > limit else ""
    return '"' + escape(shown).replace('"', '\\"') + '"' + more


def bound(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """A whole message, escaped and cut to at most about ``limit`` characters."""
    text = escape(message)
    if len(text) <= limit:
        return text
    return text[:limit] + f"...(+{len(text) - limit} characters)"


# -- Kubernetes names ---------------------------------------------------------------------------------
def _check(ok: bool, field: str, value: str, rule: str) -> None:
    if not ok:
        raise InvalidArgument(f"{field}: {quote(value)} is invalid: {rule}")


def _require(value: str, field: str) -> None:
    if not value:
        raise InvalidArgument(f"{field} is empty")


def dns1123_label(value: str, field: str) -> None:
    _require(value, field)
    _check(
        len(value) <= 63 and _DNS1123_LABEL.fullmatch(value) is not None,
        field,
        value,
        "must be a DNS-1123 label: at most 63 characters of lowercase letters, digits and '-', "
        "starting and ending with a letter or digit",
    )


def dns1123_subdomain(value: str, field: str) -> None:
    _require(value, field)
    _check(
        len(value) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(value) is not None,
        field,
        value,
        "must be a DNS-1123 subdomain: at most 253 characters of lowercase letters, digits, '-' and '.', "
        "starting and ending with a letter or digit",
    )


#: Labels the kubelet sets to the pod's and the container's name: their values follow those names'
#: rules (up to 253 characters), not a label value's (up to 63).
KUBELET_POD_NAME_LABEL = "io.kubernetes.pod.name"
KUBELET_CONTAINER_NAME_LABEL = "io.kubernetes.container.name"


def pod_name(value: str, field: str) -> None:
    """A DNS-1123 subdomain, upper case allowed (see the module docstring)."""
    _require(value, field)
    _check(
        len(value) <= 253 and _ANY_CASE_SUBDOMAIN.fullmatch(value) is not None,
        field,
        value,
        "must be a DNS-1123 subdomain: at most 253 characters of letters, digits, '-' and '.', "
        "starting and ending with a letter or digit",
    )


def container_name(value: str, field: str) -> None:
    """A DNS-1123 label, upper case allowed, up to 253 characters (see the module docstring)."""
    _require(value, field)
    _check(
        len(value) <= 253 and _ANY_CASE_LABEL.fullmatch(value) is not None,
        field,
        value,
        "must be a DNS-1123 label: letters, digits and '-', starting and ending with a letter or digit",
    )


_NAME_RULE = "at most 63 characters of letters, digits, '-', '_' and '.', starting and ending with a letter or digit"


def qualified_name(value: str, field: str) -> None:
    """A label or annotation key: ``[prefix/]name``."""
    prefix, slash, name = value.rpartition("/")
    if slash:
        _check(
            bool(prefix) and len(prefix) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(prefix) is not None,
            field,
            value,
            "the prefix before '/' must be a DNS-1123 subdomain of at most 253 characters",
        )
    _check(bool(name), field, value, "the name must not be empty")
    _check(
        len(name) <= 63 and _QUALIFIED_NAME.fullmatch(name) is not None, field, value, "the name must be " + _NAME_RULE
    )


def label_value(value: str, field: str) -> None:
    if value:
        _check(
            len(value) <= 63 and _QUALIFIED_NAME.fullmatch(value) is not None,
            field,
            value,
            "a label value must be empty or " + _NAME_RULE,
        )


def label_map(items: Mapping[str, str], field: str) -> None:
    for key, value in items.items():
        qualified_name(key, f"{field} key")
        if key == KUBELET_POD_NAME_LABEL:
            pod_name(value, f"{field}[{key}]")  # the kubelet copies the pod's name here
        elif key == KUBELET_CONTAINER_NAME_LABEL:
            container_name(value, f"{field}[{key}]")
        else:
            label_value(value, f"{field}[{key}]")


def annotation_map(items: Mapping[str, str], field: str) -> None:
    total = 0
    for key, value in items.items():
        qualified_name(key, f"{field} key")
        total += len(key) + len(value)
    if total > ANNOTATIONS_TOTAL_LIMIT:
        raise InvalidArgument(f"{field}: {total} characters in all, more than the {ANNOTATIONS_TOTAL_LIMIT} allowed")


def uid(value: str, field: str) -> None:
    _require(value, field)
    _check(
        len(value) <= UID_LIMIT and _UID.fullmatch(value) is not None,
        field,
        value,
        f"must be at most {UID_LIMIT} characters of letters, digits, '-', '_' and '.' (e.g. a UUID)",
    )


def path_component(value: str) -> bool:
    """Whether ``value`` names one entry of a directory (not ``.`` or ``..``, no ``/`` or NUL): a
    pod uid the kubelet's pod directory may be joined with."""
    return value not in ("", ".", "..") and "/" not in value and "\x00" not in value


def text(value: str, field: str, limit: int = TEXT_LIMIT) -> None:
    """Free text (an image name, a hostname, a path): bounded and free of control characters."""
    if len(value) <= limit and _UNSAFE.search(value) is None:
        return
    _check(len(value) <= limit, field, value, f"longer than {limit} characters")
    bad = _UNSAFE.search(value)
    if bad is not None:
        raise InvalidArgument(f"{field}: {quote(value)} contains the control character {_escape_char(bad.group())}")


def absolute_path(value: str, field: str) -> None:
    """Empty, or an absolute path without '.' or '..' components (a kubelet directory or file)."""
    text(value, field)
    if value:
        _check(value.startswith("/"), field, value, "must be an absolute path")
        _check(all(part not in (".", "..") for part in value.split("/")), field, value, "must not contain '.' or '..'")


def relative_file(value: str, field: str) -> None:
    """A path relative to a directory that must stay inside it: no leading '/', no '..' component."""
    text(value, field)
    _check(not value.startswith("/"), field, value, "must be relative")
    _check(all(part != ".." for part in value.split("/")), field, value, "must not leave its directory ('..')")


def join_log_path(directory: str, log_path: str) -> str:
    """A container's log file as containerd places it: the sandbox's ``log_directory`` joined with the
    container's relative ``log_path`` ("" when no log_path; the relative path when no directory)."""
    if not log_path:
        return ""
    relative_file(log_path, "ContainerConfig.log_path")
    if not directory:
        return log_path
    return posixpath.normpath(posixpath.join(directory, log_path))


# -- our ids ------------------------------------------------------------------------------------------
def is_full_id(name: str) -> bool:
    """Whether ``name`` has the form of an id this runtime makes (64 lowercase hex digits), as a
    file named after a sandbox must before a sweep may remove it."""
    return len(name) == 64 and _ID_PREFIX.fullmatch(name) is not None


def id_prefix(value: str, field: str) -> str:
    """``value`` when it is an id or a prefix of one (1 to 64 lowercase hex characters)."""
    if not value:
        raise InvalidArgument(f"{field} is empty")
    _check(
        len(value) <= ID_LENGTH and _ID_PREFIX.fullmatch(value) is not None,
        field,
        value,
        f"an id is {ID_LENGTH} lowercase hexadecimal characters (or a unique prefix of one)",
    )
    return value


_FOREIGN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def teardown_id(value: str, field: str) -> str | None:
    """For Stop/Remove, where an unknown id succeeds (as containerd answers): ``value`` when it may be
    one of our ids or a prefix of one; None when it is some other runtime's kind of id (a UUID, say),
    which names nothing here; INVALID_ARGUMENT for anything no runtime would call an id (control
    characters, path separators, more than 128 characters)."""
    if value and len(value) <= ID_LENGTH and _ID_PREFIX.fullmatch(value) is not None:
        return value
    if _FOREIGN_ID.fullmatch(value) is not None:
        return None
    return id_prefix(value, field)  # raises, naming the field


def is_id(value: str) -> bool:
    return len(value) == ID_LENGTH and _ID_PREFIX.fullmatch(value) is not None


def resolve_prefix(prefix: str, known: Iterable[str], kind: str) -> str:
    """The one id of ``known`` that starts with ``prefix`` (an exact match wins).

    ``NotFound`` when none does, ``InvalidArgument`` when several do (as containerd answers)."""
    matches = sorted({k for k in known if k.startswith(prefix)})
    if prefix in matches:
        return prefix
    if not matches:
        raise NotFound(f"{kind} {quote(prefix)} not found")
    if len(matches) > 1:
        shown = ", ".join(m[:12] for m in matches[:3]) + (", ..." if len(matches) > 3 else "")
        raise InvalidArgument(f"{kind} id prefix {quote(prefix)} is ambiguous: it matches {len(matches)} ({shown})")
    return matches[0]
