"""An admin's seccomp profile (a kubelet ``Localhost`` profile) as the OCI ``linux.seccomp`` section
(pure): checked field by field, in the OCI runtime spec's own format or in Docker's (``archMap``,
``name``, and ``includes``/``excludes`` conditions on the container's capabilities and the
architecture, decided here for an x86-64 guest). Anything else is refused with InvalidArgument
naming what is wrong, so crun never sees a profile it would misread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vmsandbox.errors import InvalidArgument

ACTIONS = frozenset(
    {
        "SCMP_ACT_KILL",
        "SCMP_ACT_KILL_PROCESS",
        "SCMP_ACT_KILL_THREAD",
        "SCMP_ACT_TRAP",
        "SCMP_ACT_ERRNO",
        "SCMP_ACT_TRACE",
        "SCMP_ACT_ALLOW",
        "SCMP_ACT_LOG",
    }
)
OPERATORS = frozenset(
    {
        "SCMP_CMP_NE",
        "SCMP_CMP_LT",
        "SCMP_CMP_LE",
        "SCMP_CMP_EQ",
        "SCMP_CMP_GE",
        "SCMP_CMP_GT",
        "SCMP_CMP_MASKED_EQ",
    }
)
FLAGS = frozenset({"SECCOMP_FILTER_FLAG_TSYNC", "SECCOMP_FILTER_FLAG_LOG", "SECCOMP_FILTER_FLAG_SPEC_ALLOW"})
GUEST_ARCH = "SCMP_ARCH_X86_64"
GO_ARCH = "amd64"  # the architecture name Docker's includes/excludes use
MAX_RULES = 4096


def _fail(where: str, what: str) -> InvalidArgument:
    return InvalidArgument(f"seccomp profile {where}: {what}")


def _strings(value: object, where: str, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _fail(where, f"{field} must be a list of names")
    return list(value)


def _int(value: object, where: str, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _fail(where, f"{field} must be a non-negative integer")
    return value


def _action(value: object, where: str, field: str) -> str:
    if value not in ACTIONS:
        raise _fail(where, f"{field} {str(value)[:40]!r} is not one of {', '.join(sorted(ACTIONS))}")
    assert isinstance(value, str)
    return value


def _applies(rule: Mapping[str, Any], caps: frozenset[str], where: str) -> bool:
    """Docker's conditions: every capability and the architecture in ``includes`` (when given),
    none of those in ``excludes``; ``minKernel`` holds on the guest's kernel (6.1)."""
    for key, want in (("includes", True), ("excludes", False)):
        cond = rule.get(key) or {}
        if not isinstance(cond, dict):
            raise _fail(where, f"{key} must be an object")
        unknown = set(cond) - {"caps", "arches", "minKernel"}
        if unknown:
            raise _fail(where, f"{key}.{sorted(unknown)[0]} is not understood")
        rule_caps = set(_strings(cond.get("caps", []), where, f"{key}.caps"))
        arches = set(_strings(cond.get("arches", []), where, f"{key}.arches"))
        if want:
            if not rule_caps <= caps or (arches and GO_ARCH not in arches):
                return False
        elif (rule_caps and rule_caps & caps) or GO_ARCH in arches:
            return False
    return True


def _architectures(doc: Mapping[str, Any], where: str) -> list[str]:
    if "archMap" in doc:
        arch_map = doc["archMap"]
        if not isinstance(arch_map, list):
            raise _fail(where, "archMap must be a list")
        for entry in arch_map:
            if isinstance(entry, dict) and entry.get("architecture") == GUEST_ARCH:
                return [GUEST_ARCH, *_strings(entry.get("subArchitectures", []), where, "subArchitectures")]
        return []
    return _strings(doc.get("architectures", []), where, "architectures")


def _args(value: object, where: str) -> list[dict[str, object]]:
    if not isinstance(value, list):
        raise _fail(where, "args must be a list")
    out = []
    for arg in value:
        if not isinstance(arg, dict):
            raise _fail(where, "each of args must be an object")
        op = arg.get("op")
        if op not in OPERATORS:
            raise _fail(where, f"args op {str(op)[:40]!r} is not one of {', '.join(sorted(OPERATORS))}")
        item: dict[str, object] = {"index": _int(arg.get("index"), where, "args index"), "op": op}
        item["value"] = _int(arg.get("value", 0), where, "args value")
        if "valueTwo" in arg:
            item["valueTwo"] = _int(arg["valueTwo"], where, "args valueTwo")
        out.append(item)
    return out


def oci_seccomp(doc: object, capabilities: Iterable[str], where: str) -> dict[str, object]:
    """The ``linux.seccomp`` section for ``doc`` (a parsed profile file named ``where``) in a
    container holding ``capabilities``."""
    if not isinstance(doc, dict):
        raise _fail(where, "is not a JSON object")
    caps = frozenset(capabilities)
    out: dict[str, object] = {"defaultAction": _action(doc.get("defaultAction"), where, "defaultAction")}
    if "defaultErrnoRet" in doc:
        out["defaultErrnoRet"] = _int(doc["defaultErrnoRet"], where, "defaultErrnoRet")
    arches = _architectures(doc, where)
    if arches:
        out["architectures"] = arches
    if doc.get("flags"):
        flags = _strings(doc["flags"], where, "flags")
        bad = [f for f in flags if f not in FLAGS]
        if bad:
            raise _fail(where, f"flag {bad[0][:40]!r} is not one of {', '.join(sorted(FLAGS))}")
        out["flags"] = flags
    rules = doc.get("syscalls")
    rules = [] if rules is None else rules
    if not isinstance(rules, list) or len(rules) > MAX_RULES:
        raise _fail(where, f"syscalls must be a list of at most {MAX_RULES} rules")
    syscalls = []
    for i, rule in enumerate(rules):
        at = f"{where}: syscalls[{i}]"
        if not isinstance(rule, dict):
            raise _fail(at, "is not an object")
        if not _applies(rule, caps, at):
            continue
        names = _strings(rule["names"], at, "names") if "names" in rule else _strings([rule.get("name")], at, "name")
        entry: dict[str, object] = {"names": names, "action": _action(rule.get("action"), at, "action")}
        if "errnoRet" in rule:
            entry["errnoRet"] = _int(rule["errnoRet"], at, "errnoRet")
        if rule.get("args"):
            entry["args"] = _args(rule["args"], at)
        syscalls.append(entry)
    if syscalls:
        out["syscalls"] = syscalls
    return out
