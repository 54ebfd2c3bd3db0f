"""Node accounting of a VM pod in the one-node cluster (``scripts/cluster.sh``, whose kubelet runs
with ``--cgroups-per-qos`` and node allocatable enforced on pods): the kubelet's pod cgroup
(``/kubepods/burstable/pod<uid>``) holds the pod's QEMU, and the kubelet's summary
(``/stats/summary``, what metrics-server and eviction read) shows the pod's CPU time and memory
working set within 10% of what that cgroup on the host says at the summary's time, and so do the
pod-level series of its ``/metrics/resource`` (``pod_cpu_usage_seconds_total``,
``pod_memory_working_set_bytes``). (``kubectl top`` is not: no metrics-server is built here, and
its pod figures are the sum of the pod's containers, which for a VM pod are the guest's.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster_support import Cluster, apply, push_image, running, running_cluster, until
from vmsandbox.domain import domain_name
from vmsandbox.pod_cgroup import CONTROLLERS, parse_stat, proc_cgroups, working_set

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(1800)]

ROOT = Path("/sys/fs/cgroup")
NAME = "acct"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from running_cluster()


@pytest.fixture(scope="module")
def image(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    return push_image(tmp_path_factory.mktemp("image"))


def _pod(image: str) -> dict[str, Any]:
    # Burstable (requests, no limits); RuntimeClass vmsandbox: deploy/profiles.yaml's `small`,
    # ordinary guest memory (hugepages are not charged to a v1 memory cgroup)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "runtimeClassName": "vmsandbox",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    # some memory and CPU of its own: 32 MiB on its tmpfs, then a little work a second
                    "command": [
                        "/bin/sh",
                        "-c",
                        "dd if=/dev/zero of=/dev/shm/fill bs=1M count=32; "
                        "while :; do i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done; sleep 1; done",
                    ],
                    "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}},
                }
            ],
        },
    }


class Sampler:
    """The pod cgroup's CPU time and working set, read every 0.2 s with the host's time."""

    def __init__(self, path: str) -> None:
        self.path = path.lstrip("/")
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            cpu = int((ROOT / "cpuacct" / self.path / "cpuacct.usage").read_text())
            memory = ROOT / "memory" / self.path
            usage = int((memory / "memory.usage_in_bytes").read_text())
            self.samples.append(
                (time.time(), cpu, working_set(usage, parse_stat((memory / "memory.stat").read_text())))
            )

    def around(self, at: float, before: float = 1.5, after: float = 2.5) -> list[tuple[float, int, int]]:
        return [s for s in self.samples if at - before <= s[0] <= at + after]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _within(value: int, seen: list[int]) -> bool:
    """``value`` within 10% of the range the cgroup showed around the summary's time."""
    return 0.9 * min(seen) <= value <= 1.1 * max(seen)


def _pod_series(text: str, pod: str) -> dict[str, tuple[float, float]]:
    """The ``pod_*`` series of ``pod`` in the kubelet's /metrics/resource: name -> (value, time in s)."""
    out: dict[str, tuple[float, float]] = {}
    for line in text.splitlines():
        if line.startswith("pod_") and f'pod="{pod}"' in line and 'namespace="default"' in line:
            name = line.split("{", 1)[0]
            value, stamp_ms = line.rsplit("}", 1)[1].split()
            out[name] = (float(value), int(stamp_ms) / 1000)
    return out


def _when(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_the_kubelets_summary_counts_a_vm_pod_as_its_cgroup_does(cluster: Cluster, image: str, tmp_path: Path) -> None:
    apply(cluster, tmp_path, _pod(image))
    pod = running(cluster, NAME, time.monotonic() + 300)
    uid = pod["metadata"]["uid"]
    assert pod["status"]["qosClass"] == "Burstable"
    parent = f"/kubepods/burstable/pod{uid}"

    # the pod's QEMU, every thread of it, is in the kubelet's pod cgroup
    sandbox = [s for s in cluster.sandboxes() if s.metadata.uid == uid]
    assert len(sandbox) == 1
    pid = int(Path(f"/run/libvirt/qemu/{domain_name(sandbox[0].id)}.pid").read_text())
    for tid in Path(f"/proc/{pid}/task").iterdir():
        where = proc_cgroups((tid / "cgroup").read_text())
        assert {c: where[c] for c in CONTROLLERS} == dict.fromkeys(CONTROLLERS, parent), where
    # under node allocatable: /kubepods is limited to what the node keeps back
    limit = int((ROOT / "memory" / "kubepods" / "memory.limit_in_bytes").read_text())
    assert limit < 1 << 50, "node allocatable is not enforced on /kubepods"

    node = cluster.kubectl("get", "nodes", "-o", "jsonpath={.items[0].metadata.name}").stdout.strip()
    sampler = Sampler(parent)
    try:

        def summary_of_pod() -> dict[str, Any] | None:
            raw = cluster.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/stats/summary").stdout
            pods = [p for p in json.loads(raw)["pods"] if p["podRef"]["uid"] == uid]
            ok = (
                pods
                and pods[0].get("cpu", {}).get("usageCoreNanoSeconds")
                and pods[0].get("memory", {}).get("workingSetBytes")
            )
            return pods[0] if ok else None

        until("the pod in the kubelet's summary", 120, summary_of_pod)
        time.sleep(20)  # some more CPU time, and the guest's tmpfs filled
        checked = 0
        for _ in range(3):
            entry = summary_of_pod()
            assert entry is not None
            time.sleep(3)  # samples after the summary's time
            cpu, memory = entry["cpu"], entry["memory"]
            cpu_seen = [s[1] for s in sampler.around(_when(cpu["time"]))]
            memory_seen = [s[2] for s in sampler.around(_when(memory["time"]))]
            assert cpu_seen and memory_seen, (cpu, memory, sampler.samples[-3:])
            print(
                f"\nsummary: cpu {cpu['usageCoreNanoSeconds'] / 1e9:.2f} s (cgroup {min(cpu_seen) / 1e9:.2f}-"
                f"{max(cpu_seen) / 1e9:.2f} s), working set {memory['workingSetBytes'] >> 20} MiB (cgroup "
                f"{min(memory_seen) >> 20}-{max(memory_seen) >> 20} MiB)"
            )
            assert _within(int(cpu["usageCoreNanoSeconds"]), cpu_seen), (cpu, cpu_seen)
            assert _within(int(memory["workingSetBytes"]), memory_seen), (memory, memory_seen)
            assert int(memory["workingSetBytes"]) > 64 << 20  # the guest's RAM it touched, not a container's share
            checked += 1
            time.sleep(5)
        assert checked == 3

        # the pod-level series of /metrics/resource (what metrics-server scrapes) are the same figures
        raw = cluster.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics/resource").stdout
        time.sleep(3)
        series = _pod_series(raw, NAME)
        assert {"pod_cpu_usage_seconds_total", "pod_memory_working_set_bytes"} <= set(series), raw[-2000:]
        value, stamp = series["pod_cpu_usage_seconds_total"]
        assert _within(int(value * 1e9), [s[1] for s in sampler.around(stamp)]), (value, stamp)
        value, stamp = series["pod_memory_working_set_bytes"]
        assert _within(int(value), [s[2] for s in sampler.around(stamp)]), (value, stamp)
    finally:
        sampler.stop()
    cluster.kubectl("delete", "pod", NAME, "--wait=true", timeout=180)
    until("the pod's cgroup gone", 120, lambda: not (ROOT / "cpu" / parent.lstrip("/")).exists())
