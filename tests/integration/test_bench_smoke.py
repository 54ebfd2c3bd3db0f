"""Every benchmark runs in smoke mode, so a change that breaks one is seen: ``bench/X.py --smoke``
runs as a subprocess (the benchmark's production path with its fewest runs; it checks the shape of
its own JSON and exits 1 naming what is wrong), and must exit 0 having printed one JSON document.

Every ``bench/*.py`` is a benchmark unless it is listed in ``HELPERS`` with the reason, so a new
benchmark is covered the day it lands, and one without ``--smoke`` fails here. A benchmark the host
cannot run exits 77 naming what is missing (``bench/smoke.py``'s ``require``): that skips locally
and fails under CI, like the other integration tests. Benchmarks run one after another (most boot
guests), each under ``TIMEOUT_S``; ``-s`` shows how long each took. A benchmark stopped by SIGTERM
(what ``timeout`` sends to its process group) once its guest runs leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.smoke import SKIPPED
from tests import interrupts
from tests.shim_kit import LIBVIRT_URI, require_host

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
HELPERS = {
    "__init__.py": "makes bench/ a package",
    "shim_process.py": "starts a shim process for the benchmarks; measures nothing itself",
    "smoke.py": "the smoke mode's JSON shape check and prerequisites, shared by the benchmarks",
    "nri_noop_plugin.py": "the NRI plugin bench/nri.py starts when NRI_PLUGIN is unset; measures nothing itself",
    "table.py": "renders the README's performance table from the benchmarks' JSON; measures nothing itself",
    "proc_cpu.py": "reads processes' CPU time from /proc for cluster_start and density; measures nothing itself",
}
TIMEOUT_S = 150  # a smoke run boots at most three guests (a few seconds each under TCG)
# benchmarks that bring up the one-node cluster (scripts/cluster.sh): one cluster fits on a host, so
# they run with the exclusive tests, one at a time; the cluster's set-up and its pods take longer
CLUSTER_BENCHMARKS = {"cluster_start.py": 600}


def benchmarks() -> list[Any]:
    return [
        pytest.param(name, marks=[pytest.mark.exclusive, pytest.mark.timeout(CLUSTER_BENCHMARKS[name] + 300)])
        if name in CLUSTER_BENCHMARKS
        else name
        for name in sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)
    ]


def test_every_listed_helper_exists() -> None:
    """The exceptions stay true: a removed or renamed helper leaves the list."""
    assert sorted(name for name in HELPERS if not (BENCH / name).is_file()) == []


@pytest.mark.parametrize("name", benchmarks())
def test_benchmark_smoke_run(name: str) -> None:
    script = BENCH / name
    helped = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert helped.returncode == 0 and "--smoke" in helped.stdout, (
        f"bench/{name} has no --smoke flag (every benchmark needs one: its fewest runs and a check of its "
        f"JSON, see bench/smoke.py; a module that is not a benchmark goes in HELPERS with the reason)\n"
        f"{helped.stderr[-2000:]}"
    )
    start = time.monotonic()
    returncode, stdout, stderr = _run(script, CLUSTER_BENCHMARKS.get(name, TIMEOUT_S))
    seconds = time.monotonic() - start
    print(f"bench/{name} --smoke: exit {returncode} in {seconds:.1f} s")
    if returncode is None:
        pytest.fail(f"bench/{name} --smoke ran over its time and was interrupted\n{stderr[-3000:]}")
    if returncode == SKIPPED:
        message = f"bench/{name}: {stderr.strip()[-1000:]}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    assert returncode == 0, f"bench/{name} --smoke exited {returncode}\n{stderr[-3000:]}"
    try:
        doc = json.loads(stdout)
    except ValueError as exc:
        pytest.fail(f"bench/{name} --smoke did not print one JSON document ({exc}):\n{stdout[-2000:]}")
    assert isinstance(doc, dict) and doc, f"bench/{name} --smoke printed {stdout[:200]!r}, not a JSON object"


def _run(script: Path, timeout_s: float) -> tuple[int | None, str, str]:
    """``script --smoke``: (exit status, stdout, stderr); status None when it ran over ``timeout_s``.
    Then it is interrupted (SIGINT, so its own clean-up stops the sandboxes, shims and registries it
    started) and, if it still runs a minute later, killed with its process group (its registry);
    its shims, in sessions of their own, are stopped and their guests removed after it."""
    before = set(_bench_guests())
    proc = subprocess.Popen(
        [sys.executable, str(script), "--smoke"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # it is still alive: its group is its own
            stdout, stderr = proc.communicate()
            _remove_leftovers(before)
        return None, stdout, stderr


def _bench_guests() -> dict[str, Path]:
    """The running vmsandbox guests of benchmark runs: domain name -> the state directory its
    metadata names (``<run>/.../state``, the run's directory a ``vmsandbox-bench-`` one)."""
    import libvirt

    from vmsandbox.domain_xml import read_identity

    conn = libvirt.open(LIBVIRT_URI)
    try:
        out = {}
        for d in conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE):
            try:
                ident = read_identity(d.XMLDesc(0))
            except libvirt.libvirtError:
                continue  # gone while we looked
            if ident is not None and "/vmsandbox-bench-" in ident.state_dir:
                out[d.name()] = Path(ident.state_dir)
        return out
    finally:
        conn.close()


def _run_dir(state: Path) -> Path:
    return next(p for p in state.parents if p.name.startswith("vmsandbox-bench-"))


def _remove_leftovers(before: set[str]) -> None:
    """What a benchmark killed with SIGKILL left of its runs: the processes naming its run
    directory (its shims) are stopped, then its guests are removed by their metadata."""
    for state in set(v for k, v in _bench_guests().items() if k not in before):
        for line in _processes_naming(_run_dir(state)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":", 1)[0]), signal.SIGTERM)
        time.sleep(5)
        interrupts.remove_guests(state)


def _processes_naming(path: Path) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in text:
            found.append(f"{cmdline.parent.name}: {text[:200]}")
    return found


def test_a_benchmark_stopped_by_sigterm_leaves_nothing_behind() -> None:
    """``timeout`` stops a benchmark with SIGTERM to its process group: once its guest runs, the
    benchmark (a shim, a registry, a guest) exits 143 with no domain, process or directory left."""
    require_host()
    before = set(_bench_guests())
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "admission.py"), "--smoke"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (new := {n: w for n, w in _bench_guests().items() if n not in before}):
            if proc.poll() is not None:
                _, stderr = proc.communicate()
                if proc.returncode == SKIPPED and not os.environ.get("CI"):
                    pytest.skip(stderr.strip()[-1000:])
                pytest.fail(f"the benchmark ended (exit {proc.returncode}) before its guest ran\n{stderr[-3000:]}")
            assert time.monotonic() < deadline, "no guest of the benchmark's appeared"
            time.sleep(0.1)
        ((domain, state),) = new.items()
        work = _run_dir(state)
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "interrupted by SIGTERM" in stderr, stderr[-3000:]
    assert domain not in _bench_guests(), stderr[-3000:]
    assert _processes_naming(work) == [], stderr[-3000:]
    assert not work.exists(), sorted(str(p) for p in work.rglob("*"))[:20]
