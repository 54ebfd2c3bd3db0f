"""``kubectl apply`` to Ready in the one-node cluster (``scripts/cluster.sh``): pods of one
Deployment under runc (the cluster's containerd, the baseline) and under the ``vmsandbox``
RuntimeClass, started one at a time and alternating, same image, same node, same resources; then
a burst of VM pods started at once against one VM pod alone.

    .venv/bin/python bench/cluster_start.py --pods 7 --burst 10
    .venv/bin/python bench/cluster_start.py --smoke   # 2 pods per runtime, a burst of 3; checks the JSON

The cluster is brought up for the run and down after it (also when the run is stopped); nothing
else may run a cluster on the host meanwhile. Before the timed pods, one pod of each runtime is
started untimed but reported (``first_pod_s``: the image pulled, the VM cold-booted), and the run
waits for the shim's snapshot of the pods' shape, so that the timed VM pods start as every later
pod on a node does.

Each timed pod: the time is taken just before ``kubectl apply`` of its Deployment (one replica);
a ``kubectl get --watch`` started before it stamps each change of the pod as it arrives: bound to
the node, then Ready. Where the time went, per pod, from what the kubelet itself measured: the
delta of its ``kubelet_runtime_operations_duration_seconds`` sums across the pod's start (read
through the API server's node proxy) for RunPodSandbox, PullImage + ImageStatus, CreateContainer
and StartContainer; the first line the container logged, by its CRI log timestamp (``kubectl logs
--timestamps``, the runtime's clock: this host's); and the rest up to Ready: the kubelet's own
work, its pod workers and status updates, the API server and the watch (``kubelet_and_api``).
For VM pods the shim's own split of RunPodSandbox, CreateContainer and StartContainer into their
steps comes from its log (``shim.rpc``'s ``done in`` lines; ``vm_steps_ms_p50``).

Targets (issue 39): a VM pod's p50 at most 1.3x a runc pod's; ``--burst`` VM pods applied at once
all Ready within 3x one VM pod's p50. Both are reported with ``met``, never asserted: the figures
are what they are on this host (guests under TCG here).

The floor of both (``floor``), measured in the same run: the CPU time of each VM pod's QEMU from
its start to the pod's Ready (user + system time of the process, every thread; read at Ready from
``/proc`` for the QEMU in each measured pod's cgroup, by the pod's uid), spread over the host CPUs its
threads may run on. Whatever runtime starts the guest, that work is the guest's (its restore, its
first code translated again, its agent, crun and the container) and runs on those CPUs, so a VM
pod cannot be Ready before the runc pod's time less runc's own RunPodSandbox, CreateContainer and
StartContainer, plus it (``floor.ready_s``); nor a burst before its QEMUs' CPU time over those CPUs
(``floor.burst_all_ready_s``). Each is also given as the ratio its target is checked by.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.proc_cpu import stat_cpu_s
from bench.qemu_direct import percentile
from tests import interrupts

RUNTIMES = ("runc", "vmsandbox")
# requests small enough that a burst of 10 fits the node's allocatable CPU (2 CPUs here); no CPU
# limit: a VM pod's QEMU runs in its pod's cgroup, whose CFS quota (the limit plus the RuntimeClass
# overhead) would slow the whole guest down to it, while a runc container is only its own process
REQUESTS = {"cpu": "100m", "memory": "64Mi"}
LIMITS = {"memory": "64Mi"}
RESOURCES = {"requests": REQUESTS, "limits": LIMITS}
READY_TIMEOUT_S = 300
TARGET_RATIO_P50 = 1.3
TARGET_BURST_RATIO = 3.0
# the kubelet's CRI call durations (pkg/kubelet/metrics: one histogram, labelled by the call)
OPS_METRIC = "kubelet_runtime_operations_duration_seconds_sum"
OPS = {
    "run_pod_sandbox": ("run_podsandbox",),
    "image": ("pull_image", "image_status"),
    "create_container": ("create_container",),
    "start_container": ("start_container",),
}
STEP_RPCS = ("RunPodSandbox", "CreateContainer", "StartContainer")
SAMPLE = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


def kubelet_ops(text: str) -> dict[str, float]:
    """The kubelet's total seconds per CRI call (``operation_type``) from its /metrics text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m is None or m["name"] != OPS_METRIC:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        op = labels.get("operation_type")
        if op:
            out[op] = out.get(op, 0.0) + float(m["value"])
    return out


def ops_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds per phase of ``OPS`` the kubelet spent between two reads."""
    return {phase: sum(after.get(op, 0.0) - before.get(op, 0.0) for op in ops) for phase, ops in OPS.items()}


def log_timestamp_ns(line: str) -> int:
    """The ns since the epoch of a ``kubectl logs --timestamps`` line (RFC 3339, nanoseconds, UTC)."""
    stamp = line.split(" ", 1)[0]
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?Z", stamp)
    if m is None:
        raise ValueError(f"not a CRI log timestamp: {stamp!r}")
    whole = time.strptime(m[1], "%Y-%m-%dT%H:%M:%S")
    return calendar.timegm(whole) * 1_000_000_000 + int((m[2] or "0").ljust(9, "0"))


@dataclass(frozen=True)
class QemuCpu:
    """What the pods' QEMU processes had used when read: CPU seconds, summed over the processes, and
    the host CPUs any of their threads may run on."""

    seconds: float
    processes: int
    cpus: frozenset[int]


def cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list (``0-2,5``)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


# a pod's cgroup, cgroupfs (/kubepods/burstable/pod<uid>) or systemd (kubepods-burstable-pod<uid with _>.slice)
_POD_CGROUP = re.compile(r"kubepods\S*?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


def cgroup_pod_uid(cgroup: str) -> str | None:
    """The uid of the kubelet's pod whose cgroup a ``/proc/<pid>/cgroup`` text names, if any."""
    m = _POD_CGROUP.search(cgroup)
    return m[1].replace("_", "-") if m else None


def pod_qemu_cpu(uids: Collection[str], proc: Path = Path("/proc")) -> QemuCpu:
    """CPU time so far of every QEMU in the cgroups of the kubelet's pods ``uids`` (the shim moves a
    VM pod's QEMU into its pod's cgroup at RunPodSandbox), and the union of their threads' allowed
    CPUs."""
    seconds, processes, cpus = 0.0, 0, set[int]()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith("qemu-system"):
                continue
            if cgroup_pod_uid((entry / "cgroup").read_text()) not in uids:
                continue
            used = stat_cpu_s((entry / "stat").read_text())
            allowed = [
                cpu_list(line.split(":", 1)[1])
                for task in (entry / "task").iterdir()
                for line in (task / "status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list:")
            ]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while read
        seconds += used
        processes += 1
        cpus.update(*allowed)
    return QemuCpu(seconds, processes, frozenset(cpus))


def floor(
    runc_ready_s: float, runc_runtime_s: float, vm_cpu_s: float, burst_cpu_s: float, cpus: int, one_vm_s: float
) -> dict[str, float]:
    """The least time a VM pod and a burst of them can take to Ready on this host (see the module
    docstring): the runc pod's time without runc's own calls, plus the guest's CPU time spread over
    the CPUs it may use; and for the burst, the burst's CPU time over those CPUs. Ratios as their
    targets are checked: the pod's to the runc pod, the burst's to one VM pod as measured."""
    ready = runc_ready_s - runc_runtime_s + vm_cpu_s / cpus
    burst = burst_cpu_s / cpus
    return {
        "ready_s": round(ready, 3),
        "ratio_p50": round(ready / runc_ready_s, 3),
        "burst_all_ready_s": round(burst, 3),
        "burst_ratio": round(burst / one_vm_s, 3),
    }


def deployment(name: str, runtime: str, image: str, replicas: int) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {
                "name": "main",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "resources": RESOURCES,
            }
        ],
    }
    if runtime != "runc":
        spec["runtimeClassName"] = runtime
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default", "labels": {"bench": "cluster-start"}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name, "bench": "cluster-start"}}, "spec": spec},
        },
    }


@dataclass
class PodTimes:
    """When (ns since the epoch, as this process saw it arrive) each pod was bound and was Ready."""

    bound: dict[str, int] = field(default_factory=dict)
    ready: dict[str, int] = field(default_factory=dict)
    uid: dict[str, str] = field(default_factory=dict)  # each pod's metadata.uid


class Watch:
    """``kubectl get pods --watch`` on a label selector, each event stamped as it arrives."""

    # kubectl pads tabs of a template into spaces: fields are split on "|", which no name holds
    TEMPLATE = (
        '{.metadata.name}|{.metadata.uid}|{.spec.nodeName}|{.status.conditions[?(@.type=="Ready")].status}{"\\n"}'
    )

    def __init__(self, kubectl: list[str], selector: str) -> None:
        self.times = PodTimes()
        self._cond = threading.Condition()
        self._proc = subprocess.Popen(
            [*kubectl, "get", "pods", "-l", selector, "--watch", "-o", f"jsonpath={self.TEMPLATE}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            now = time.time_ns()
            parts = [p.strip() for p in line.split("|")]
            if len(parts) != 4 or not parts[0]:
                continue
            name, uid, node, ready = parts
            with self._cond:
                self.times.uid[name] = uid
                if node:
                    self.times.bound.setdefault(name, now)
                if ready == "True":
                    self.times.ready.setdefault(name, now)
                self._cond.notify_all()

    def wait_ready(self, count: int, timeout_s: float) -> PodTimes:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.times.ready) < count:
                left = deadline - time.monotonic()
                if left <= 0 or self._proc.poll() is not None:
                    raise TimeoutError(f"{len(self.times.ready)} of {count} pods Ready within {timeout_s} s")
                self._cond.wait(min(left, 1.0))
            return PodTimes(dict(self.times.bound), dict(self.times.ready), dict(self.times.uid))

    def close(self) -> None:
        self._proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(10)


class Bench:
    """The run's cluster, with the calls the measurement makes on it."""

    def __init__(self, cluster: Any, image: str) -> None:
        self.cluster = cluster
        self.image = image
        nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        self.node = nodes[0]["metadata"]["name"]
        self.vm_steps: list[dict[str, dict[str, int]]] = []  # per timed VM pod, from the shim's log
        self.qemu = QemuCpu(0.0, 0, frozenset())  # the pods' QEMUs when the last start's pods were Ready

    def ops(self) -> dict[str, float]:
        return kubelet_ops(self.cluster.kubectl("get", "--raw", f"/api/v1/nodes/{self.node}/proxy/metrics").stdout)

    def start(self, name: str, runtime: str, replicas: int) -> tuple[int, PodTimes, dict[str, float]]:
        """Apply a Deployment of ``replicas`` pods and wait for all of them to be Ready: when the
        apply began (ns since the epoch), the pods' times, the kubelet's seconds per phase; what the
        pods' QEMUs had used once all were Ready is kept in ``self.qemu``."""
        watch = Watch(self.cluster.kubectl_argv(), f"app={name}")
        try:
            before = self.ops()
            doc = json.dumps(deployment(name, runtime, self.image, replicas))
            t0 = time.time_ns()
            self.cluster.kubectl("apply", "-f", "-", input=doc)
            try:
                times = watch.wait_ready(replicas, READY_TIMEOUT_S)
                self.qemu = pod_qemu_cpu({times.uid[pod] for pod in times.ready})
            except TimeoutError as exc:
                pods = self.cluster.kubectl("get", "pods", "-l", f"app={name}", "-o", "wide", check=False).stdout
                events = self.cluster.kubectl("get", "events", "--field-selector", "type=Warning", check=False).stdout
                raise TimeoutError(f"{name}: {exc}\n{pods}\n{events[-2000:]}") from exc
            return t0, times, ops_delta(before, self.ops())
        finally:
            watch.close()

    def first_log_ns(self, pod: str, timeout_s: float = 15) -> int | None:
        """The CRI log timestamp of the pod's first line; None when it logged none within
        ``timeout_s`` (a VM pod's lines reach its log file after the guest sent them, which may be
        after the kubelet saw the container start)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.cluster.kubectl("logs", pod, "--timestamps", "--tail=-1", check=False, timeout=60)
            lines = [line for line in got.stdout.splitlines() if line.strip()]
            if got.returncode == 0 and lines:
                return log_timestamp_ns(lines[0])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)

    def remove(self, name: str) -> None:
        self.cluster.kubectl("delete", "deployment", name, "--wait=true", timeout=180)
        deadline = time.monotonic() + 180
        while self.cluster.kubectl("get", "pods", "-l", f"app={name}", "-o", "name").stdout.strip():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the pods of {name} still there 180 s after its deletion")
            time.sleep(0.5)

    def one(self, name: str, runtime: str) -> dict[str, float]:
        """One pod of ``runtime`` from apply to Ready, and where its time went (seconds)."""
        t0, times, spent = self.start(name, runtime, 1)
        (pod,) = times.ready
        logged = self.first_log_ns(pod)
        self.remove(name)
        ready = (times.ready[pod] - t0) / 1e9
        row = {
            "ready": ready,
            "scheduled": (times.bound.get(pod, times.ready[pod]) - t0) / 1e9,
            **spent,
            "first_log_line_since_apply": (logged - t0) / 1e9 if logged is not None else float("nan"),
        }
        row["kubelet_and_api"] = ready - row["scheduled"] - sum(spent.values())
        if runtime != "runc":
            self.vm_steps.append(self.steps_ms(pod))
            if self.qemu.processes != 1:
                raise RuntimeError(f"{pod}: {self.qemu.processes} QEMU processes in its cgroup at Ready, not 1")
            row["qemu_cpu"] = self.qemu.seconds
        return row

    def steps_ms(self, pod: str) -> dict[str, dict[str, int]]:
        """What the shim logged of the pod's RunPodSandbox, CreateContainer and StartContainer:
        each RPC's total and its steps, in ms (``shim.rpc``'s ``done in`` line)."""
        text = (self.cluster.dir / "logs" / "shim.log").read_text(errors="replace")
        out: dict[str, dict[str, int]] = {}
        for m in re.finditer(rf"pod=default/{re.escape(pod)}\]: (\w+) done in (\d+) ms: (.*)$", text, re.M):
            if m[1] in STEP_RPCS:
                steps = dict(part.rsplit(" ", 1) for part in m[3].split(", ") if " " in part)
                out[m[1]] = {"total": int(m[2]), **{k: int(v) for k, v in steps.items()}}
        return out

    def wait_for_snapshot(self, timeout_s: float) -> bool:
        """Whether the shim made the snapshot the timed VM pods restore from (its log says so)."""
        log = self.cluster.dir / "logs" / "shim.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if log.is_file() and re.search(r"snapshot [0-9a-f]{12} made", log.read_text(errors="replace")):
                return True
            time.sleep(0.5)
        return False


def stats(samples: list[float]) -> dict[str, Any]:
    clean = [x for x in samples if x == x]  # NaN: a figure the pod did not give
    return {
        "p50": round(percentile(clean, 50), 3) if clean else None,
        "p95": round(percentile(clean, 95), 3) if clean else None,
        "samples": [round(x, 3) for x in clean],
    }


@contextlib.contextmanager
def cluster_up() -> Iterator[Any]:
    from tests.integration import cluster_support

    gen = cluster_support.running_cluster()
    cluster = next(gen)
    try:
        yield cluster
    finally:
        with contextlib.suppress(StopIteration):
            next(gen)


def run(pods: int, burst: int) -> dict[str, Any]:
    from tests.integration.cluster_support import push_image

    rows: dict[str, list[dict[str, float]]] = {r: [] for r in RUNTIMES}
    first: dict[str, float] = {}
    with cluster_up() as cluster, tempfile.TemporaryDirectory(prefix="cluster-start-") as tmp:
        image = push_image(Path(tmp))
        bench = Bench(cluster, image)
        version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
        for runtime in RUNTIMES:
            first[runtime] = bench.one(f"first-{runtime}", runtime)["ready"]
            print(f"first {runtime} pod Ready in {first[runtime]:.2f} s", file=sys.stderr, flush=True)
        snapshot = bench.wait_for_snapshot(120)
        bench.vm_steps.clear()  # the timed pods' alone
        for i in range(pods):
            order = RUNTIMES if i % 2 == 0 else RUNTIMES[::-1]
            for runtime in order:
                row = bench.one(f"start-{runtime}-{i}", runtime)
                rows[runtime].append(row)
                print(
                    f"pod {i} {runtime}: Ready {row['ready']:.2f} s "
                    f"(sandbox {row['run_pod_sandbox']:.2f}, create {row['create_container']:.2f}, "
                    f"start {row['start_container']:.2f}, first log line {row['first_log_line_since_apply']:.2f})",
                    file=sys.stderr,
                    flush=True,
                )
        t0, times, _ = bench.start("burst", "vmsandbox", burst)
        burst_ready = sorted((t - t0) / 1e9 for t in times.ready.values())
        burst_qemu = bench.qemu
        bench.remove("burst")
    p50 = {r: percentile([row["ready"] for row in rows[r]], 50) for r in RUNTIMES}
    ratio = p50["vmsandbox"] / p50["runc"]
    burst_ratio = burst_ready[-1] / p50["vmsandbox"]
    phases = ("scheduled", *OPS, "first_log_line_since_apply", "kubelet_and_api")
    vm_steps: dict[str, dict[str, float]] = {}
    for rpc in STEP_RPCS:
        logged = [pod[rpc] for pod in bench.vm_steps if rpc in pod]
        names = dict.fromkeys(k for steps in logged for k in steps)
        vm_steps[rpc] = {k: percentile([steps[k] for steps in logged if k in steps], 50) for k in names}
    if burst_qemu.processes != burst:
        raise RuntimeError(f"{burst_qemu.processes} QEMU processes in the burst pods' cgroups at Ready, not {burst}")
    runc_runtime = sum(
        percentile([row[ph] for row in rows["runc"]], 50)
        for ph in ("run_pod_sandbox", "create_container", "start_container")
    )
    vm_cpu = percentile([row["qemu_cpu"] for row in rows["vmsandbox"]], 50)
    cpus = len(burst_qemu.cpus)
    least = floor(p50["runc"], runc_runtime, vm_cpu, burst_qemu.seconds, cpus, p50["vmsandbox"])
    return {
        "benchmark": "cluster_start",
        "kubernetes": version,
        "pods_per_runtime": pods,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "resources": RESOURCES,
        "first_pod_s": {r: round(first[r], 3) for r in RUNTIMES},
        "snapshot_made": snapshot,
        "apply_to_ready_s": {r: stats([row["ready"] for row in rows[r]]) for r in RUNTIMES},
        "ratio_p50": round(ratio, 3),
        "target_ratio_p50": TARGET_RATIO_P50,
        "met_ratio_p50": ratio <= TARGET_RATIO_P50,
        "phases_s": {r: {ph: stats([row[ph] for row in rows[r]])["p50"] for ph in phases} for r in RUNTIMES},
        "vm_steps_ms_p50": vm_steps,
        "burst": {
            "pods": burst,
            "all_ready_s": round(burst_ready[-1], 3),
            "ready_s": [round(x, 3) for x in burst_ready],
            "one_pod_p50_s": round(p50["vmsandbox"], 3),
            "ratio": round(burst_ratio, 3),
            "target_ratio": TARGET_BURST_RATIO,
            "met": burst_ratio <= TARGET_BURST_RATIO,
        },
        # the least either can take on this host, from what the guests' QEMUs used (module docstring)
        "floor": {
            "vm_qemu_cpu_s": stats([row["qemu_cpu"] for row in rows["vmsandbox"]]),
            "runc_runtime_calls_s": round(runc_runtime, 3),
            "burst_qemu_cpu_s": round(burst_qemu.seconds, 3),
            "qemu_cpus": sorted(burst_qemu.cpus),
            **least,
        },
    }


_STATS = {"p50": smoke.POSITIVE, "p95": smoke.POSITIVE, "samples": smoke.Each(smoke.POSITIVE)}
_PHASES = {
    "scheduled": smoke.NON_NEGATIVE,
    "run_pod_sandbox": smoke.POSITIVE,
    "image": smoke.NON_NEGATIVE,
    "create_container": smoke.POSITIVE,
    "start_container": smoke.POSITIVE,
    "first_log_line_since_apply": smoke.POSITIVE,
    "kubelet_and_api": smoke.FINITE,
}
SHAPE: dict[str, Any] = {
    "benchmark": "cluster_start",
    "kubernetes": smoke.TEXT,
    "pods_per_runtime": smoke.COUNT,
    "load_avg_1m": smoke.NON_NEGATIVE,
    "resources": RESOURCES,
    "first_pod_s": {r: smoke.POSITIVE for r in RUNTIMES},
    "snapshot_made": True,
    "apply_to_ready_s": {r: _STATS for r in RUNTIMES},
    "ratio_p50": smoke.POSITIVE,
    "target_ratio_p50": TARGET_RATIO_P50,
    "met_ratio_p50": smoke.BOOL,
    "phases_s": {r: _PHASES for r in RUNTIMES},
    # what the shim's log said of each timed VM pod's RPCs: their total and steps (p50, ms)
    "vm_steps_ms_p50": {rpc: smoke.Keyed(smoke.NON_NEGATIVE) for rpc in STEP_RPCS},
    "burst": {
        "pods": smoke.COUNT,
        "all_ready_s": smoke.POSITIVE,
        "ready_s": smoke.Each(smoke.POSITIVE),
        "one_pod_p50_s": smoke.POSITIVE,
        "ratio": smoke.POSITIVE,
        "target_ratio": TARGET_BURST_RATIO,
        "met": smoke.BOOL,
    },
    "floor": {
        "vm_qemu_cpu_s": _STATS,
        "runc_runtime_calls_s": smoke.POSITIVE,
        "burst_qemu_cpu_s": smoke.POSITIVE,
        "qemu_cpus": smoke.Each(smoke.NON_NEGATIVE),
        "ready_s": smoke.POSITIVE,
        "ratio_p50": smoke.POSITIVE,
        "burst_all_ready_s": smoke.POSITIVE,
        "burst_ratio": smoke.POSITIVE,
    },
}


def invariants(doc: dict[str, Any]) -> list[str]:
    found = []
    for r in RUNTIMES:
        if len(doc["apply_to_ready_s"][r]["samples"]) != doc["pods_per_runtime"]:
            found.append(f"apply_to_ready_s.{r}: not one sample per pod")
        ph = doc["phases_s"][r]
        logged = ph["first_log_line_since_apply"]
        if not logged <= doc["apply_to_ready_s"][r]["p50"] * 2:
            found.append(f"phases_s.{r}.first_log_line_since_apply: {logged} s, long after its pod was Ready")
    if len(doc["burst"]["ready_s"]) != doc["burst"]["pods"]:
        found.append("burst.ready_s: not one per pod")
    fl = doc["floor"]
    if not fl["qemu_cpus"]:
        found.append("floor.qemu_cpus: the QEMUs may run on no CPU")
    # a floor well above what was measured means the CPU time was not the pods' (noise in the runc
    # pods' own time can lift it a little above)
    if fl["ready_s"] > doc["apply_to_ready_s"]["vmsandbox"]["p50"] * 1.5:
        found.append(f"floor.ready_s: {fl['ready_s']} s, far above the VM pods' own p50")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=7, help="timed pods per runtime (default 7)")
    ap.add_argument("--burst", type=int, default=10, help="VM pods applied at once (default 10)")
    ap.add_argument("--smoke", action="store_true", help="2 pods per runtime, a burst of 3; check the JSON")
    args = ap.parse_args()
    if args.smoke:
        args.pods, args.burst = 2, 3
    smoke.require(smoke.missing_guest_host(), smoke.missing_image_tools(), missing_go())
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON alone: the cluster's progress goes to stderr
        doc = run(args.pods, args.burst)
    smoke.report(doc, SHAPE, smoke=args.smoke, invariants=invariants)
    return 0


def missing_go() -> list[str]:
    """The cluster's binaries and the test image's probe are built with Go unless $KUBE_BIN is set."""
    if Path("/usr/local/go/bin/go").is_file() or shutil.which("go"):
        return []
    return ["go (/usr/local/go; scripts/setup-host.sh installs it) to build the cluster and its test image"]


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
