"""vmsandbox.seccomp: Localhost seccomp profiles (OCI or Docker format) to the OCI section."""

from __future__ import annotations

from typing import Any

import pytest

from vmsandbox.errors import InvalidArgument
from vmsandbox.seccomp import oci_seccomp

CAPS = ["CAP_CHOWN", "CAP_NET_BIND_SERVICE"]


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        ({"defaultAction": "SCMP_ACT_ALLOW"}, {"defaultAction": "SCMP_ACT_ALLOW"}),
        (
            {
                "defaultAction": "SCMP_ACT_ERRNO",
                "defaultErrnoRet": 1,
                "architectures": ["SCMP_ARCH_X86_64"],
                "syscalls": [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"}],
            },
            {
                "defaultAction": "SCMP_ACT_ERRNO",
                "defaultErrnoRet": 1,
                "architectures": ["SCMP_ARCH_X86_64"],
                "syscalls": [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"}],
            },
        ),
        (  # Docker's format: archMap picks the guest's architecture; name; conditions decided here
            {
                "defaultAction": "SCMP_ACT_ERRNO",
                "archMap": [
                    {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": ["SCMP_ARCH_ARM"]},
                    {"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]},
                ],
                "syscalls": [
                    {"name": "mkdir", "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
                    {"names": ["chown"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_CHOWN"]}},
                    {"names": ["mount"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
                    {"names": ["arch_prctl"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["amd64"]}},
                    {"names": ["s390_x"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["s390x"]}},
                    {"names": ["bind"], "action": "SCMP_ACT_ALLOW", "excludes": {"caps": ["CAP_NET_BIND_SERVICE"]}},
                    {
                        "names": ["personality"],
                        "action": "SCMP_ACT_ALLOW",
                        "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}],
                    },
                ],
            },
            {
                "defaultAction": "SCMP_ACT_ERRNO",
                "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
                "syscalls": [
                    {"names": ["mkdir"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
                    {"names": ["chown"], "action": "SCMP_ACT_ALLOW"},
                    {"names": ["arch_prctl"], "action": "SCMP_ACT_ALLOW"},
                    {
                        "names": ["personality"],
                        "action": "SCMP_ACT_ALLOW",
                        "args": [{"index": 0, "op": "SCMP_CMP_EQ", "value": 8}],
                    },
                ],
            },
        ),
    ],
)
def test_profiles_become_the_oci_section(doc: dict[str, Any], want: dict[str, Any]) -> None:
    assert oci_seccomp(doc, CAPS, "p.json") == want


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ([], "not a JSON object"),
        ({}, "defaultAction"),
        ({"defaultAction": "SCMP_ACT_MAYBE"}, "defaultAction 'SCMP_ACT_MAYBE'"),
        ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": {}}, "syscalls must be a list"),
        ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": "read", "action": "SCMP_ACT_ALLOW"}]}, "names"),
        ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], "action": "nope"}]}, "action"),
        (
            {
                "defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": ["x"], "action": "SCMP_ACT_ALLOW", "args": [{}]}],
            },
            "args op",
        ),
        ({"defaultAction": "SCMP_ACT_ALLOW", "flags": ["SECCOMP_FILTER_FLAG_NEW"]}, "flag"),
        (
            {
                "defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": ["x"], "action": "SCMP_ACT_ALLOW", "includes": {"os": 1}}],
            },
            "includes.os",
        ),
        ({"defaultAction": "SCMP_ACT_ALLOW", "defaultErrnoRet": -1}, "defaultErrnoRet"),
    ],
)
def test_bad_profiles_are_refused_with_what_is_wrong(doc: object, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words) as err:
        oci_seccomp(doc, CAPS, "/var/lib/kubelet/seccomp/p.json")
    assert "/var/lib/kubelet/seccomp/p.json" in str(err.value)
