"""Tests of vmsandbox.profile and vmsandbox.adapters.profile_loader: YAML profiles, `file:line: key: problem`."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsandbox.adapters.profile_loader import default_profiles, load_profile_file, load_profiles
from vmsandbox.profile import Profile, ProfileError, profile_from_mapping, profile_problems

MI, GI = 1024**2, 1024**3
QUANTITY_GRAMMAR = (
    "expected [+-]<digits>[.<digits>] and an optional suffix: n u m k M G T P E, Ki Mi Gi Ti Pi Ei, or an exponent "
    'such as "e3" (examples: "500m", "1.5", "2Gi", "1e3")'
)
TOP_KEYS = (
    "accel, allowed_profiles, cpu_policy, defaults, emulator, extended_resources, guest, handler, machine, memory, "
    "name, numa_policy, page_size, resize_headroom, shared_storage, snapshots, vcpu"
)


HANDLER_PROBLEM = (
    "'{}' is not a valid RuntimeClass handler (a DNS-1123 label: at most 63 lower-case letters, digits and '-', "
    "starting and ending with a letter or digit)"
)


def write(tmp_path: Path, text: str, name: str = "profiles.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


FULL = """\
name: big
handler: vmsandbox-big
vcpu:
  min: 2
  max: 32
  extra: 1
memory:
  overhead: 96Mi
  min: 256Mi
page_size: 1Gi
cpu_policy: shared
machine: pc
accel: tcg
defaults:
  cpu: 500m
  memory: 1Gi
guest:
  kernel_cmdline: loglevel=4
  image_dir: /srv/images/big
  boot_timeout_s: 12.5
extended_resources:
  vendor.com/gpu: gpus
"""


def test_full_profile(tmp_path: Path) -> None:
    assert load_profile_file(write(tmp_path, FULL)) == [
        Profile(
            name="big",
            handler="vmsandbox-big",
            vcpu_min=2,
            vcpu_max=32,
            vcpu_extra=1,
            memory_overhead_bytes=96 * MI,
            memory_min_bytes=256 * MI,
            page_size_bytes=GI,
            cpu_policy="shared",
            machine="pc",
            accel="tcg",
            default_cpu_millis=500,
            default_memory_bytes=GI,
            kernel_cmdline="loglevel=4",
            image_dir="/srv/images/big",
            boot_timeout_s=12.5,
            extended_resources={"vendor.com/gpu": "gpus"},
        )
    ]


def test_minimal_profile_takes_defaults(tmp_path: Path) -> None:
    [profile] = load_profile_file(write(tmp_path, "name: small\n"))
    assert profile == Profile(name="small", handler="small")
    assert profile.pinning is True
    assert (profile.vcpu_min, profile.vcpu_max, profile.memory_overhead_bytes, profile.page_size_bytes) == (
        1,
        16,
        64 * MI,
        2 * MI,
    )


def test_numa_policy_and_emulator(tmp_path: Path) -> None:
    [profile] = load_profile_file(write(tmp_path, "name: a\nnuma_policy: best-effort\nemulator: housekeeping\n"))
    assert (profile.numa_policy, profile.emulator) == ("best-effort", "housekeeping")
    assert (Profile("b", "b").numa_policy, Profile("b", "b").emulator) == ("single-numa-node", "vcpus")


def test_multi_document_file_skips_empty_documents(tmp_path: Path) -> None:
    text = "name: a\n---\n---\nname: b\ncpu_policy: shared\npage_size: 4Ki\n"
    profiles = load_profile_file(write(tmp_path, text))
    assert profiles == [
        Profile(name="a", handler="a"),
        Profile(name="b", handler="b", cpu_policy="shared", page_size_bytes=4096),
    ]
    assert profiles[1].pinning is False


ERRORS = [
    # (yaml text, line, key, problem)
    pytest.param("name: a\nvcpus: 2\n", 2, "vcpus", f"unknown key (known: {TOP_KEYS})", id="unknown-key"),
    pytest.param("name: a\n1: x\n", 2, "1", f"unknown key (known: {TOP_KEYS})", id="unknown-non-string-key"),
    pytest.param(
        "name: a\nvcpu:\n  min: 1\n  mxa: 4\n",
        4,
        "vcpu.mxa",
        "unknown key (known: extra, max, min)",
        id="unknown-vcpu-key",
    ),
    pytest.param(
        "name: a\nmemory:\n  overhead_mib: 64\n",
        3,
        "memory.overhead_mib",
        "unknown key (known: min, overhead)",
        id="unknown-memory-key",
    ),
    pytest.param(
        "name: a\nguest:\n  timeout: 5\n",
        3,
        "guest.timeout",
        "unknown key (known: boot_timeout_s, image_dir, kernel_cmdline, tcg_tb_cache_mib)",
        id="unknown-guest-key",
    ),
    pytest.param(
        "name: a\ndefaults:\n  mem: 1Gi\n",
        3,
        "defaults.mem",
        "unknown key (known: cpu, memory)",
        id="unknown-defaults-key",
    ),
    pytest.param(
        "name: a\nvcpu:\n  max: 2\n  min: 4\n", 4, "vcpu.min", "4 is greater than vcpu.max 2", id="min-gt-max"
    ),
    pytest.param("name: a\nvcpu:\n  min: 0\n", 3, "vcpu.min", "must be between 1 and 1024, got 0", id="min-zero"),
    pytest.param("name: a\nvcpu:\n  max: 2000\n", 3, "vcpu.max", "must be between 1 and 1024, got 2000", id="max-huge"),
    pytest.param("name: a\nvcpu:\n  max: two\n", 3, "vcpu.max", "must be an integer, got 'two'", id="max-not-int"),
    pytest.param("name: a\nvcpu:\n  max: true\n", 3, "vcpu.max", "must be an integer, got True", id="max-bool"),
    pytest.param("name: a\nvcpu:\n  extra: 1.5\n", 3, "vcpu.extra", "must be an integer, got 1.5", id="extra-float"),
    pytest.param("name: a\nvcpu:\n  extra: 65\n", 3, "vcpu.extra", "must be between 0 and 64, got 65", id="extra-high"),
    pytest.param(
        "name: a\npage_size: 4Mi\n", 2, "page_size", "must be one of 4Ki, 2Mi, 1Gi, got '4Mi'", id="page-size"
    ),
    pytest.param(
        "name: a\npage_size: 2097152\n",
        2,
        "page_size",
        "must be one of 4Ki, 2Mi, 1Gi, got '2097152'",
        id="page-size-in-bytes",
    ),
    pytest.param(
        "name: a\ncpu_policy: dedicated\n",
        2,
        "cpu_policy",
        "must be one of exclusive, shared, got 'dedicated'",
        id="cpu-policy",
    ),
    pytest.param("name: a\nmachine: microvm\n", 2, "machine", "must be one of q35, pc, got 'microvm'", id="machine"),
    pytest.param(
        "name: a\nnuma_policy: strict\n",
        2,
        "numa_policy",
        "must be one of none, best-effort, restricted, single-numa-node, got 'strict'",
        id="numa-policy",
    ),
    pytest.param(
        "name: a\nemulator: own\n", 2, "emulator", "must be one of vcpus, housekeeping, got 'own'", id="emulator"
    ),
    pytest.param("name: a\naccel: hvf\n", 2, "accel", "must be one of auto, kvm, tcg, got 'hvf'", id="accel"),
    pytest.param(
        "name: a\ninit_containers: sequential\n",
        2,
        "init_containers",
        "no longer supported: sidecars (init containers with restartPolicy: Always) are sized by Kubernetes' rule; "
        "name them with the pod annotation io.vmsandbox/sidecars (vmsandbox plan reads restartPolicy from the "
        "manifest); remove this key",
        id="init-containers-retired",
    ),
    pytest.param("name: a\nmemory:\n  min: 0\n", 3, "memory.min", "must be more than 0, got 0", id="memory-min-zero"),
    pytest.param(
        "name: a\nmemory:\n  min: 0Mi\n", 3, "memory.min", "must be more than 0, got '0Mi'", id="memory-min-0Mi"
    ),
    pytest.param(
        "name: a\nhandler: vmsandbox_fast\n",
        2,
        "handler",
        "'vmsandbox_fast' is not a valid RuntimeClass handler (a DNS-1123 label: at most 63 lower-case letters, "
        "digits and '-', starting and ending with a letter or digit)",
        id="handler-underscore",
    ),
    pytest.param("name: a\nhandler: Fast\n", 2, "handler", HANDLER_PROBLEM.format("Fast"), id="handler-upper-case"),
    pytest.param(
        "name: a\nhandler: fast-\n", 2, "handler", HANDLER_PROBLEM.format("fast-"), id="handler-trailing-dash"
    ),
    pytest.param(
        "name: a\nhandler: " + "h" * 64 + "\n", 2, "handler", HANDLER_PROBLEM.format("h" * 64), id="handler-64-chars"
    ),
    pytest.param("name: vm.small\n", 1, "name", HANDLER_PROBLEM.format("vm.small"), id="name-serves-as-handler"),
    pytest.param(
        "name: a\nmemory:\n  overhead: 64MB\n",
        3,
        "memory.overhead",
        f'invalid quantity "64MB": unknown suffix "MB"; {QUANTITY_GRAMMAR}',
        id="bad-quantity",
    ),
    pytest.param(
        "name: a\nmemory:\n  min: -1Mi\n",
        3,
        "memory.min",
        'invalid quantity "-1Mi": must not be negative',
        id="negative-quantity",
    ),
    pytest.param(
        "name: a\ndefaults:\n  cpu: lots\n",
        3,
        "defaults.cpu",
        f'invalid quantity "lots": no digits; {QUANTITY_GRAMMAR}',
        id="bad-default-cpu",
    ),
    pytest.param(
        "name: a\nguest:\n  boot_timeout_s: 0\n",
        3,
        "guest.boot_timeout_s",
        "must be a number of seconds between 1 and 3600, got 0",
        id="timeout-zero",
    ),
    pytest.param(
        "name: a\nguest:\n  boot_timeout_s: 3601\n",
        3,
        "guest.boot_timeout_s",
        "must be a number of seconds between 1 and 3600, got 3601",
        id="timeout-high",
    ),
    pytest.param(
        "name: a\nguest:\n  boot_timeout_s: 10s\n",
        3,
        "guest.boot_timeout_s",
        "must be a number of seconds between 1 and 3600, got '10s'",
        id="timeout-string",
    ),
    pytest.param(
        "name: a\nguest:\n  boot_timeout_s: yes\n",
        3,
        "guest.boot_timeout_s",
        "must be a number of seconds between 1 and 3600, got True",
        id="timeout-bool",
    ),
    pytest.param("name: a\nguest:\n  kernel_cmdline: 5\n", 3, "guest.kernel_cmdline", "must be a string", id="cmdline"),
    pytest.param(
        "name: a\nguest:\n  image_dir: ''\n", 3, "guest.image_dir", "must be a non-empty string", id="empty-image-dir"
    ),
    pytest.param("handler: h\nvcpu:\n  min: 1\n", 1, "name", "must be a non-empty string", id="missing-name"),
    pytest.param("name: a\nhandler: 7\n", 2, "handler", "must be a non-empty string", id="handler-not-string"),
    pytest.param("name: a\nmemory: 1Gi\n", 2, "memory", "must be a mapping", id="section-not-mapping"),
    pytest.param(
        "name: a\nextended_resources:\n  - gpu\n",
        2,
        "extended_resources",
        "must map resource names to device pool names",
        id="extended-list",
    ),
    pytest.param("- a\n- b\n", 1, "(document)", "a profile must be a mapping", id="document-not-mapping"),
    pytest.param(
        "name: a\n---\n\nname: b\nvcpu:\n  min: 0\n",
        6,
        "vcpu.min",
        "must be between 1 and 1024, got 0",
        id="second-document-line",
    ),
    pytest.param(
        "name: a\n---\n# comment\nvcpu: {}\n", 4, "name", "must be a non-empty string", id="second-document-start-line"
    ),
    pytest.param("name: a\n  vcpu: [\n", 2, "(syntax)", "mapping values are not allowed here", id="yaml-syntax"),
]


@pytest.mark.parametrize(("text", "line", "key", "problem"), ERRORS)
def test_profile_errors_name_file_line_and_key(tmp_path: Path, text: str, line: int, key: str, problem: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as exc:
        load_profile_file(path)
    assert str(exc.value) == f"{path}:{line}: {key}: {problem}"
    assert (exc.value.key, exc.value.problem) == (key, problem)


def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(ProfileError) as exc:
        load_profile_file(path)
    assert str(exc.value) == f"{path}: (file): cannot read: No such file or directory"


def test_profile_from_mapping_names_its_source() -> None:
    with pytest.raises(ProfileError) as exc:
        profile_from_mapping(["not", "a", "mapping"], source="inline")  # type: ignore[arg-type]
    assert str(exc.value) == "inline: (document): a profile must be a mapping"


def test_load_profiles_by_handler(tmp_path: Path) -> None:
    a = write(tmp_path, "name: a\n---\nname: b\nhandler: fast\n", "a.yaml")
    c = write(tmp_path, "name: c\n", "c.yaml")
    assert load_profiles([a, c]) == {
        "a": Profile(name="a", handler="a"),
        "fast": Profile(name="b", handler="fast"),
        "c": Profile(name="c", handler="c"),
    }


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param("name: x\n", "name: y\nhandler: x\n", id="handler-equals-other-name"),
        pytest.param("name: x\n", "name: x\n", id="same-profile-twice"),
    ],
)
def test_duplicate_handler_across_files(tmp_path: Path, first: str, second: str) -> None:
    a = write(tmp_path, first, "a.yaml")
    b = write(tmp_path, second, "b.yaml")
    with pytest.raises(ProfileError) as exc:
        load_profiles([a, b])
    assert str(exc.value) == f"{b}: handler: 'x' is already defined in {a}"


def test_duplicate_handler_in_one_file(tmp_path: Path) -> None:
    a = write(tmp_path, "name: x\n---\nname: z\nhandler: x\n")
    with pytest.raises(ProfileError) as exc:
        load_profiles([a])
    assert str(exc.value) == f"{a}: handler: 'x' is already defined in {a}"


def test_default_profiles() -> None:
    assert default_profiles() == {"vmsandbox": Profile(name="vmsandbox", handler="vmsandbox")}
    assert default_profiles({"cpu_policy": "shared", "accel": "tcg"}) == {
        "vmsandbox": Profile(name="vmsandbox", handler="vmsandbox", cpu_policy="shared", accel="tcg")
    }
    with pytest.raises(ProfileError) as exc:
        default_profiles({"accel": "xen"})
    assert str(exc.value) == "(built-in): accel: must be one of auto, kvm, tcg, got 'xen'"


def test_every_problem_of_a_profile_is_reported() -> None:
    doc = {
        "name": "a",
        "handler": "A_B",
        "vcpu": {"min": 0, "max": 2000, "mxa": 1},
        "memory": {"min": 0},
        "accel": "hvf",
        "init_containers": "concurrent",
        "bogus": 1,
    }
    profile, problems = profile_problems(doc, source="inline")
    assert profile is None
    assert [p.key for p in problems] == [
        "bogus",
        "init_containers",
        "vcpu.mxa",
        "handler",
        "vcpu.min",
        "vcpu.max",
        "memory.min",
        "accel",
    ]
    with pytest.raises(ProfileError) as exc:  # the loader stops at the first; validate reports them all
        profile_from_mapping(doc, source="inline")
    assert exc.value.key == "bogus"


def test_valid_profile_has_no_problems() -> None:
    assert profile_problems({"name": "a"}, source="inline") == (Profile(name="a", handler="a"), [])


def test_valid_handlers() -> None:
    for handler in ("a", "vmsandbox", "vm-1", "0", "a" * 63):
        assert profile_from_mapping({"name": "x", "handler": handler}, source="inline").handler == handler
