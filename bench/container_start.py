"""Containers in a guest: create+start -> first log line, ExecSync round trip, agent memory.

    VMSANDBOX_IMAGE_DIR=/var/lib/vmsandbox/images/default .venv/bin/python bench/container_start.py --runs 20
    .venv/bin/python bench/container_start.py --smoke   # one run and one exec each; checks the JSON

Two paths time the same work, in this process, run by run in turn (the order turned around every
other run, so that a change in the host's load reaches both):

- **CRI** (the production path): a shim process on a private socket, a pod from a local registry
  image; CreateContainer + StartContainer until the first line is in the kubelet's log file;
  ExecSync ``true``.
- **agent** (the baseline): the pod's own guest, booted again with a bare QEMU as the pod's live
  domain says (``bench.qemu_direct.DirectGuest.from_domain_xml``: the same host CPUs, vCPUs,
  hugepage-backed memory, TCG cache, 9p security model) beside the pod, with an EROFS disk of the
  same busybox tree, driven through ``vmsandbox.adapters.agent_client`` directly: create + start
  of the OCI spec the shim sends for that container (the shim's own translation of the same
  ContainerConfig, with the pod's resolv.conf) until the first line comes back from the agent
  (``log_read``); exec ``true``.

The ratio is what the CRI layer (gRPC, records, log copy, image lookup) adds over the agent path.
Each path's time is also split: create, start, and from start's answer to the first line.
Agent memory: the agent's VmRSS in the guest, idle and with the containers running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.qemu_direct import DirectGuest, confined, percentile, qemu_argv
from bench.sandbox_start import live_xml, machine_cgroup
from bench.shim_process import shim_process
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.container_mounts import GUEST_SHARED_MOUNT
from shim.translate import inbound
from tests import interrupts
from tests.registry_kit import Layout, Registry, busybox_entries, push
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.network import DnsConfig, pod_files
from vmsandbox.oci_spec import ContainerRequest, ImageConfig, Mount, UserIds, build_spec

IMAGE_DIR = os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default")
SCRIPT = ["sh", "-c", "echo ready; sleep 600"]


def _stats(samples: list[float], *qs: int) -> dict[str, object]:
    return {f"p{q}_ms": round(percentile(samples, q) * 1000, 1) for q in qs} | {
        "samples_ms": [round(s * 1000, 1) for s in samples]
    }


def _wait_line(path: Path, deadline: float) -> None:
    while True:
        try:
            if b"\n" in path.read_bytes():
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no log line in {path}")
        time.sleep(0.005)


ROOTFS_DESIGNS = ("9p", "erofs", "ext4")
"""How the agent baseline's rootfs reaches the guest: a 9p export (the host tree), or a read-only
virtio-blk disk made from the same tree (EROFS with ``mkfs.erofs``, ext4 with ``mkfs.ext4 -d``)."""
BASELINE_DESIGN = "erofs"
"""The rootfs design the shim uses, which the agent baseline therefore uses too."""
SMALL_FILES, SMALL_DIRS, SMALL_BYTES, BIG_MIB = 3000, 30, 2048, 64
READ_SMALL = ["sh", "-c", "find /data/small -type f -exec cat {} + >/dev/null"]
READ_BIG = ["sh", "-c", "cat /data/big >/dev/null"]


def _rootfs_tree(rootfs: Path, *, data: bool) -> None:
    """busybox with the applets the runs use; with ``data``, ``/data/small`` (SMALL_FILES files of
    SMALL_BYTES in SMALL_DIRS directories) and ``/data/big`` (BIG_MIB MiB) for the file-heavy read."""
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "bin/busybox").write_bytes(Path("/bin/busybox").read_bytes())
    (rootfs / "bin/busybox").chmod(0o755)
    for applet in ("sh", "echo", "sleep", "true", "cat", "find"):
        (rootfs / "bin" / applet).symlink_to("busybox")
    if not data:
        return
    for i in range(SMALL_FILES):
        d = rootfs / "data" / "small" / f"d{i % SMALL_DIRS:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:05d}").write_bytes(os.urandom(SMALL_BYTES))
    with open(rootfs / "data" / "big", "wb") as f:
        for _ in range(BIG_MIB):
            f.write(os.urandom(1 << 20))


def _disk(design: str, tree: Path, out: Path) -> None:
    if design == "erofs":
        argv = ["mkfs.erofs", "--quiet", "--all-root", "-T0", str(out), str(tree)]
    else:
        size_mib = 64 + sum(p.stat().st_size for p in tree.rglob("*") if p.is_file()) * 3 // 2 // (1 << 20)
        argv = ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "root_owner=0:0", "-d", str(tree), str(out)]
        argv.append(f"{size_mib}M")
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def _timed_exec(agent: AgentClient, cid: str, argv: list[str]) -> float:
    t0 = time.monotonic()
    res = agent.exec(cid, argv, timeout_s=600)
    took = time.monotonic() - t0
    if res.exit_code != 0:
        raise SystemExit(f"{argv} exited {res.exit_code}: {res.stderr[:500]!r}")
    return took


def agent_path(
    tmp: Path, runs: int, exec_runs: int, *, design: str = "9p", image_dir: str = IMAGE_DIR, data: bool = False
) -> dict[str, object]:
    """The agent's own create+start (and exec, file reads with ``data``) on a bare QEMU, with the
    rootfs as ``design`` says."""
    shared = tmp / "shared"
    shared.mkdir(parents=True)
    tree = shared / "rootfs" if design == "9p" else tmp / "rootfs"
    _rootfs_tree(tree, data=data)
    disks: list[tuple[str, str]] = []
    lower = "shared/rootfs"
    if design != "9p":
        _disk(design, tree, tmp / "rootfs.img")
        disks, lower = [(str(tmp / "rootfs.img"), "benchrootfs")], "disks/benchrootfs"
    sock = str(tmp / "agent.sock")
    guest = DirectGuest.from_image(image_dir, vcpus=1, mem_mib=256)
    argv = qemu_argv(guest, sock, shared_dir=str(shared), disks=disks)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reads: dict[str, list[float]] = {}
    try:
        with AgentClient.open(sock, 120) as agent:
            idle_rss = int(str(agent.request("stats", {"id": ""}, 30).get("agent_rss_bytes", 0)))
            spec = build_spec(ContainerRequest(command=tuple(SCRIPT)), ImageConfig(), UserIds(0, 0))
            start_s = []
            for i in range(runs):
                cid = f"bench{i}"
                t0 = time.monotonic()
                agent.create(cid, lower=lower, spec=spec)
                agent.start(cid)
                while b"\n" not in agent.log_read(cid, 0, 65536, 60).data:
                    if time.monotonic() > t0 + 60:
                        raise SystemExit(f"no log line from {cid}")
                start_s.append(time.monotonic() - t0)
                if i < runs - 1:
                    agent.delete(cid)
            last = f"bench{runs - 1}"
            exec_s = []
            for _ in range(exec_runs):
                t0 = time.monotonic()
                agent.exec(last, ["true"], timeout_s=30)
                exec_s.append(time.monotonic() - t0)
            if data:  # the first read of each is cold (nothing cached in the guest yet)
                reads = {"small": [], "big": []}
                for _ in range(3):
                    reads["small"].append(_timed_exec(agent, last, READ_SMALL))
                    reads["big"].append(_timed_exec(agent, last, READ_BIG))
            busy_rss = int(str(agent.request("stats", {"id": ""}, 30).get("agent_rss_bytes", 0)))
    finally:
        proc.kill()
        proc.wait()
    return {"start": start_s, "exec": exec_s, "idle_rss": idle_rss, "busy_rss": busy_rss, "reads": reads}


def _ctr_config(i: int, ref: str) -> pb.ContainerConfig:
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=f"c{i}"), image=pb.ImageSpec(image=ref), command=SCRIPT, log_path=f"c{i}.log"
    )


def _shim_spec(config: pb.ContainerConfig, shared: Path) -> dict[str, object]:
    """The OCI spec the shim sends its guest for ``config`` in the bench's pod (no DNS settings, no
    hostname, no mounts of its own): its own translation, and the pod's resolv.conf (the host's),
    written into ``shared`` as the shim writes it into the pod's shared directory."""
    run, _, _ = inbound.container_request(config, {})
    resolv = pod_files(DnsConfig(), "", Path("/etc/resolv.conf").read_text())["/etc/resolv.conf"]
    (shared / "pod").mkdir(parents=True, exist_ok=True)
    (shared / "pod" / "resolv.conf").write_text(resolv)
    mount = Mount("/etc/resolv.conf", f"{GUEST_SHARED_MOUNT}/pod/resolv.conf", readonly=True)
    return build_spec(replace(run, mounts=(mount,)), ImageConfig(), UserIds(0, 0))


class _Split:
    """One path's samples: create+start to the first line, and its three parts."""

    def __init__(self) -> None:
        self.total: list[float] = []
        self.parts: dict[str, list[float]] = {"create": [], "start": [], "first_line": []}
        self.exec: list[float] = []

    def add(self, t0: float, created: float, started: float, line: float) -> None:
        self.total.append(line - t0)
        self.parts["create"].append(created - t0)
        self.parts["start"].append(started - created)
        self.parts["first_line"].append(line - started)


def paired(tmp: Path, runs: int, exec_runs: int) -> dict[str, Any]:
    """The CRI path and the agent baseline on a copy of the pod's guest, run by run in turn."""
    cri, base = _Split(), _Split()
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        layout.tag("bb", layout.image([layout.layer(busybox_entries(("sh", "echo", "sleep", "true")))]))
        ref = f"{registry.host}/bench/busybox:1"
        push(layout, "bb", ref)
        profile = tmp / "profile.yaml"
        profile.write_text(json.dumps({"name": "vmsandbox", "handler": "vmsandbox", "guest": {"image_dir": IMAGE_DIR}}))
        with shim_process(tmp / "shim", "--profile", str(profile)) as rt:
            with grpc.insecure_channel(f"unix:{tmp / 'shim' / 'cri.sock'}") as channel:
                pb_grpc.ImageServiceStub(channel).PullImage(
                    pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300
                )
            logs = tmp / "logs"
            config = pb.PodSandboxConfig(
                metadata=pb.PodSandboxMetadata(name="bench", namespace="bench", uid=str(uuid.uuid4())),
                log_directory=str(logs),
                linux=pb.LinuxPodSandboxConfig(resources=pb.LinuxContainerResources(memory_limit_in_bytes=192 << 20)),
            )
            sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            status = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=30)
            domain = json.loads(status.info["info"])["domain"]
            guest = DirectGuest.from_domain_xml(live_xml(domain), cgroup_parent=machine_cgroup())
            with _direct_agent(tmp / "agent", replace(guest, shares=())) as (agent, shared, lower):
                spec = _shim_spec(_ctr_config(0, ref), shared)
                last = ""

                def cri_run(i: int) -> None:
                    nonlocal last
                    t0 = time.monotonic()
                    ctr = _ctr_config(i, ref)
                    req = pb.CreateContainerRequest(pod_sandbox_id=sid, config=ctr, sandbox_config=config)
                    cid = rt.CreateContainer(req, timeout=120).container_id
                    created = time.monotonic()
                    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
                    started = time.monotonic()
                    _wait_line(logs / f"c{i}.log", t0 + 60)
                    cri.add(t0, created, started, time.monotonic())
                    if i < runs - 1:
                        rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=120)
                    last = cid

                def agent_run(i: int) -> None:
                    cid = f"bench{i}"
                    t0 = time.monotonic()
                    agent.create(cid, lower=lower, spec=spec)
                    created = time.monotonic()
                    agent.start(cid)
                    started = time.monotonic()
                    while b"\n" not in agent.log_read(cid, 0, 65536, 60).data:
                        if time.monotonic() > t0 + 60:
                            raise SystemExit(f"no log line from {cid}")
                    base.add(t0, created, started, time.monotonic())
                    if i < runs - 1:
                        agent.delete(cid)

                for i in range(runs):
                    for run in (cri_run, agent_run) if i % 2 else (agent_run, cri_run):
                        run(i)
                idle_rss = int(str(agent.request("stats", {"id": ""}, 30).get("agent_rss_bytes", 0)))
                for i in range(exec_runs):
                    for which in ("cri", "agent") if i % 2 else ("agent", "cri"):
                        t0 = time.monotonic()
                        if which == "cri":
                            req = pb.ExecSyncRequest(container_id=last, cmd=["true"], timeout=30)
                            rt.ExecSync(req, timeout=60)
                            cri.exec.append(time.monotonic() - t0)
                        else:
                            agent.exec(f"bench{runs - 1}", ["true"], timeout_s=30)
                            base.exec.append(time.monotonic() - t0)
                busy_rss = int(str(agent.request("stats", {"id": ""}, 30).get("agent_rss_bytes", 0)))
            rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    finally:
        registry.stop()
    return {"cri": cri, "agent": base, "idle_rss": idle_rss, "busy_rss": busy_rss, "guest": guest}


@contextmanager
def _direct_agent(tmp: Path, guest: DirectGuest) -> Iterator[tuple[AgentClient, Path, str]]:
    """A bare QEMU of ``guest`` (confined as it says) with a shared directory and an EROFS disk of
    the busybox tree; yields its agent, the shared directory and the agent's ``lower`` for the disk."""
    shared = tmp / "shared"
    shared.mkdir(parents=True)
    _rootfs_tree(tmp / "rootfs", data=False)
    _disk("erofs", tmp / "rootfs", tmp / "rootfs.img")
    sock = str(tmp / "agent.sock")
    argv = qemu_argv(guest, sock, shared_dir=str(shared), disks=[(str(tmp / "rootfs.img"), "benchrootfs")])
    with confined(guest) as confine:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=confine
        )
        try:
            with AgentClient.open(sock, 120) as agent:
                yield agent, shared, "disks/benchrootfs"
        finally:
            proc.kill()
            proc.wait()


def _timings(*qs: int) -> dict[str, Any]:
    return {f"p{q}_ms": smoke.POSITIVE for q in qs} | {"samples_ms": smoke.Each(smoke.POSITIVE)}


SHAPE: dict[str, Any] = {
    "benchmark": "container_start",
    "image_dir": smoke.TEXT,
    "runs": smoke.COUNT,
    "exec_runs": smoke.COUNT,
    "load_avg_1m": smoke.NON_NEGATIVE,
    "agent_baseline_guest": {
        "vcpus": smoke.COUNT,
        "host_cpus": smoke.Each(smoke.NON_NEGATIVE),
        "hugepages": smoke.BOOL,
    },
    "create_start_first_log_line": {
        "cri": _timings(50, 95),
        "agent_baseline": _timings(50, 95),
        "ratio_p50": smoke.POSITIVE,
        "split_p50_ms": {
            "cri": {"create": smoke.POSITIVE, "start": smoke.POSITIVE, "first_line": smoke.POSITIVE},
            "agent_baseline": {"create": smoke.POSITIVE, "start": smoke.POSITIVE, "first_line": smoke.POSITIVE},
        },
    },
    "exec_sync_round_trip": {"cri": _timings(50, 99), "agent_baseline": _timings(50, 99), "ratio_p50": smoke.POSITIVE},
    "agent_rss_mib": {"idle": smoke.POSITIVE, "with_containers": smoke.POSITIVE},
    "rootfs_designs": smoke.Keyed(
        {
            "image_dir": smoke.TEXT,
            "create_start_first_log_line": _timings(50, 95),
            "exec_true_p50_ms": smoke.POSITIVE,
            "read_small_files_ms": {"cold": smoke.POSITIVE, "warm": smoke.POSITIVE},
            "read_big_file_ms": {"cold": smoke.POSITIVE, "warm": smoke.POSITIVE},
        }
    ),
}


def _design(text: str) -> tuple[str, str]:
    name, _, image_dir = text.partition("=")
    if name not in ROOTFS_DESIGNS:
        raise argparse.ArgumentTypeError(f"design must be one of {', '.join(ROOTFS_DESIGNS)}, got {name!r}")
    return name, image_dir or IMAGE_DIR


def _design_figures(image_dir: str, got: dict[str, object]) -> dict[str, object]:
    reads = got["reads"]
    start, exec_s = got["start"], got["exec"]
    assert isinstance(reads, dict) and isinstance(start, list) and isinstance(exec_s, list)

    def cold_warm(samples: list[float]) -> dict[str, float]:
        return {"cold": round(samples[0] * 1000, 1), "warm": round(percentile(samples[1:], 50) * 1000, 1)}

    return {
        "image_dir": image_dir,
        "create_start_first_log_line": _stats(start, 50, 95),
        "exec_true_p50_ms": round(percentile(exec_s, 50) * 1000, 1),
        "read_small_files_ms": cold_warm(reads["small"]),
        "read_big_file_ms": cold_warm(reads["big"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--exec-runs", type=int, default=50)
    parser.add_argument(
        "--smoke", action="store_true", help="one run and one exec each; check the JSON, exit 1 if wrong"
    )
    parser.add_argument(
        "--design",
        type=_design,
        action="append",
        metavar="NAME[=IMAGE_DIR]",
        help=f"a rootfs design to time the agent path and a file-heavy read with ({', '.join(ROOTFS_DESIGNS)}; "
        "ext4 needs a guest image with the ext4 module); default: 9p and erofs",
    )
    parser.add_argument("--design-runs", type=int, default=5, help="create+start runs per design")
    args = parser.parse_args()
    designs = args.design or [("9p", IMAGE_DIR), ("erofs", IMAGE_DIR)]
    if args.smoke:
        args.runs, args.exec_runs, args.design_runs = 1, 1, 1
    if args.runs < 1 or args.exec_runs < 1:
        parser.error("--runs and --exec-runs must be at least 1")
    smoke.require(smoke.missing_guest_host(), smoke.missing_image_tools(), smoke.missing_tools("qemu-system-x86_64"))
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-ctr-") as tmp:
        (Path(tmp) / "pair" / "shim").mkdir(parents=True)
        got = paired(Path(tmp) / "pair", args.runs, args.exec_runs)
        per_design = {}
        for name, image_dir in designs:
            (Path(tmp) / name).mkdir()
            figures = agent_path(Path(tmp) / name, args.design_runs, 3, design=name, image_dir=image_dir, data=True)
            per_design[name] = _design_figures(image_dir, figures)
    cri, base, guest = got["cri"], got["agent"], got["guest"]

    def split(path: _Split) -> dict[str, float]:
        return {k: round(percentile(v, 50) * 1000, 1) for k, v in path.parts.items()}

    result = {
        "benchmark": "container_start",
        "image_dir": IMAGE_DIR,
        "runs": args.runs,
        "exec_runs": args.exec_runs,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "agent_baseline_guest": {
            "vcpus": guest.vcpus,
            "host_cpus": list(guest.host_cpus),
            "hugepages": guest.hugepages_dir is not None,
        },
        "create_start_first_log_line": {
            "cri": _stats(cri.total, 50, 95),
            "agent_baseline": _stats(base.total, 50, 95),
            "ratio_p50": round(percentile(cri.total, 50) / percentile(base.total, 50), 3),
            "split_p50_ms": {"cri": split(cri), "agent_baseline": split(base)},
        },
        "exec_sync_round_trip": {
            "cri": _stats(cri.exec, 50, 99),
            "agent_baseline": _stats(base.exec, 50, 99),
            "ratio_p50": round(percentile(cri.exec, 50) / percentile(base.exec, 50), 3),
        },
        "agent_rss_mib": {
            "idle": round(int(str(got["idle_rss"])) / (1 << 20), 1),
            "with_containers": round(int(str(got["busy_rss"])) / (1 << 20), 1),
        },
        "rootfs_designs": per_design,
    }
    smoke.report(result, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
