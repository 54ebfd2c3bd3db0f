"""Sandbox start latency: RunPodSandbox -> READY through the real socket, by restore from the
shape's snapshot and by cold boot, beside a direct ``qemu-system-x86_64`` cold boot of exactly the
guest the shim booted (kernel, initramfs, command line, memory and its hugepage backing, host
CPUs, TCG translation-cache size, read from the live domain), the three interleaved in one run
(the machines are shared and noisy: only ratios measured together mean anything). The snapshot is
made first, by the shim, when the first pod of the shape starts.

    .venv/bin/python bench/sandbox_start.py --runs 5
    .venv/bin/python bench/sandbox_start.py --smoke   # one run of each; checks the JSON

prints one JSON document: p50/p95 of the three, the restore's ratio to the direct boot
(``ratio_restore_*``, target <= 0.12) and the cold boot's (``ratio_*``, target <= 1.10), where a
restore's time goes (image copy, libvirt restore, personalize), the snapshot's size and making
time, where each cold start's time goes (define, libvirt start, guest boot, agent hello), the
part of libvirt's start no domain XML can avoid (its guest-CPU readback, replayed against a bare
paused QEMU), and QEMU's resident memory beyond guest RAM per pod, restored and cold-booted, TCG
translation cache included (target <= 64 MiB under TCG).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.cpu_readback import measure as measure_cpu_readback
from bench.qemu_direct import DirectGuest, boot_direct, percentile, qemu_memory_kib
from bench.shim_process import shim_process
from gen.cri.apimachinery.resource.generated_pb2 import Quantity
from gen.cri.runtime.v1 import api_pb2 as pb
from tests import interrupts

LIBVIRT_URI = "qemu:///system"  # the shim's default
IMAGE_DIR = os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default")
COLD, RESTORE = "vmsandbox", "restore"  # handlers: snapshots off, snapshots on
SNAPSHOT_WAIT_S = 300


def write_profiles(path: Path) -> None:
    guest = {"image_dir": IMAGE_DIR}
    docs = [
        {"name": COLD, "handler": COLD, "snapshots": False, "guest": guest},
        {"name": RESTORE, "handler": RESTORE, "snapshots": True, "guest": guest},
    ]
    path.write_text("\n---\n".join(json.dumps(d) for d in docs))


RESTORE_LINE = re.compile(
    r"sandbox (?P<sid>[0-9a-f]{12}) restore from snapshot [0-9a-f]{12}: "
    r"copy (?P<copy>\d+) ms, libvirt restore (?P<restore>\d+) ms, personalize (?P<personalize>\d+) ms"
)


def restore_phases(shim_log: Path, sandbox_id: str) -> dict[str, int]:
    for m in RESTORE_LINE.finditer(shim_log.read_text(errors="replace")):
        if m["sid"] == sandbox_id[:12]:
            return {k: int(m[k]) for k in ("copy", "restore", "personalize")}
    raise RuntimeError(f"no restore line for {sandbox_id[:12]} in {shim_log} (was it restored?)")


def snapshot_made(state_dir: Path) -> dict[str, Any] | None:
    """The one snapshot in the shim's store (read as ``vmsandbox snapshot list`` does), or None."""
    from cli.snapshot_cmd import listing

    found = listing(str(state_dir))
    if not found:
        return None
    return {"size_mib": round(found[0].size_bytes / 2**20, 1), "make_s": found[0].make_ms / 1000}


def pod(cpu: str, memory: str) -> pb.PodSandboxConfig:
    res = pb.KubernetesResources(
        requests={"cpu": Quantity(string=cpu), "memory": Quantity(string=memory)},
        limits={"cpu": Quantity(string=cpu), "memory": Quantity(string=memory)},
    )
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="bench", namespace="bench", uid=str(uuid.uuid4())),
        pod_resources=pb.PodResourceConfig(
            containers=[pb.ContainerResourceConfig(name="app", kubernetes_resources=res)]
        ),
    )


BOOT_LINE = re.compile(
    r"sandbox (?P<sid>[0-9a-f]{12}) boot: "
    r"define (?P<define>\d+) ms, start (?P<start>\d+) ms, guest hello (?P<hello>\d+) ms"
)


def vmm_rss_kib(domain: str) -> dict[str, int]:
    """QEMU's resident memory, none of it guest RAM (hugetlb pages are not in VmRSS)."""
    return qemu_memory_kib(int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text()))


def live_xml(domain: str) -> str:
    import libvirt

    conn = libvirt.openReadOnly(LIBVIRT_URI)
    try:
        return str(conn.lookupByName(domain).XMLDesc(0))
    finally:
        conn.close()


STACK_SHAPE = {"libvirt": smoke.TEXT, "qemu": smoke.TEXT}


def stack_versions() -> dict[str, str]:
    """The versions of the libvirt daemon behind ``LIBVIRT_URI`` and of its QEMU ("11.3.0", "10.0.2")."""
    import libvirt

    def dotted(v: int) -> str:
        return f"{v // 1_000_000}.{v // 1000 % 1000}.{v % 1000}"

    conn = libvirt.openReadOnly(LIBVIRT_URI)
    try:
        return {"libvirt": dotted(conn.getLibVersion()), "qemu": dotted(conn.getVersion())}
    finally:
        conn.close()


def machine_cgroup() -> str | None:
    """libvirt's machine partition in the CPU controller (cgroup v1 or v2), where its guests run."""
    for path in ("/sys/fs/cgroup/cpu/machine", "/sys/fs/cgroup/machine"):
        if Path(path).is_dir():
            return path
    return None


def phases(shim_log: Path, sandbox_id: str) -> dict[str, int]:
    """The shim's own split of one start (its "boot:" log line): define, start, hello wait, in ms."""
    for m in BOOT_LINE.finditer(shim_log.read_text(errors="replace")):
        if m["sid"] == sandbox_id[:12]:
            return {k: int(m[k]) for k in ("define", "start", "hello")}
    raise RuntimeError(f"no boot line for {sandbox_id[:12]} in {shim_log}")


def stats(samples: list[float], digits: int = 3) -> dict[str, Any]:
    return {
        "p50": round(percentile(samples, 50), digits),
        "p95": round(percentile(samples, 95), digits),
        "samples": [round(x, digits) for x in samples],
    }


def _stats_shape(kind: smoke.Kind = smoke.POSITIVE) -> dict[str, Any]:
    return {"p50": kind, "p95": kind, "samples": smoke.Each(kind)}


_MEMORY = {k: _stats_shape() for k in ("private", "shared_file", "rss")}
SHAPE: dict[str, Any] = {
    "benchmark": "sandbox_start",
    "runs": smoke.COUNT,
    "load_avg_1m": smoke.NON_NEGATIVE,
    "stack": STACK_SHAPE,
    "guest": {
        "vcpus": smoke.COUNT,
        "memory_mib": smoke.COUNT,
        "hugepage_backed": smoke.BOOL,
        "tcg_tb_cache_mib": smoke.Maybe(smoke.COUNT),
        "host_cpus": smoke.Each(smoke.NON_NEGATIVE),
        "direct_cgroup_parent": smoke.Maybe(smoke.TEXT),
        "kernel": smoke.TEXT,
        "initrd": smoke.TEXT,
        "cmdline": smoke.TEXT,
        "shape_memory_mib": smoke.COUNT,
    },
    "restore_s": _stats_shape(),
    "ratio_restore_p50": smoke.POSITIVE,
    "ratio_restore_p95": smoke.POSITIVE,
    "target_restore_ratio": 0.12,
    "restore_split_s": smoke.Keyed(_stats_shape(smoke.FINITE), frozenset(("copy", "restore", "personalize", "other"))),
    "snapshot": {"size_mib": smoke.POSITIVE, "make_s": smoke.POSITIVE},
    "sandbox_s": _stats_shape(),
    "direct_qemu_s": _stats_shape(),
    "ratio_p50": smoke.POSITIVE,
    "ratio_p95": smoke.POSITIVE,
    "target_ratio": 1.10,
    "libvirt_cpu_readback": {"qmp_commands": smoke.COUNT, "seconds": _stats_shape()},
    "ratio_p50_without_cpu_readback": smoke.POSITIVE,
    # each part is measured apart (libvirt's and the guest's clocks), so noise can make a small one negative
    "sandbox_split_s": smoke.Keyed(
        _stats_shape(smoke.FINITE), frozenset(("define", "start", "guest_boot", "agent_hello", "rpc_other"))
    ),
    "direct_split_s": smoke.Keyed(_stats_shape(smoke.FINITE), frozenset(("spawn_to_guest", "guest_boot"))),
    "vmm_memory_beyond_guest_mib": {
        "restored": _MEMORY,
        "sandbox": _MEMORY,
        "direct": _MEMORY,
        "tcg_tb_cache_mib": smoke.Maybe(smoke.COUNT),
        "target": 64,
    },
}


def timed_run(rt: Any, handler: str, args: argparse.Namespace) -> tuple[str, float, dict[str, Any]]:
    """RunPodSandbox of the benchmark's pod (``pod_arguments``' ``--cpu`` and ``--memory``) on
    ``handler``: its id, the seconds it took, and its verbose status's info."""
    start = time.monotonic()
    request = pb.RunPodSandboxRequest(config=pod(args.cpu, args.memory), runtime_handler=handler)
    sid = rt.RunPodSandbox(request, timeout=300).pod_sandbox_id
    total = time.monotonic() - start
    status = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=30)
    return sid, total, json.loads(status.info["info"])


def remove_pod(rt: Any, sid: str) -> None:
    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)


def pod_arguments(doc: str) -> argparse.Namespace:
    """The command line of the benchmarks that start one pod's guest per run (this one and
    ``bench/restore_floor.py``): ``--runs``, the pod's ``--cpu`` and ``--memory``, ``--smoke``;
    exits naming what the host lacks to run them."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cpu", default="1")
    parser.add_argument("--memory", default="192Mi", help="pod memory; the profile adds 64Mi guest overhead")
    parser.add_argument("--smoke", action="store_true", help="one run of each; check the JSON, exit 1 if wrong")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    smoke.require(smoke.missing_guest_host(), smoke.missing_tools("qemu-system-x86_64"))
    return args


def main() -> int:
    args = pod_arguments(__doc__ or "")
    sandbox_s: list[float] = []
    direct_s: list[float] = []
    split: dict[str, list[float]] = {k: [] for k in ("define", "start", "guest_boot", "agent_hello", "rpc_other")}
    direct_split: dict[str, list[float]] = {k: [] for k in ("spawn_to_guest", "guest_boot")}
    readback_s: list[float] = []
    readback_commands = 0
    mem_pod: dict[str, list[float]] = {"private": [], "shared_file": [], "rss": []}
    mem_direct: dict[str, list[float]] = {"private": [], "shared_file": [], "rss": []}

    def add_memory(into: dict[str, list[float]], kib: dict[str, int]) -> None:
        into["private"].append(kib["RssAnon"] / 1024)
        into["shared_file"].append(kib["RssFile"] / 1024)
        into["rss"].append(kib["VmRSS"] / 1024)

    guest: DirectGuest | None = None
    shape: dict[str, Any] = {}

    def direct() -> None:
        nonlocal readback_commands
        assert guest is not None
        boot = boot_direct(guest)
        direct_s.append(boot.seconds)
        direct_split["guest_boot"].append(boot.guest_boot_ms / 1000)
        direct_split["spawn_to_guest"].append(boot.seconds - boot.guest_boot_ms / 1000)
        add_memory(mem_direct, boot.memory_kib)
        readback = measure_cpu_readback(guest)
        readback_s.append(readback.seconds)
        readback_commands = readback.commands

    restore_s: list[float] = []
    restore_split: dict[str, list[float]] = {k: [] for k in ("copy", "restore", "personalize", "other")}
    mem_restored: dict[str, list[float]] = {"private": [], "shared_file": [], "rss": []}
    snapshot: dict[str, Any] | None = None

    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-") as tmp:
        profiles = Path(tmp) / "profiles.yaml"
        write_profiles(profiles)
        with shim_process(tmp, "--profile", str(profiles)) as rt:

            def run(handler: str) -> tuple[str, float, dict[str, Any]]:
                return timed_run(rt, handler, args)

            def remove(sid: str) -> None:
                remove_pod(rt, sid)

            def cold() -> None:
                nonlocal guest, shape
                sid, total, info = run(COLD)
                sandbox_s.append(total)
                shape = info["shape"]
                add_memory(mem_pod, vmm_rss_kib(info["domain"]))
                guest = DirectGuest.from_domain_xml(live_xml(info["domain"]), cgroup_parent=machine_cgroup())
                ph = phases(Path(tmp) / "shim.log", sid)
                guest_boot = int(info["guest"]["boot_ms"]) / 1000
                split["define"].append(ph["define"] / 1000)
                split["start"].append(ph["start"] / 1000)
                split["guest_boot"].append(guest_boot)
                split["agent_hello"].append(ph["hello"] / 1000 - guest_boot)
                split["rpc_other"].append(total - sum(ph.values()) / 1000)
                remove(sid)

            def restored() -> None:
                sid, total, info = run(RESTORE)
                if info["guest"].get("start", {}).get("by") != "restore":
                    raise SystemExit(f"pod {sid[:12]} was not restored: {info['guest'].get('start')}")
                restore_s.append(total)
                add_memory(mem_restored, vmm_rss_kib(info["domain"]))
                ph = restore_phases(Path(tmp) / "shim.log", sid)
                for k in ("copy", "restore", "personalize"):
                    restore_split[k].append(ph[k] / 1000)
                restore_split["other"].append(total - sum(ph.values()) / 1000)
                remove(sid)

            # the first pod of the restore handler cold-boots; its snapshot is made once it is READY
            first, _, _ = run(RESTORE)
            deadline = time.monotonic() + SNAPSHOT_WAIT_S
            while (snapshot := snapshot_made(Path(tmp) / "state")) is None:
                failed = re.search(r"snapshot [0-9a-f]{12} not made.*", (Path(tmp) / "shim.log").read_text())
                if failed or time.monotonic() > deadline:
                    why = failed[0] if failed else f"none within {SNAPSHOT_WAIT_S} s"
                    raise SystemExit(f"the shim made no snapshot: {why} (guest image: {IMAGE_DIR})")
                time.sleep(0.5)
            remove(first)
            cold()  # first: the direct boot copies the guest the shim cold-boots
            for i in range(args.runs):  # interleaved, the order turned around every other run
                for step in [restored, direct, cold] if i % 2 else [direct, restored, cold]:
                    if step is not cold or i > 0:  # run 0's cold boot is the one above
                        step()
    assert guest is not None
    assert snapshot is not None
    p50_s, p50_d = percentile(sandbox_s, 50), percentile(direct_s, 50)
    p50_readback = percentile(readback_s, 50)
    result = {
        "benchmark": "sandbox_start",
        "runs": args.runs,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "stack": stack_versions(),
        "guest": {
            "vcpus": guest.vcpus,
            "memory_mib": guest.mem_mib,
            "hugepage_backed": guest.hugepages_dir is not None,
            "tcg_tb_cache_mib": guest.tb_cache_mib,
            "host_cpus": list(guest.host_cpus),
            "direct_cgroup_parent": guest.cgroup_parent,
            "kernel": guest.kernel,
            "initrd": guest.initrd,
            "cmdline": guest.cmdline,
            "shape_memory_mib": int(shape.get("memory_bytes", 0)) >> 20,
        },
        "restore_s": stats(restore_s),
        "ratio_restore_p50": round(percentile(restore_s, 50) / p50_d, 3),
        "ratio_restore_p95": round(percentile(restore_s, 95) / percentile(direct_s, 95), 3),
        "target_restore_ratio": 0.12,
        # a restore = copy (the snapshot's image, its header retargeted to the pod's domain) + restore
        # (libvirt: QEMU spawn, loading the saved state into the pod's hugepages, cont) + personalize
        # (agent connection, reseed, clock, hostname, NIC) + other (sizing, placement, ledger, define, gRPC)
        "restore_split_s": {k: stats(v) for k, v in restore_split.items()},
        "snapshot": snapshot,
        "sandbox_s": stats(sandbox_s),
        "direct_qemu_s": stats(direct_s),
        "ratio_p50": round(p50_s / p50_d, 3),
        "ratio_p95": round(percentile(sandbox_s, 95) / percentile(direct_s, 95), 3),
        "target_ratio": 1.10,
        # libvirt 9.0 reads the guest CPU back before `cont` (one QMP qom-get per CPU feature flag,
        # bench/cpu_readback.py), inside "start" below; replayed against a bare paused QEMU of the same
        # guest, its cost here and the ratio the start would have without it
        "libvirt_cpu_readback": {"qmp_commands": readback_commands, "seconds": stats(readback_s)},
        "ratio_p50_without_cpu_readback": round((p50_s - p50_readback) / p50_d, 3),
        # RunPodSandbox = define + start (libvirt: QEMU spawn, QMP, cgroups, cont) + guest_boot (the
        # guest's uptime at hello) + agent_hello (start returned -> hello, beyond the guest's uptime)
        # + rpc_other (sizing, placement, ledger, gRPC)
        "sandbox_split_s": {k: stats(v) for k, v in split.items()},
        # direct: spawn_to_guest (QEMU start-up until the guest kernel's clock starts) + guest_boot
        "direct_split_s": {k: stats(v) for k, v in direct_split.items()},
        # at hello, per QEMU: private (anonymous: TCG translation cache, device state, heap) is what
        # each pod costs; shared_file is page cache (QEMU's binary and libraries, the mapped kernel)
        # that every guest of the same image shares
        "vmm_memory_beyond_guest_mib": {
            "restored": {k: stats(v, 1) for k, v in mem_restored.items()},
            "sandbox": {k: stats(v, 1) for k, v in mem_pod.items()},
            "direct": {k: stats(v, 1) for k, v in mem_direct.items()},
            "tcg_tb_cache_mib": guest.tb_cache_mib,
            "target": 64,
        },
    }
    smoke.report(result, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
