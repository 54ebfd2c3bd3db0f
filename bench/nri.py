"""What host NRI plugins cost a VM pod (targets: CreateContainer with one no-op plugin within
1.05x of CreateContainer without NRI plus 2 ms at p50; registration of a plugin with 100
existing containers within 100 ms).

    .venv/bin/python bench/nri.py            # 300 events, 5 registrations
    .venv/bin/python bench/nri.py --smoke    # a few of each; checks the JSON

The plugin is ``NRI_PLUGIN`` when set (a plugin built from containerd/nri's stub by
tests/nri_plugin/build.sh, run with no configuration: it adjusts nothing), else
bench/nri_noop_plugin.py; the document says which. Both are started as the shim starts plugins
(from a plugin directory, the socket as fd 3) by the production ``NriHost``.

(a) ``create_overhead_ms``: what NRI adds to one CreateContainer on the production path, the
    CreateContainer event (whose answer is applied to the container) and the PostCreateContainer
    event, for a container of a pod with 10 containers. CreateContainer without NRI is a guest's
    create (hundreds of milliseconds under TCG; bench/admission.py measures it), so meeting
    "+2 ms at p50" here meets the target whatever the 5% allows beyond it.
(b) ``registration_ms``: from starting the plugin's process to its registration (RegisterPlugin,
    Configure, Synchronize with 100 containers of 50 pods); ``synchronize_ms`` the Synchronize
    call of a registered plugin alone.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from gen.nri import api_pb2 as api
from shim.nri.host import NriHost
from tests import interrupts
from vmsandbox import nri_rules

HERE = Path(__file__).resolve().parent
SHAPE = {
    "plugin": smoke.TEXT,
    "events": smoke.COUNT,
    "create_overhead_ms": {"p50": smoke.POSITIVE, "p99": smoke.POSITIVE},
    "registrations": smoke.COUNT,
    "containers": 100,
    "registration_ms": {"p50": smoke.POSITIVE, "max": smoke.POSITIVE},
    "synchronize_ms": {"p50": smoke.POSITIVE},
    "targets": {"create_overhead_p50_ms": 2.0, "registration_ms": 100.0},
    "met": {"create_overhead": smoke.BOOL, "registration": smoke.BOOL},
}


def _snapshot() -> tuple[list[api.PodSandbox], list[api.Container]]:
    pods = [api.PodSandbox(id=f"{i:064x}", name=f"pod-{i}", namespace="bench", uid=f"uid-{i}") for i in range(50)]
    ctrs = []
    for i in range(100):
        c = api.Container(id=f"{i + 1000:064x}", pod_sandbox_id=pods[i % 50].id, name=f"c{i}", env=["A=B"] * 10)
        c.linux.resources.memory.limit.value = 64 << 20
        ctrs.append(c)
    return pods, ctrs


def _plugin_dir(tmp: Path) -> tuple[Path, str]:
    plugins = tmp / "plugins"
    plugins.mkdir()
    built = os.environ.get("NRI_PLUGIN", "")
    if built:
        shutil.copy(built, plugins / "10-noop")
        return plugins, f"containerd/nri stub plugin ({built})"
    wrapper = plugins / "10-noop"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'nri_noop_plugin.py'}\n")
    wrapper.chmod(0o755)
    return plugins, "bench/nri_noop_plugin.py"


def _ms(seconds: list[float]) -> list[float]:
    return sorted(s * 1000 for s in seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--registrations", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a few runs; check the JSON, exit 1 if wrong")
    args = parser.parse_args()
    if args.smoke:
        args.events, args.registrations = 20, 2
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-nri-") as d:
        tmp = Path(d)
        plugins, which = _plugin_dir(tmp)
        config = nri_rules.NriConfig(enable=True, socket_path="", plugin_path=str(plugins), plugin_config_path="")
        registration, sync = [], []
        for _ in range(args.registrations):
            host = NriHost(config, "vmsandbox", "bench", _snapshot, lambda plugin, updates: [])
            started = time.monotonic()
            host.start()
            registration.append(time.monotonic() - started)
            if host.registered() != ["10-noop"]:
                raise SystemExit(f"bench/nri.py: the plugin did not register (registered: {host.registered()})")
            plugin = host._plugins[0]
            started = time.monotonic()
            host._synchronize(plugin)
            sync.append(time.monotonic() - started)
            host.close()
        host = NriHost(config, "vmsandbox", "bench", _snapshot, lambda plugin, updates: [])
        host.start()
        try:
            pods, ctrs = _snapshot()
            pod = pods[0]
            pod.linux.pod_resources.memory.limit.value = 640 << 20
            ctr = api.Container(pod_sandbox_id=pod.id, name="app", args=["sleep", "3600"], env=["PATH=/bin"] * 5)
            created = ctrs[0]
            target = nri_rules.Target(name="app", env=(("PATH", "/bin"),))
            overhead = []
            for _ in range(args.events):
                started = time.monotonic()
                host.create_container(pod, ctr, target)
                host.post_create_container(pod, created)
                overhead.append(time.monotonic() - started)
        finally:
            host.close()
    create = _ms(overhead)
    reg = _ms(registration)
    p50 = statistics.median(create)
    reg_p50 = statistics.median(reg)
    doc = {
        "plugin": which,
        "events": args.events,
        "create_overhead_ms": {"p50": round(p50, 3), "p99": round(create[int(len(create) * 0.99) - 1], 3)},
        "registrations": args.registrations,
        "containers": 100,
        "registration_ms": {"p50": round(reg_p50, 2), "max": round(reg[-1], 2)},
        "synchronize_ms": {"p50": round(statistics.median(_ms(sync)), 3)},
        "targets": {"create_overhead_p50_ms": 2.0, "registration_ms": 100.0},
        "met": {"create_overhead": p50 <= 2.0, "registration": reg_p50 <= 100.0},
    }
    smoke.report(doc, SHAPE, smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
