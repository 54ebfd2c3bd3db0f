"""``vmsandbox profile validate`` and ``profile runtimeclass`` through the real entry point."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.cli.vmsandbox_cmd import DEPLOY, HERE, ONE_NODE, PROFILES, TWO_SOCKET, vmsandbox, vmsandbox_json

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
        ["2: vcpu.min: 4 exceeds the shim's 2 exclusive CPUs on one NUMA node: no pod could be placed"],
    ),
    "vcpu-max-over-node-warns": (
        "name: a\nvcpu: {min: 1, max: 8}\n",
        ONE_NODE,
        0,
        ["2: vcpu.max: warning: 8 exceeds the shim's 2 exclusive CPUs on one NUMA node"],
    ),
    # numa_policy none may span nodes: the limit is every exclusive CPU, not one node's 32
    "vcpu-max-spanning-policy-counts-all-nodes": ("name: a\nnuma_policy: none\nvcpu: {max: 40}\n", TWO_SOCKET, 0, []),
    "memory-min-zero": ("name: a\nmemory:\n  min: 0\n", TWO_SOCKET, 1, ["3: memory.min: must be more than 0, got 0"]),
    "handler-not-a-dns-label": (
        "name: a\nhandler: Fast_VM\n",
        TWO_SOCKET,
        1,
        ["2: handler: 'Fast_VM' is not a valid RuntimeClass handler (a DNS-1123 label"],
    ),
    "name-as-handler-not-a-dns-label": (
        "name: big.vm\n",
        TWO_SOCKET,
        1,
        ["1: name: 'big.vm' is not a valid RuntimeClass handler"],
    ),
    "shared-without-shared-cpus": (
        "name: a\ncpu_policy: shared\npage_size: 4Ki\n",
        TWO_SOCKET,
        1,
        ["2: cpu_policy: shared, but the shim's built-in configuration sets no shared_cpus"],
    ),
    "init-containers-retired": (
        "name: a\ninit_containers: concurrent\n",
        TWO_SOCKET,
        1,
        ["2: init_containers: no longer supported: sidecars (init containers with restartPolicy: Always)"],
    ),
    "every-error-of-a-profile": (
        "name: a\nvcpu: {min: 0}\nmemory: {min: 0}\naccel: hvf\ninit_containers: sequential\n",
        TWO_SOCKET,
        1,
        [
            "2: vcpu.min: must be between 1 and 1024, got 0",
            "3: memory.min: must be more than 0, got 0",
            "4: accel: must be one of auto, kvm, tcg, got 'hvf'",
            "5: init_containers: no longer supported",
        ],
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


# (shim config, profile text, fixture host, exit, lines in the config "LINE: KEY: ...", lines in the profiles)
CONFIG_CASES = {
    "offline-cpu-blames-the-config": (
        'cpu_pool: "99"\n',
        "name: a\nvcpu: {min: 1, max: 1}\n",
        ONE_NODE,
        1,
        ["1: cpu_pool: names CPUs that are not online on this host: 99"],
        [],
    ),
    "every-cpu-shared": (
        'cpu_pool: "0-1"\nshared_cpus: "0-1"\n',
        "name: a\nvcpu: {max: 1}\n---\nname: b\ncpu_policy: shared\npage_size: 4Ki\n",
        ONE_NODE,
        1,
        [
            "2: shared_cpus: every CPU of cpu_pool (0-1) is in shared_cpus or housekeeping_cpus: no CPU is left for "
            "exclusive pods, so profile a (cpu_policy exclusive) would refuse every pod"
        ],
        [],
    ),
    # node 0 holds 32 CPUs, 8 of them shared: exclusive pods get 24
    "exclusive-count-leaves-out-shared-cpus": (
        'shared_cpus: "0-3,16-19,32-35,48-51"\n',
        "name: a\nvcpu: {max: 30}\n",
        TWO_SOCKET,
        0,
        [],
        ["2: vcpu.max: warning: 30 exceeds the shim's 24 exclusive CPUs on one NUMA node"],
    ),
    "shared-with-shared-cpus": ('shared_cpus: "0-1"\n', "name: a\ncpu_policy: shared\n", TWO_SOCKET, 0, [], []),
}


@pytest.mark.parametrize("config_text,text,host,code,config_lines,lines", CONFIG_CASES.values(), ids=list(CONFIG_CASES))
def test_validate_with_config(
    tmp_path: Path,
    config_text: str,
    text: str,
    host: Path,
    code: int,
    config_lines: list[str],
    lines: list[str],
) -> None:
    config, f = tmp_path / "config.yaml", tmp_path / "profiles.yaml"
    config.write_text(config_text)
    f.write_text(text)
    done = vmsandbox("profile", "validate", f, "--config", config, "--host-sysfs", host)
    assert done.returncode == code, done.stdout + done.stderr
    out = done.stdout.splitlines()
    for expected in config_lines:
        assert any(line.startswith(f"{config}:{expected}") for line in out), (expected, out)
    for expected in lines:
        assert any(line.startswith(f"{f}:{expected}") for line in out), (expected, out)
    problems = [line for line in out if line.startswith(f"{f}:") and not line.startswith(f"{f}: ")]
    assert len(problems) == len(lines), out  # nothing blamed on the profiles beyond these
    if config_lines:
        assert out[-1] == f"{config}: {len(config_lines)} error{'s' if len(config_lines) > 1 else ''}"


def test_validate_json_and_several_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nvcpu: {min: 9, max: 1}\n")
    code, doc = vmsandbox_json("profile", "validate", PROFILES, bad, "--host-sysfs", TWO_SOCKET)
    assert code == 1 and doc["valid"] is False
    assert [p["name"] for p in doc["profiles"]] == ["vmsandbox", "gpu"]
    problems = {(p["file"], p["line"], p["key"], p["severity"]) for p in doc["problems"]}
    assert (str(bad), 2, "vcpu.min", "error") in problems
    assert (str(PROFILES), 9, "extended_resources.nvidia.com/gpu", "error") in problems


def test_deploy_profiles_are_valid_on_a_numa_host() -> None:
    config = HERE / "two-socket-config.yaml"  # shared_cpus for the shared profiles
    done = vmsandbox("profile", "validate", DEPLOY / "profiles.yaml", "--config", config, "--host-sysfs", TWO_SOCKET)
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines() == [
        # 64 CPUs on two nodes, 8 of each node's 32 shared: 24 exclusive CPUs on one node
        f"{DEPLOY / 'profiles.yaml'}:71: vcpu.max: warning: 32 exceeds the shim's 24 exclusive CPUs on one NUMA node: "
        "pods needing more than 24 vCPUs will be refused",
        f"{DEPLOY / 'profiles.yaml'}: 5 profiles OK (small -> vmsandbox, medium -> vmsandbox-medium, "
        "dedicated -> vmsandbox-dedicated, hugepages -> vmsandbox-hugepages, resizable -> vmsandbox-resizable)",
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
    assert set(by_name) == {
        "vmsandbox",
        "vmsandbox-medium",
        "vmsandbox-dedicated",
        "vmsandbox-hugepages",
        "vmsandbox-resizable",
    }
    assert by_name["vmsandbox-dedicated"]["overhead"]["podFixed"] == {"cpu": "1", "memory": "96Mi"}
    assert by_name["vmsandbox"]["handler"] == "vmsandbox"


def test_runtimeclass_one_handler_json() -> None:
    code, doc = vmsandbox_json("profile", "runtimeclass", DEPLOY / "profiles.yaml", "--handler", "vmsandbox-hugepages")
    assert code == 0
    assert [c["overhead"]["podFixed"] for c in doc] == [{"memory": "128Mi"}]
    done = vmsandbox("profile", "runtimeclass", DEPLOY / "profiles.yaml", "--handler", "nope")
    assert done.returncode == 2 and "--handler nope: no profile serves it" in done.stderr
