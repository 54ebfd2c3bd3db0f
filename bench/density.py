"""Density: idle VM pods of the smallest profile started one after another through the CRI socket
until the shim's ledger refuses the next one, their host memory per pod and start times, beside
the same number of runc pods started through the same socket.

    .venv/bin/python bench/density.py                   # VM memory capacity 1984Mi: 15 pods of 128 MiB
    .venv/bin/python bench/density.py --capacity 4Gi    # any capacity (the run's length grows with it)
    .venv/bin/python bench/density.py --smoke           # capacity 448Mi: 3 pods; checks the JSON

Set-up, as on a node that shares its runtime with ordinary pods: a local registry serves one
busybox image (``sleep``, ``true``); a containerd of the run's own (``scripts/containerd.sh``,
Debian's containerd and runc, that image as its sandbox image) is the downstream of a real shim
process (``bench/shim_process.py``: the shim and its front on the CRI socket, no pod network) whose
only profile is ``small`` from ``deploy/profiles.yaml`` (``PROFILE``: shared CPUs, guest RAM of
ordinary 4 KiB pages, the smallest guest of the sample profiles: memory.min 128Mi), its guest
image ``VMSANDBOX_IMAGE_DIR``, every host CPU its shared pool.

**Capacity.** The ledger counts the ordinary memory guests may take per NUMA node: MemTotal less
the hugepage pools less ``memory_reserved`` (``shim/config.py``). The run sets ``memory_reserved``
so that this capacity is ``--capacity`` on the first node (``0`` on any other), so that the run
ends in minutes on a 24 GiB host: 1984Mi by default, 448Mi with ``--smoke`` (15.5 and 3.5 guests of
128 MiB). The capacity the shim's ledger then reports (its ``vmsandbox_memory_bytes`` metric) is
in the JSON beside the configured one, with what it held and had free when it refused.

**VM pods.** One pod first, untimed and removed again, so that the shim makes the shape's snapshot
(``SNAPSHOT_WAIT_S``) and the timed pods start as every later pod of a node does (by restore; each
pod's ``by`` says how it started); its QEMU's memory, measured as below once the snapshot is
made, is reported apart (``first_pod_cold_booted``), since a restore brings back every page the
snapshot's guest had touched. Then pod after pod, each declaring ``POD_RESOURCES`` (guest RAM
64Mi + the profile's 64Mi overhead = its memory.min, 128 MiB) with one container of the image's
``sleep``: RunPodSandbox + CreateContainer + StartContainer is its start time, and it is
counted only once its container is running (ContainerStatus RUNNING) and answers ExecSync
``true`` with exit 0. The loop ends when RunPodSandbox answers RESOURCE_EXHAUSTED from placement
(``cannot place the VM`` ... memory): the ledger's own answer; any other failure ends the run.
After ``--settle`` seconds idle, each QEMU's memory is read from ``/proc/<pid>/smaps_rollup``
(``vmsandbox/qemu_memory.py``) and ``/proc/<pid>/smaps``:

- guest RAM resident: the resident KiB of the anonymous mapping that backs guest RAM (the guest's
  pages it has touched; ordinary memory, so not all 128 MiB);
- VMM private: QEMU's ``Anonymous`` less that mapping's (what ``bench/vmm_memory.py`` measures:
  TCG translation cache, device state, heap, thread stacks);
- file PSS: the rest of QEMU's ``Pss`` (its share of the page cache of its binary, libraries and
  the guest kernel it read, which every pod of the host shares);
- the shim's share: the growth of the shim's and its front's RSS from before the first timed pod
  to after the last, divided by the pods.

Host memory per idle pod = QEMU's PSS (guest RAM resident + VMM private + file PSS) + the shim's
share. libvirtd's RSS growth per pod is reported beside it, not in it (libvirtd here also serves
every other guest of the host, so its growth is not this run's alone).

**runc pods.** The VM pods are removed, then as many runc pods (the default handler, which the
shim routes to containerd; host network, as the VM pods have no NIC either) are started through
the same socket, each with one container of the same image, timed and checked the same way. Per
pod, from ``/proc/<pid>/smaps_rollup``: PSS, RSS and Anonymous of its container's process, its
sandbox's pause process (the same busybox ``sleep``; pids from containerd's verbose
ContainerStatus and PodSandboxStatus) and its ``containerd-shim-runc-v2`` (the pause process's
parent), and containerd's RSS growth divided by the pods. Host memory per idle runc pod = the
three processes' PSS + containerd's share.

Reported: the pods that fit and the refusal; host memory per idle pod, VM and runc, with each part
and the ratio VM / runc; each pod's start time and the last pod's over the first's (VM, and runc
for comparison), and the median of the last third's over the first third's (one start slowed by
the host's other work moves it less). On the way out, also when stopped by SIGTERM or SIGINT, every pod is removed
through the shim, the shim, containerd and the registry are stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.proc_cpu import cpu_s
from bench.sandbox_start import snapshot_made
from bench.shim_process import shim_process
from gen.cri.apimachinery.resource.generated_pb2 import Quantity
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from shim.config import DEFAULT_FRONT_BINARY
from tests import interrupts
from vmsandbox.adapters.sysfs import read_inventory
from vmsandbox.errors import InvalidArgument
from vmsandbox.host import HostInventory
from vmsandbox.profile import Profile
from vmsandbox.qemu_memory import guest_ram_mapping_kib, parse_smaps_rollup
from vmsandbox.quantity import parse_nonnegative_quantity

REPO = Path(__file__).resolve().parents[1]
IMAGE_DIR = os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default")
PROFILES = REPO / "deploy" / "profiles.yaml"
PROFILE = "small"  # the sample profiles' smallest guest (memory.min 128Mi, shared CPUs, 4 KiB pages)
POD_RESOURCES = {"cpu": "100m", "memory": "64Mi"}  # + the profile's 64Mi overhead = its memory.min
CAPACITY, SMOKE_CAPACITY = "1984Mi", "448Mi"
MAX_PODS = 64  # more than this fitting means the capacity did not bind: the run stops
SNAPSHOT_WAIT_S = 300
CONTAINER_CMD = ["/bin/sleep", "2147483647"]
MIB = 1 << 20


# -- memory from /proc ------------------------------------------------------------------------------------
def rollup(pid: int) -> dict[str, int]:
    return parse_smaps_rollup(Path(f"/proc/{pid}/smaps_rollup").read_bytes())


def rss_kib(pid: int) -> int:
    return rollup(pid)["Rss"]


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def comm_of(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def shim_pids(state_dir: Path) -> tuple[int, int]:
    """The shim serving ``state_dir`` (``python -m shim ... serve ... --state-dir``) and its front."""
    shims = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"shim" in argv and b"serve" in argv and str(state_dir).encode() in argv:
            shims.append(int(cmdline.parent.name))
    if len(shims) != 1:
        raise SystemExit(f"expected one shim process serving {state_dir}, found {shims}")
    children = Path(f"/proc/{shims[0]}/task/{shims[0]}/children").read_text().split()
    fronts = [int(c) for c in children if comm_of(int(c)).startswith("vmsandbox-front")]
    if len(fronts) != 1:
        raise SystemExit(f"expected one front under the shim {shims[0]}, found {fronts}")
    return shims[0], fronts[0]


def libvirtd_pid() -> int:
    return int(Path("/run/libvirtd.pid").read_text().strip())


def ledger_memory(metrics_url: str) -> dict[str, int]:
    """The shim's ordinary memory for guests per state (allocated, free), all nodes together, in
    bytes: its ``vmsandbox_memory_bytes`` metric (what its ledger counts)."""
    with urllib.request.urlopen(metrics_url, timeout=30) as reply:
        text = reply.read().decode()
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("vmsandbox_memory_bytes{"):
            labels, _, value = line.partition("} ")
            state = labels.split('state="', 1)[1].split('"', 1)[0]
            out[state] = out.get(state, 0) + int(float(value))
    if set(out) != {"allocated", "free"}:
        raise SystemExit(f"the shim's metrics have no vmsandbox_memory_bytes (allocated, free): {sorted(out)}")
    return out


def memory_reserved_for(capacity: int, inventory: HostInventory) -> dict[int, int]:
    """``memory_reserved`` per NUMA node that leaves guests ``capacity`` bytes of ordinary memory on
    the first node and none on the others (the shim's rule: MemTotal less hugepage pools less it)."""
    if not inventory.memory:
        raise SystemExit("the host's inventory has no memory figures: the shim would not count ordinary memory")
    pages: dict[int, int] = {}
    for pool in inventory.hugepages:
        pages[pool.node] = pages.get(pool.node, 0) + pool.total * pool.page_size
    first = min(n for n, _ in inventory.memory)
    out = {}
    for node, total in inventory.memory:
        ordinary = total - pages.get(node, 0)
        if node == first and ordinary < capacity:
            raise SystemExit(f"node {node} has {ordinary >> 20} MiB of ordinary memory, less than the capacity asked")
        out[node] = ordinary - capacity if node == first else total
    return out


# -- pods ------------------------------------------------------------------------------------------------
@dataclass
class Pod:
    sandbox_id: str
    container_id: str
    run_s: float
    create_s: float
    start_s: float

    @property
    def total_s(self) -> float:
        return self.run_s + self.create_s + self.start_s


def _resources() -> pb.KubernetesResources:
    q = {k: Quantity(string=v) for k, v in POD_RESOURCES.items()}
    return pb.KubernetesResources(requests=q, limits=q)


def vm_pod_config(n: int, logs: Path) -> pb.PodSandboxConfig:
    (logs / f"vm-{n}").mkdir(parents=True)
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=f"density-vm-{n}", namespace="bench", uid=str(uuid.uuid4())),
        log_directory=str(logs / f"vm-{n}"),
        pod_resources=pb.PodResourceConfig(
            containers=[pb.ContainerResourceConfig(name="app", kubernetes_resources=_resources())]
        ),
    )


def runc_pod_config(n: int, logs: Path) -> pb.PodSandboxConfig:
    (logs / f"runc-{n}").mkdir(parents=True)
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=f"density-runc-{n}", namespace="bench", uid=str(uuid.uuid4())),
        log_directory=str(logs / f"runc-{n}"),
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=pb.NamespaceOption(network=pb.NODE))
        ),
    )


def container_config(image: str, *, vm: bool) -> pb.ContainerConfig:
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="app"),
        image=pb.ImageSpec(image=image),
        command=CONTAINER_CMD,
        log_path="app.log",
    )
    if vm:
        config.kubernetes_resources.CopyFrom(_resources())
    return config


def start_pod(
    rt: pb_grpc.RuntimeServiceStub, config: pb.PodSandboxConfig, image: str, handler: str, *, vm: bool
) -> Pod:
    """RunPodSandbox + CreateContainer + StartContainer, timed; then the container must be RUNNING and
    answer ExecSync ``true`` (a pod that does not is an error, not a figure). RESOURCE_EXHAUSTED of
    RunPodSandbox reaches the caller as the ``grpc.RpcError`` it is."""
    t0 = time.monotonic()
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config, runtime_handler=handler), timeout=300).pod_sandbox_id
    t1 = time.monotonic()
    ctr = container_config(image, vm=vm)
    created = rt.CreateContainer(pb.CreateContainerRequest(pod_sandbox_id=sid, config=ctr, sandbox_config=config), 120)
    cid = created.container_id
    t2 = time.monotonic()
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    t3 = time.monotonic()
    state = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status.state
    if state != pb.CONTAINER_RUNNING:
        raise SystemExit(f"pod {config.metadata.name}: its container is {pb.ContainerState.Name(state)}, not running")
    done = rt.ExecSync(pb.ExecSyncRequest(container_id=cid, cmd=["true"], timeout=60), timeout=120)
    if done.exit_code != 0:
        raise SystemExit(f"pod {config.metadata.name}: ExecSync true exited {done.exit_code}: {done.stderr[:500]!r}")
    return Pod(sid, cid, t1 - t0, t2 - t1, t3 - t2)


def remove_pod(rt: pb_grpc.RuntimeServiceStub, sandbox_id: str) -> None:
    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=120)
    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=120)


def sandbox_info(rt: pb_grpc.RuntimeServiceStub, sandbox_id: str) -> dict[str, Any]:
    status = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), timeout=30)
    info: dict[str, Any] = json.loads(status.info["info"])
    return info


def is_placement_refusal(exc: grpc.RpcError) -> bool:
    """RESOURCE_EXHAUSTED from placement for want of ordinary memory (``vmsandbox.placement``'s words)."""
    details = exc.details() or ""
    placement = "cannot place the VM: " in details and "memory on " in details
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and placement


# -- the run ---------------------------------------------------------------------------------------------
def mib(kib: float) -> float:
    return round(kib / 1024, 1)


def times(pods: list[Pod]) -> dict[str, Any]:
    """The start times: first, last, median, the last over the first, and, less at the mercy of one
    noisy start, the median of the last third of the pods over that of the first third."""
    first, last = pods[0].total_s, pods[-1].total_s
    k = max(1, len(pods) // 3)
    return {
        "first": round(first, 3),
        "last": round(last, 3),
        "p50": round(statistics.median(p.total_s for p in pods), 3),
        "ratio_last_first": round(last / first, 3),
        "ratio_last_third_first_third": round(
            statistics.median(p.total_s for p in pods[-k:]) / statistics.median(p.total_s for p in pods[:k]), 3
        ),
    }


def push_image(registry: Any, work: Path) -> str:
    """busybox with ``sleep`` and ``true``, its command ``CONTAINER_CMD``, pushed to ``registry``."""
    from tests.registry_kit import Layout, busybox_entries, push

    layout = Layout(work / "layout")
    layout.tag("img", layout.image([layout.layer(busybox_entries(("sleep", "true")))], cmd=tuple(CONTAINER_CMD)))
    push(layout, "img", f"{registry.host}/bench/sleep:1")
    return f"{registry.host}/bench/sleep:1"


def write_profile(path: Path, tb_cache_mib: int | None = None) -> dict[str, Any]:
    """The sample profile for the run, its guest image this host's, its TCG translation cache
    ``tb_cache_mib`` when given."""
    found = [d for d in yaml.safe_load_all(PROFILES.read_text()) if isinstance(d, dict) and d.get("name") == PROFILE]
    if len(found) != 1 or found[0].get("cpu_policy") != "shared":
        raise SystemExit(f"{PROFILES}: no shared-CPU profile named {PROFILE!r}")
    guest = {**found[0].get("guest", {}), "image_dir": IMAGE_DIR}
    if tb_cache_mib is not None:
        guest["tcg_tb_cache_mib"] = tb_cache_mib
    profile = {**found[0], "guest": guest}
    path.write_text(json.dumps(profile))
    return profile


def qemu_memory(rt: pb_grpc.RuntimeServiceStub, sandbox_id: str) -> dict[str, Any]:
    """How the pod's guest started, and its QEMU's memory in MiB: guest RAM reserved and resident,
    VMM private (anonymous beyond guest RAM), the rest of its PSS (file pages), PSS and RSS."""
    info = sandbox_info(rt, sandbox_id)
    pid = domain_pid(info["domain"])
    ram_kib = int(info["shape"]["memory_bytes"]) // 1024
    fields = rollup(pid)
    ram = guest_ram_mapping_kib(Path(f"/proc/{pid}/smaps").read_text(errors="replace"), ram_kib)
    if ram is None:
        raise SystemExit(f"QEMU {pid}: no anonymous mapping of its {ram_kib} KiB of guest RAM in its smaps")
    vmm = fields["Anonymous"] - ram["Anonymous"]
    return {
        "by": str(info["guest"].get("start", {}).get("by", "boot")),
        "guest_ram_reserved_mib": mib(ram_kib),
        "guest_ram_resident_mib": mib(ram["Rss"]),
        "vmm_private_mib": mib(vmm),
        "file_pss_mib": mib(fields["Pss"] - ram["Rss"] - vmm),
        "qemu_pss_mib": mib(fields["Pss"]),
        "qemu_rss_mib": mib(fields["Rss"]),
    }


def domain_pid(domain: str) -> int:
    return int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text())


def qemu_pid(rt: pb_grpc.RuntimeServiceStub, sandbox_id: str) -> int:
    return domain_pid(sandbox_info(rt, sandbox_id)["domain"])


@dataclass
class Idle:
    """CPU time of each pod's processes and of the runtime's over an idle wait, as a percentage of
    one host CPU."""

    pods: list[list[int]]  # per pod, its processes
    runtime: tuple[int, ...]
    t0: float
    used0: list[float]
    runtime0: float

    @classmethod
    def begin(cls, pods: list[list[int]], runtime: tuple[int, ...]) -> Idle:
        used = [sum(cpu_s(pid) for pid in pp) for pp in pods]
        return cls(pods, runtime, time.monotonic(), used, sum(cpu_s(pid) for pid in runtime))

    def end(self, n: int) -> dict[str, Any]:
        """``each``: every pod's percentage; ``p50`` of them; ``runtime_share``: the runtime's
        processes' percentage over the ``n`` pods."""
        wall = time.monotonic() - self.t0
        used = [sum(cpu_s(pid) for pid in pp) - u for pp, u in zip(self.pods, self.used0, strict=True)]
        each = [round(100 * u / wall, 2) for u in used]
        runtime = 100 * (sum(cpu_s(pid) for pid in self.runtime) - self.runtime0) / wall
        return {"each": each, "p50": round(statistics.median(each), 2), "runtime_share": round(runtime / n, 2)}


def vm_phase(
    rt: pb_grpc.RuntimeServiceStub, work: Path, image: str, handler: str, metrics_url: str, settle_s: float
) -> dict[str, Any]:
    logs = work / "logs"
    state_dir = work / "state"
    # the untimed first pod: the shape's snapshot is made from it, then it goes
    warm = start_pod(rt, vm_pod_config(0, logs), image, handler, vm=True)
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while snapshot_made(state_dir) is None:
        failed = re.search(r"snapshot [0-9a-f]{12} not made.*", (work / "shim.log").read_text(errors="replace"))
        if failed or time.monotonic() > deadline:
            why = failed[0] if failed else f"none within {SNAPSHOT_WAIT_S} s"
            raise SystemExit(f"the shim made no snapshot: {why} (guest image: {IMAGE_DIR})")
        time.sleep(0.5)
    cold = qemu_memory(rt, warm.sandbox_id)  # idle since its container started, the snapshot made beside it
    remove_pod(rt, warm.sandbox_id)
    capacity = ledger_memory(metrics_url)
    shim_pid, front_pid = shim_pids(state_dir)
    before = {"shim": rss_kib(shim_pid), "front": rss_kib(front_pid), "libvirtd": rss_kib(libvirtd_pid())}
    pods: list[Pod] = []
    refusal = ""
    while True:
        if len(pods) >= MAX_PODS:
            raise SystemExit(f"{MAX_PODS} pods fit: the capacity did not bind (see {work / 'shim.log'})")
        try:
            pods.append(start_pod(rt, vm_pod_config(len(pods) + 1, logs), image, handler, vm=True))
        except grpc.RpcError as exc:
            if not is_placement_refusal(exc):
                why = f"{exc.code().name}: {exc.details()}"
                raise SystemExit(f"pod {len(pods) + 1}: RunPodSandbox failed: {why}") from None
            refusal = exc.details() or ""
            break
        print(f"VM pod {len(pods)}: {pods[-1].total_s:.2f} s", file=sys.stderr, flush=True)
    if not pods:
        raise SystemExit(f"not one VM pod fits: {refusal}")
    full = ledger_memory(metrics_url)
    idle = Idle.begin([[qemu_pid(rt, p.sandbox_id)] for p in pods], (shim_pid, front_pid, libvirtd_pid()))
    time.sleep(settle_s)
    idle_cpu = idle.end(len(pods))
    per_pod: list[dict[str, Any]] = []
    for p, used in zip(pods, idle_cpu.pop("each"), strict=True):
        figures = qemu_memory(rt, p.sandbox_id)
        per_pod.append(
            {
                "by": figures.pop("by"),
                "run_s": round(p.run_s, 3),
                "create_s": round(p.create_s, 3),
                "start_s": round(p.start_s, 3),
                "total_s": round(p.total_s, 3),
                "idle_cpu_percent": used,
                **figures,
            }
        )
    after = {"shim": rss_kib(shim_pid), "front": rss_kib(front_pid), "libvirtd": rss_kib(libvirtd_pid())}
    n = len(pods)

    def mean(key: str) -> float:
        return round(statistics.fmean(float(p[key]) for p in per_pod), 1)

    shim_share = mib((after["shim"] - before["shim"] + after["front"] - before["front"]) / n)
    for p in pods:
        remove_pod(rt, p.sandbox_id)
    return {
        "pods_fit": n,
        "refusal": {"code": "RESOURCE_EXHAUSTED", "message": refusal},
        "ledger": {
            "capacity_mib": round((capacity["allocated"] + capacity["free"]) / MIB, 1),
            "held_when_full_mib": round(full["allocated"] / MIB, 1),
            "free_when_full_mib": round(full["free"] / MIB, 1),
        },
        "vm": {
            "pods": per_pod,
            "first_pod_cold_booted": cold,
            "start_s": times(pods),
            "per_pod_mib": {
                "guest_ram_reserved": mean("guest_ram_reserved_mib"),
                "guest_ram_resident": mean("guest_ram_resident_mib"),
                "vmm_private": mean("vmm_private_mib"),
                "file_pss": mean("file_pss_mib"),
                "qemu_pss": mean("qemu_pss_mib"),
                "qemu_rss": mean("qemu_rss_mib"),
                "shim_share": shim_share,
                "libvirtd_share": mib((after["libvirtd"] - before["libvirtd"]) / n),
            },
            "rss_mib": {k: {"before": mib(before[k]), "after": mib(after[k])} for k in before},
            "host_memory_per_pod_mib": round(mean("qemu_pss_mib") + shim_share, 1),
            # host CPU while idle (the settle): each pod's QEMU, and the shim's, front's and
            # libvirtd's CPU over the pods
            "idle_cpu_percent_per_pod": idle_cpu,
        },
    }


def runc_phase(
    rt: pb_grpc.RuntimeServiceStub, work: Path, image: str, pods_wanted: int, containerd_pid: int, settle_s: float
) -> dict[str, Any]:
    logs = work / "logs"
    before = rss_kib(containerd_pid)
    pods = []
    for n in range(pods_wanted):
        pods.append(start_pod(rt, runc_pod_config(n + 1, logs), image, "", vm=False))
        print(f"runc pod {n + 1}: {pods[-1].total_s:.2f} s", file=sys.stderr, flush=True)
    pids: list[tuple[int, int, int]] = []  # (container, pause, shim) of each pod
    for p in pods:
        pause = int(sandbox_info(rt, p.sandbox_id)["pid"])
        status = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=p.container_id, verbose=True), timeout=30)
        app = int(json.loads(status.info["info"])["pid"])
        shim = parent_of(pause)
        if not comm_of(shim).startswith("containerd-shim") or parent_of(app) != shim:
            raise SystemExit(f"runc pod {p.sandbox_id[:12]}: pause {pause} and container {app} under no one shim")
        pids.append((app, pause, shim))
    idle = Idle.begin([list(each) for each in pids], (containerd_pid,))
    time.sleep(settle_s)
    idle_cpu = idle.end(len(pods))
    per_pod: list[dict[str, Any]] = []
    for p, (app, pause, shim), used in zip(pods, pids, idle_cpu.pop("each"), strict=True):
        procs = {"container": rollup(app), "pause": rollup(pause), "shim": rollup(shim)}
        per_pod.append(
            {
                "run_s": round(p.run_s, 3),
                "create_s": round(p.create_s, 3),
                "start_s": round(p.start_s, 3),
                "total_s": round(p.total_s, 3),
                "idle_cpu_percent": used,
                **{f"{k}_pss_mib": mib(v["Pss"]) for k, v in procs.items()},
                "pss_mib": mib(sum(v["Pss"] for v in procs.values())),
                "rss_mib": mib(sum(v["Rss"] for v in procs.values())),
                "anonymous_mib": mib(sum(v["Anonymous"] for v in procs.values())),
            }
        )
    after = rss_kib(containerd_pid)
    for p in pods:
        remove_pod(rt, p.sandbox_id)

    def mean(key: str) -> float:
        return round(statistics.fmean(float(p[key]) for p in per_pod), 1)

    share = mib((after - before) / len(pods))
    return {
        "pods": per_pod,
        "start_s": times(pods),
        "per_pod_mib": {
            "container_pss": mean("container_pss_mib"),
            "pause_pss": mean("pause_pss_mib"),
            "shim_pss": mean("shim_pss_mib"),
            "pss": mean("pss_mib"),
            "rss": mean("rss_mib"),
            "anonymous": mean("anonymous_mib"),
            "containerd_share": share,
        },
        "containerd_rss_mib": {"before": mib(before), "after": mib(after)},
        "host_memory_per_pod_mib": round(mean("pss_mib") + share, 1),
        # host CPU while idle (the settle): each pod's container, pause and shim, and containerd's
        # CPU over the pods
        "idle_cpu_percent_per_pod": idle_cpu,
    }


def measure(capacity: int, settle_s: float, tb_cache_mib: int | None) -> dict[str, Any]:
    from tests.registry_kit import Registry, free_port

    script = REPO / "scripts" / "containerd.sh"
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-density-") as tmp:
        work = Path(tmp)
        registry = Registry(work / "registry").start()
        ctd_dir = work / "containerd"
        try:
            image = push_image(registry, work)
            up = subprocess.run(
                ["bash", str(script), "up", str(ctd_dir), image, str(work / "net.d"), registry.host],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if up.returncode != 0:
                raise SystemExit(f"containerd.sh up failed ({up.returncode}):\n{up.stdout}{up.stderr}")
            endpoint = f"unix://{ctd_dir / 'containerd.sock'}"
            with grpc.insecure_channel(endpoint) as channel:
                version = pb_grpc.RuntimeServiceStub(channel).Version(pb.VersionRequest(), timeout=30)
            reserved = memory_reserved_for(capacity, read_inventory())
            port = free_port()
            profile = write_profile(work / "profile.yaml", tb_cache_mib)
            config = {
                "downstream_endpoint": endpoint,
                "shared_cpus": Path("/sys/devices/system/cpu/online").read_text().strip(),  # every CPU it owns
                "memory_reserved": {node: str(b) for node, b in reserved.items()},
                "metrics_address": f"127.0.0.1:{port}",
            }
            (work / "config.yaml").write_text(yaml.safe_dump(config))
            serve = ("--config", str(work / "config.yaml"), "--profile", str(work / "profile.yaml"))
            with shim_process(work, *serve) as rt:
                with grpc.insecure_channel(f"unix:{work / 'cri.sock'}") as channel:
                    # no pod named: the proxy pulls it into both stores
                    pb_grpc.ImageServiceStub(channel).PullImage(
                        pb.PullImageRequest(image=pb.ImageSpec(image=image)), timeout=300
                    )
                vm = vm_phase(rt, work, image, str(profile["handler"]), f"http://127.0.0.1:{port}/metrics", settle_s)
                ctd_pid = int((ctd_dir / "containerd.pid").read_text())
                runc = runc_phase(rt, work, image, vm["pods_fit"], ctd_pid, settle_s)
        finally:
            subprocess.run(["bash", str(script), "down", str(ctd_dir)], capture_output=True, timeout=120)
            registry.stop()
    return {
        "profile": {
            "name": profile["name"],
            "cpu_policy": profile["cpu_policy"],
            "page_size": str(profile.get("page_size", "")),
            "memory_min": str(profile.get("memory", {}).get("min", "")),
            "tcg_tb_cache_mib": int(profile["guest"].get("tcg_tb_cache_mib", Profile.tcg_tb_cache_mib)),
        },
        "pod": {**POD_RESOURCES, "command": CONTAINER_CMD},
        "capacity": {
            "configured_mib": capacity // MIB,
            "memory_reserved_mib": {str(n): b // MIB for n, b in reserved.items()},
            **vm.pop("ledger"),
        },
        "containerd_version": f"{version.runtime_name} {version.runtime_version}",
        **vm,
        "runc": runc,
    }


def _start_shape() -> dict[str, Any]:
    keys = ("first", "last", "p50", "ratio_last_first", "ratio_last_third_first_third")
    return dict.fromkeys(keys, smoke.POSITIVE)


_TIMES = {
    "run_s": smoke.POSITIVE,
    "create_s": smoke.POSITIVE,
    "start_s": smoke.POSITIVE,
    "total_s": smoke.POSITIVE,
    "idle_cpu_percent": smoke.NON_NEGATIVE,
}
_IDLE_CPU = {"p50": smoke.NON_NEGATIVE, "runtime_share": smoke.FINITE}
_QEMU_MEMORY = {
    "by": smoke.TEXT,
    "guest_ram_reserved_mib": smoke.POSITIVE,
    "guest_ram_resident_mib": smoke.POSITIVE,
    "vmm_private_mib": smoke.POSITIVE,
    "file_pss_mib": smoke.FINITE,
    "qemu_pss_mib": smoke.POSITIVE,
    "qemu_rss_mib": smoke.POSITIVE,
}
SHAPE: dict[str, Any] = {
    "benchmark": "density",
    "load_avg_1m": smoke.NON_NEGATIVE,
    "settle_s": smoke.NON_NEGATIVE,
    "profile": {
        "name": PROFILE,
        "cpu_policy": "shared",
        "page_size": smoke.TEXT,
        "memory_min": smoke.TEXT,
        "tcg_tb_cache_mib": smoke.COUNT,
    },
    "pod": {"cpu": smoke.TEXT, "memory": smoke.TEXT, "command": smoke.Each(smoke.TEXT)},
    "capacity": {
        "configured_mib": smoke.COUNT,
        "memory_reserved_mib": smoke.Keyed(smoke.NON_NEGATIVE),
        "capacity_mib": smoke.POSITIVE,
        "held_when_full_mib": smoke.POSITIVE,
        "free_when_full_mib": smoke.NON_NEGATIVE,
    },
    "containerd_version": smoke.TEXT,
    "pods_fit": smoke.COUNT,
    "refusal": {"code": "RESOURCE_EXHAUSTED", "message": smoke.TEXT},
    "vm": {
        "pods": smoke.Each({**_TIMES, **_QEMU_MEMORY}),
        "first_pod_cold_booted": _QEMU_MEMORY,
        "start_s": _start_shape(),
        "per_pod_mib": {
            "guest_ram_reserved": smoke.POSITIVE,
            "guest_ram_resident": smoke.POSITIVE,
            "vmm_private": smoke.POSITIVE,
            "file_pss": smoke.FINITE,
            "qemu_pss": smoke.POSITIVE,
            "qemu_rss": smoke.POSITIVE,
            "shim_share": smoke.FINITE,  # a difference of two RSS readings
            "libvirtd_share": smoke.FINITE,
        },
        "rss_mib": smoke.Keyed(
            {"before": smoke.POSITIVE, "after": smoke.POSITIVE}, frozenset({"shim", "front", "libvirtd"})
        ),
        "host_memory_per_pod_mib": smoke.POSITIVE,
        "idle_cpu_percent_per_pod": _IDLE_CPU,
    },
    "runc": {
        "pods": smoke.Each(
            {
                **_TIMES,
                "container_pss_mib": smoke.POSITIVE,
                "pause_pss_mib": smoke.POSITIVE,
                "shim_pss_mib": smoke.POSITIVE,
                "pss_mib": smoke.POSITIVE,
                "rss_mib": smoke.POSITIVE,
                "anonymous_mib": smoke.POSITIVE,
            }
        ),
        "start_s": _start_shape(),
        "per_pod_mib": {
            "container_pss": smoke.POSITIVE,
            "pause_pss": smoke.POSITIVE,
            "shim_pss": smoke.POSITIVE,
            "pss": smoke.POSITIVE,
            "rss": smoke.POSITIVE,
            "anonymous": smoke.POSITIVE,
            "containerd_share": smoke.FINITE,
        },
        "containerd_rss_mib": {"before": smoke.POSITIVE, "after": smoke.POSITIVE},
        "host_memory_per_pod_mib": smoke.POSITIVE,
        "idle_cpu_percent_per_pod": _IDLE_CPU,
    },
    "ratio_memory_vm_runc": smoke.POSITIVE,
}


def invariants(doc: dict[str, Any]) -> list[str]:
    """What the shape cannot say: as many runc pods as VM pods, every VM pod's guest within its
    reservation, and the ledger full (less than one more guest free) when it refused."""
    out = []
    n = doc["pods_fit"]
    if len(doc["vm"]["pods"]) != n or len(doc["runc"]["pods"]) != n:
        out.append(f"pods: {n} fit, but {len(doc['vm']['pods'])} VM and {len(doc['runc']['pods'])} runc pods reported")
    for i, p in enumerate(doc["vm"]["pods"]):
        if p["guest_ram_resident_mib"] > p["guest_ram_reserved_mib"]:
            out.append(f"vm.pods[{i}]: guest RAM resident above its reservation")
    guest = doc["vm"]["per_pod_mib"]["guest_ram_reserved"]
    if doc["capacity"]["free_when_full_mib"] >= guest:
        out.append(f"capacity.free_when_full_mib: {doc['capacity']['free_when_full_mib']} fits one more guest")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--capacity", default=CAPACITY, help=f"ordinary memory the ledger gives VM guests (default {CAPACITY})"
    )
    parser.add_argument("--settle", type=float, default=20.0, help="seconds idle before the memory is read")
    parser.add_argument(
        "--tb-cache-mib", type=int, default=None, help="the profile's guest.tcg_tb_cache_mib (default: the profile's)"
    )
    parser.add_argument("--smoke", action="store_true", help=f"capacity {SMOKE_CAPACITY}, 3 s settle; check the JSON")
    args = parser.parse_args()
    if args.smoke:
        args.capacity, args.settle = SMOKE_CAPACITY, 3.0
    try:
        capacity = parse_nonnegative_quantity(args.capacity).value_int()
    except InvalidArgument as exc:
        parser.error(f"--capacity: {exc}")
    if capacity < MIB or args.settle < 0:
        parser.error("--capacity must be at least 1Mi and --settle not negative")
    smoke.require(
        smoke.missing_tools("containerd", "runc", "containerd-shim-runc-v2"),
        smoke.missing_files(DEFAULT_FRONT_BINARY),
        smoke.missing_image_tools(),
        smoke.missing_guest_host(),
    )
    result = measure(capacity, args.settle, args.tb_cache_mib)
    doc = {
        "benchmark": "density",
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "settle_s": args.settle,
        **result,
        "ratio_memory_vm_runc": round(
            result["vm"]["host_memory_per_pod_mib"] / result["runc"]["host_memory_per_pod_mib"], 2
        ),
    }
    smoke.report(doc, SHAPE, smoke=args.smoke, invariants=invariants)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
