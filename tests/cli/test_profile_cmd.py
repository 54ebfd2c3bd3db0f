"""``vmsandbox profile validate`` and ``profile runtimeclass`` through the real entry point."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.cli.conftest import DEPLOY, ONE_NODE, PROFILES, TWO_SOCKET, vmsandbox, vmsandbox_json

VALID = "name: ok\nhandler: ok\nvcpu: {min: 1, max: 4}\n"

# (file text, fixture host, expected exit, expected lines: "LINE: KEY: PROBLEM" after "FILE:")
VALIDATE_CASES = {
    "valid": (VALID, TWO_SOCKET, 0, []),
    "min-over-max": (
        "name: a\nvcpu:\n  min: 8\n  max: 4\n",
        TWO_SOCKET,
        1,
        ["3: vcpu.min: 8 is greater than vcpu.max 4"],
    ),
    "unknown-key": ("name: a\nvcpus: {min: 1}\n", TWO_SOCKET, 1, ["2: vcpus: unknown key"]),
    "unknown-nested-key": ("name: a\nmemory:\n  overhed: 64Mi\n", TWO_SOCKET, 1, ["3: memory.overhed: unknown key"]),
    "bad-quantity": (
        "name: a\nmemory:\n  overhead: lots\n",
        TWO_SOCKET,
        1,
        ['3: memory.overhead: invalid quantity "lots"'],
    ),
    "page-size-not-reserved": (
        "name: a\npage_size: 1Gi\n",
        ONE_NODE,
        1,
        ["2: page_size: no 1Gi hugepages are reserved on this host (nr_hugepages is 0 on node0)"],
    ),
    "page-size-unknown": ("name: a\npage_size: 16Mi\n", TWO_SOCKET, 1, ["2: page_size: must be one of 4Ki, 2Mi, 1Gi"]),
    "kvm-without-vmx": ("name: a\naccel: kvm\n", ONE_NODE, 1, ["2: accel: kvm, but the host CPU has no vmx/svm"]),
    "vcpu-min-over-node": (
        "name: a\nvcpu: {min: 4, max: 8}\n",
        ONE_NODE,
        1,
        ["2: vcpu.min: 4 exceeds the 2 CPUs the shim owns on one NUMA node"],
    ),
    "vcpu-max-over-node-warns": (
        "name: a\nvcpu: {min: 1, max: 8}\n",
        ONE_NODE,
        0,
        ["2: vcpu.max: warning: 8 exceeds the 2 CPUs the shim owns on one NUMA node"],
    ),
    "device-pool-not-configured": (
        "name: a\nextended_resources:\n  nvidia.com/gpu: a100\n",
        TWO_SOCKET,
        1,
        [
            "3: extended_resources.nvidia.com/gpu: device pool 'a100' is not in the shim's device_pools "
            "(configured: none)"
        ],
    ),
    "duplicate-handler": (
        "name: a\nhandler: h\n---\nname: b\nhandler: h\n",
        TWO_SOCKET,
        1,
        ["5: handler: 'h' is already served by profile 'a'"],
    ),
    "syntax-error": ("name: a\nvcpu: {min: 1\n", TWO_SOCKET, 1, ["3: (syntax):"]),
    "second-document": (VALID + "---\nname: b\nvcpu: {max: 0}\n", TWO_SOCKET, 1, ["6: vcpu.max: must be between 1"]),
}


@pytest.mark.parametrize("text,host,code,lines", VALIDATE_CASES.values(), ids=list(VALIDATE_CASES))
def test_validate(tmp_path: Path, text: str, host: Path, code: int, lines: list[str]) -> None:
    f = tmp_path / "profiles.yaml"
    f.write_text(text)
    done = vmsandbox("profile", "validate", f, "--host-sysfs", host)
    assert done.returncode == code, done.stdout + done.stderr
    out = done.stdout.splitlines()
    for expected in lines:
        assert any(line.startswith(f"{f}:{expected}") for line in out), (expected, out)
    summary = out[-1].removeprefix(f"{f}: ").split(" (")[0]  # "2 profiles OK", "1 profile 1 error"
    assert summary.endswith(" OK") if code == 0 else summary.endswith((" error", " errors")), summary


def test_validate_json_and_several_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nvcpu: {min: 9, max: 1}\n")
    code, doc = vmsandbox_json("profile", "validate", PROFILES, bad, "--host-sysfs", TWO_SOCKET)
    assert code == 1 and doc["valid"] is False
    assert [p["name"] for p in doc["profiles"]] == ["vmsandbox", "gpu", "sidecars"]
    problems = {(p["file"], p["line"], p["key"], p["severity"]) for p in doc["problems"]}
    assert (str(bad), 2, "vcpu.min", "error") in problems
    assert (str(PROFILES), 9, "extended_resources.nvidia.com/gpu", "error") in problems


def test_deploy_profiles_are_valid_on_a_numa_host() -> None:
    done = vmsandbox("profile", "validate", DEPLOY / "profiles.yaml", "--host-sysfs", TWO_SOCKET)
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines() == [
        f"{DEPLOY / 'profiles.yaml'}: 4 profiles OK (small -> vmsandbox, medium -> vmsandbox-medium, "
        "dedicated -> vmsandbox-dedicated, hugepages -> vmsandbox-hugepages)"
    ]


def test_schema_only(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("name: a\npage_size: 1Gi\naccel: kvm\n")
    assert vmsandbox("profile", "validate", f, "--no-host").returncode == 0
    assert vmsandbox("profile", "validate", f, "--host-sysfs", ONE_NODE).returncode == 1


def test_runtimeclass_matches_deploy() -> None:
    """deploy/runtimeclass.yaml is exactly what the command derives from deploy/profiles.yaml."""
    done = vmsandbox("profile", "runtimeclass", "deploy/profiles.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (DEPLOY / "runtimeclass.yaml").read_text()
    classes = list(yaml.safe_load_all(done.stdout))
    by_name = {c["metadata"]["name"]: c for c in classes}
    assert set(by_name) == {"vmsandbox", "vmsandbox-medium", "vmsandbox-dedicated", "vmsandbox-hugepages"}
    assert by_name["vmsandbox-dedicated"]["overhead"]["podFixed"] == {"cpu": "1", "memory": "96Mi"}
    assert by_name["vmsandbox"]["handler"] == "vmsandbox"


def test_runtimeclass_one_handler_json() -> None:
    code, doc = vmsandbox_json("profile", "runtimeclass", DEPLOY / "profiles.yaml", "--handler", "vmsandbox-hugepages")
    assert code == 0
    assert [c["overhead"]["podFixed"] for c in doc] == [{"memory": "128Mi"}]
    done = vmsandbox("profile", "runtimeclass", DEPLOY / "profiles.yaml", "--handler", "nope")
    assert done.returncode == 2 and "--handler nope: no profile serves it" in done.stderr
