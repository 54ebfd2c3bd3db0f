"""The floor of a restore on this stack: what RunPodSandbox by restore costs, part by part, beside
what QEMU itself needs to load the very same saved guest without libvirt.

    .venv/bin/python bench/restore_floor.py --runs 5
    .venv/bin/python bench/restore_floor.py --smoke   # one run of each; checks the JSON

A shim makes the shape's snapshot (its first pod cold-boots). Then, interleaved in each run:

- ``shim``: RunPodSandbox by restore through the socket, split by the shim's own log line (image
  copy, libvirt's restore, personalize, the rest);
- ``bare``: the QEMU command line libvirt ran for that restored pod (read from its process), with
  libvirt's inherited file descriptors replaced by paths of our own, started paused with
  ``-incoming defer`` and fed the snapshot's migration stream from an open file descriptor (what
  libvirt hands QEMU; no copy): QEMU's start to its QMP greeting, the load of the saved state
  (``migrate-incoming`` to ``completed``), ``cont``; then the agent's first answer on the channel
  (it notices a host) and the ``personalize`` round trip, as the shim sends it;
- ``readback``: libvirt's guest-CPU read-back (``bench/cpu_readback.py``; 9.0 and 11.3 alike), replayed
  against that paused QEMU between the load and ``cont``;
- ``mapped_ram`` (QEMU 9.0 and later; null on older): the same saved guest migrated by a bare QEMU
  into a ``mapped-ram`` file (untimed), then loaded from it by another (timed), run and answering;
- ``direct``: a cold boot of the same guest with bare QEMU (``bench/qemu_direct.py``), the ratio's
  denominator;
- last, on libvirt 11 and later (null before), on one more restored pod: libvirt's own restore of its
  guest from a raw save image (the shim's) and from a sparse one (mapped-ram), alternately.

Run it on another libvirt and QEMU than the host's with ``scripts/backports-stack.sh run`` (the JSON's
``stack`` names what was measured).

The JSON gives p50/p95 of each part, the shim's restore against the direct boot
(``ratio_restore_p50``), the floors as ratios (QEMU alone: ``ratio_bare_qemu_p50``; QEMU plus the
read-back libvirt 9.0 cannot skip: ``ratio_bare_with_readback_p50``) and what libvirt's restore adds
beyond QEMU's own load and the read-back (``libvirt_overhead_s``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.cpu_readback import VCPU_PATH, Qmp
from bench.qemu_direct import DirectGuest, boot_direct, percentile, wait_for_hugepages
from bench.sandbox_start import (
    IMAGE_DIR,
    LIBVIRT_URI,
    RESTORE,
    SNAPSHOT_WAIT_S,
    STACK_SHAPE,
    _stats_shape,
    live_xml,
    machine_cgroup,
    pod_arguments,
    remove_pod,
    restore_phases,
    snapshot_made,
    stack_versions,
    stats,
    timed_run,
    write_profiles,
)
from bench.shim_process import shim_process
from tests import interrupts
from vmsandbox.adapters.guest_channel import GuestChannel
from vmsandbox.snapshot_rules import SEED_BYTES, parse_save_header, personalize_args

TIMEOUT_S = 60.0
SETTLE_S = float(os.environ.get("RESTORE_FLOOR_SETTLE_S", "0"))


def qemu_cmdline(domain: str) -> list[str]:
    """The argv of the running QEMU of ``domain`` (libvirt's pid file)."""
    pid = int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text())
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")


_FD_ARG = re.compile(r"(^|,)fd=\d+")


def bare_argv(libvirt_argv: list[str], tmp: Path) -> list[str]:
    """libvirt's QEMU command line made to run on its own: the monitor, the agent channel and the
    console on paths under ``tmp``, guest RAM in a hugetlbfs file of its own, the 9p shares on
    empty directories, no master-key secret (nothing uses it), and ``-incoming defer``."""
    out: list[str] = []
    it = iter(libvirt_argv)
    shares = 0
    for arg in it:
        if arg in ("-object", "-add-fd"):
            value = next(it)
            if arg == "-add-fd" or '"secret"' in value:
                continue
            doc = json.loads(value)
            if doc.get("qom-type") == "memory-backend-file":
                doc["mem-path"] = os.path.dirname(doc["mem-path"].rstrip("/")).rsplit("/libvirt/", 1)[0]
            out += [arg, json.dumps(doc)]
            continue
        if arg == "-chardev":
            value = next(it)
            kind, _, rest = value.partition(",")
            opts = {k: v for k, _, v in (o.partition("=") for o in rest.split(","))}
            if kind == "socket":
                opts.pop("fd", None)
                opts["path"] = str(tmp / f"{opts['id']}.sock")
            elif kind == "file":
                opts["path"] = str(tmp / "console.log")
            out += [arg, kind + "," + ",".join(f"{k}={v}" if v != "" else k for k, v in opts.items())]
            continue
        if arg == "-fsdev":
            value = next(it)
            share = tmp / f"share{shares}"
            shares += 1
            (share / "containers").mkdir(parents=True)
            out += [arg, re.sub(r"(^|,)path=[^,]*", rf"\1path={share}", value)]
            continue
        if _FD_ARG.search(arg):
            raise RuntimeError(f"a QEMU argument this benchmark cannot replace: {arg[:200]}")
        out.append(arg)
    return [*out, "-incoming", "defer"]


@contextmanager
def paused_qemu(
    argv: list[str], guest: DirectGuest, tmp: Path, fds: tuple[int, ...] = ()
) -> Iterator[tuple[Qmp, float]]:
    """Start ``argv`` (``bare_argv``'s: paused, ``-incoming defer``) confined like the guest, passing
    ``fds``; yields its QMP connection and the seconds from spawn to its greeting. QEMU is killed
    on the way out."""
    stderr = tmp / "qemu.stderr"
    # confined by taskset, not a preexec_fn: this process runs gRPC's threads (the shim's client),
    # and a child forked to run Python code before exec can abort in gRPC's fork handler
    cpus = ["taskset", "--cpu-list", ",".join(map(str, guest.host_cpus))] if guest.host_cpus else []
    wait_for_hugepages(guest)
    with open(stderr, "wb") as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            [*cpus, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, pass_fds=fds
        )
    try:
        qmp = Qmp(str(tmp / "charmonitor.sock"), time.monotonic() + TIMEOUT_S, proc, stderr)
        try:
            yield qmp, time.monotonic() - start
        finally:
            qmp.close()
    finally:
        proc.kill()
        proc.wait()


def wait_migration(qmp: Qmp, tmp: Path) -> None:
    """Poll ``query-migrate`` (either direction) until ``completed``; raise on failure or timeout."""
    deadline = time.monotonic() + TIMEOUT_S
    while (status := qmp.call("query-migrate").get("status")) != "completed":
        if status == "failed" or time.monotonic() > deadline:
            said = (tmp / "qemu.stderr").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"migration {status}: {said}")
        time.sleep(0.002)


def stream_fd(image: Path) -> int:
    """A descriptor on ``image`` at its migration stream (past libvirt's header), as libvirt hands
    it to QEMU."""
    with open(image, "rb") as f:
        offset = parse_save_header(f.read(2 << 20)).stream_offset
    fd = os.open(image, os.O_RDONLY)
    os.lseek(fd, offset, os.SEEK_SET)
    return fd


def read_back_cpu(qmp: Qmp) -> int:
    """libvirt's guest-CPU read-back (1 ``qom-list``, one ``qom-get`` per boolean property: 9.0 and
    11.3 alike, whatever the QEMU); the number of QMP commands."""
    flags = [p["name"] for p in qmp.call("qom-list", path=VCPU_PATH) if p.get("type") == "bool"]
    for name in flags:
        qmp.call("qom-get", path=VCPU_PATH, property=name)
    return 1 + len(flags)


def bare_restore(argv: list[str], image: Path, guest: DirectGuest, tmp: Path) -> dict[str, float]:
    """Restore the snapshot with bare QEMU; the seconds of each step (see the module docstring)."""
    fd = stream_fd(image)
    out: dict[str, float] = {}
    try:
        with paused_qemu(argv, guest, tmp, (fd,)) as (qmp, started):
            up = time.monotonic()
            out["qemu_start"] = started
            qmp.call("migrate-incoming", uri=f"fd:{fd}")
            wait_migration(qmp, tmp)
            loaded = time.monotonic()
            out["load"] = loaded - up
            out["cpu_readback_commands"] = read_back_cpu(qmp)
            read_back = time.monotonic()
            out["cpu_readback"] = read_back - loaded
            qmp.call("cont")
            running = time.monotonic()
            out["cont"] = running - read_back
            if SETTLE_S:
                time.sleep(SETTLE_S)
                running = time.monotonic()
            with GuestChannel.open(str(tmp / "charchannel0.sock"), TIMEOUT_S, "bare restore") as channel:
                answered = time.monotonic()
                out["agent_first_answer"] = answered - running
                args = personalize_args(None, "bench", seed=os.urandom(SEED_BYTES), time_ns=time.time_ns())
                channel.request("personalize", TIMEOUT_S, args)
                personalized = time.monotonic()
                out["personalize_request"] = personalized - answered
                channel.request("report", TIMEOUT_S)  # one more round trip: the channel's own floor
                out["report_request"] = time.monotonic() - personalized
    finally:
        os.close(fd)
    out["bare_qemu"] = out["qemu_start"] + out["load"] + out["cont"]
    return out


def has_mapped_ram(argv: list[str], guest: DirectGuest, tmp: Path) -> bool:
    """Whether this QEMU offers the ``mapped-ram`` migration capability (QEMU 9.0 and later)."""
    with paused_qemu(argv, guest, tmp) as (qmp, _):
        return any(c.get("capability") == "mapped-ram" for c in qmp.call("query-migrate-capabilities"))


def bare_mapped_ram(argv: list[str], image: Path, guest: DirectGuest, tmp: Path) -> dict[str, float]:
    """The same saved guest loaded from a ``mapped-ram`` file (each RAM page at a fixed offset, zero
    pages absent; what libvirt 11's ``save_image_format = "sparse"`` writes): one bare QEMU loads the
    snapshot's stream and migrates to such a file (not timed), a second loads that file, paused,
    then runs and answers the agent (to show the guest survived). The seconds of the load and of
    the first answer, and the file's allocated MiB."""
    ram = tmp / "mapped-ram.img"
    on = [{"capability": "mapped-ram", "state": True}]
    fd = stream_fd(image)
    try:
        with paused_qemu(argv, guest, tmp, (fd,)) as (qmp, _):
            qmp.call("migrate-incoming", uri=f"fd:{fd}")
            wait_migration(qmp, tmp)
            qmp.call("migrate-set-capabilities", capabilities=on)
            qmp.call("migrate", uri=f"file:{ram}")
            wait_migration(qmp, tmp)
    finally:
        os.close(fd)
    out: dict[str, float] = {"file_mib": round(os.stat(ram).st_blocks * 512 / 2**20, 1)}
    with paused_qemu(argv, guest, tmp) as (qmp, _):
        qmp.call("migrate-set-capabilities", capabilities=on)
        start = time.monotonic()
        qmp.call("migrate-incoming", uri=f"file:{ram}")
        wait_migration(qmp, tmp)
        loaded = time.monotonic()
        out["load"] = loaded - start
        read_back_cpu(qmp)
        qmp.call("cont")
        running = time.monotonic()
        with GuestChannel.open(str(tmp / "charchannel0.sock"), TIMEOUT_S, "mapped-ram restore"):
            out["agent_first_answer"] = time.monotonic() - running
    ram.unlink()
    return out


def libvirt_formats(domain: str, tmp: Path, runs: int) -> dict[str, Any] | None:
    """libvirt's own restore of one running pod's guest from a ``raw`` save image (the shim's) and from
    a ``sparse`` one (mapped-ram, libvirt 11), alternately ``runs`` times each; the seconds of each
    ``virDomainRestoreParams`` to a running guest, or None where libvirt writes no sparse images.
    The domain is left destroyed (its pod is removed next)."""
    import libvirt

    conn = libvirt.open(LIBVIRT_URI)
    try:
        if conn.getLibVersion() < 11_000_000:
            return None
        tmp.mkdir()
        images = {"raw": tmp / "raw.save", "sparse": tmp / "sparse.save"}
        file = libvirt.VIR_DOMAIN_SAVE_PARAM_FILE
        conn.lookupByName(domain).saveParams({file: str(images["raw"])}, 0)
        conn.restoreParams({file: str(images["raw"])}, libvirt.VIR_DOMAIN_SAVE_RUNNING)
        try:  # libvirt's VIR_DOMAIN_SAVE_PARAM_IMAGE_FORMAT, newer than the binding
            conn.lookupByName(domain).saveParams({file: str(images["sparse"]), "image_format": "sparse"}, 0)
        except libvirt.libvirtError:
            conn.lookupByName(domain).destroy()
            return None
        seconds: dict[str, list[float]] = {"raw": [], "sparse": []}
        for i in range(runs):
            for fmt in ("raw", "sparse") if i % 2 == 0 else ("sparse", "raw"):
                start = time.monotonic()
                conn.restoreParams({file: str(images[fmt])}, libvirt.VIR_DOMAIN_SAVE_RUNNING)
                seconds[fmt].append(time.monotonic() - start)
                conn.lookupByName(domain).destroy()
        return {
            "raw_s": stats(seconds["raw"]),
            "sparse_s": stats(seconds["sparse"]),
            "sparse_file_mib": round(os.stat(images["sparse"]).st_blocks * 512 / 2**20, 1),
        }
    finally:
        conn.close()


SHAPE: dict[str, Any] = {
    "benchmark": "restore_floor",
    "runs": smoke.COUNT,
    "load_avg_1m": smoke.NON_NEGATIVE,
    "stack": STACK_SHAPE,
    "snapshot": {"size_mib": smoke.POSITIVE, "make_s": smoke.POSITIVE},
    "shim_restore_s": _stats_shape(),
    "shim_split_s": {k: _stats_shape(smoke.FINITE) for k in ("copy", "restore", "personalize", "other")},
    "bare_split_s": {  # cont can round to 0 ms
        k: _stats_shape(smoke.NON_NEGATIVE if k == "cont" else smoke.POSITIVE)
        for k in (
            "qemu_start",
            "load",
            "cpu_readback",
            "cont",
            "agent_first_answer",
            "personalize_request",
            "report_request",
            "bare_qemu",
        )
    },
    "cpu_readback_commands": smoke.COUNT,
    "mapped_ram": smoke.Maybe(
        {"file_mib": smoke.POSITIVE, "load_s": _stats_shape(), "agent_first_answer_s": _stats_shape()}
    ),
    "libvirt_restore_by_format": smoke.Maybe(
        {"raw_s": _stats_shape(), "sparse_s": _stats_shape(), "sparse_file_mib": smoke.POSITIVE}
    ),
    "direct_boot_s": _stats_shape(),
    "libvirt_overhead_s": smoke.FINITE,
    "ratio_restore_p50": smoke.POSITIVE,
    "ratio_bare_qemu_p50": smoke.POSITIVE,
    "ratio_bare_with_readback_p50": smoke.POSITIVE,
    "target_restore_ratio": 0.12,
}


def main() -> int:
    args = pod_arguments(__doc__ or "")
    shim_s: list[float] = []
    shim_split: dict[str, list[float]] = {k: [] for k in ("copy", "restore", "personalize", "other")}
    bare: dict[str, list[float]] = {k: [] for k in SHAPE["bare_split_s"]}
    direct_s: list[float] = []
    readback_commands = 0
    mapped: dict[str, list[float]] | None = None  # None: this QEMU has no mapped-ram
    mapped_mib = 0.0
    stack: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-") as tmp:
        profiles = Path(tmp) / "profiles.yaml"
        write_profiles(profiles)
        state = Path(tmp) / "state"
        with shim_process(tmp, "--profile", str(profiles)) as rt:

            def run() -> tuple[str, float, dict[str, Any]]:
                return timed_run(rt, RESTORE, args)

            def remove(sid: str) -> None:
                remove_pod(rt, sid)

            first, _, _ = run()  # cold: the snapshot is made once it is READY
            deadline = time.monotonic() + SNAPSHOT_WAIT_S
            while (snapshot := snapshot_made(state)) is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the shim made no snapshot within {SNAPSHOT_WAIT_S} s (image {IMAGE_DIR})")
                time.sleep(0.5)
            remove(first)
            images = list((state / "snapshots").glob("*/image.save"))
            if len(images) != 1:
                raise SystemExit(f"expected one snapshot image, found {images}")
            libvirt_argv: list[str] = []
            guest: DirectGuest | None = None

            def restored() -> None:
                nonlocal libvirt_argv, guest
                sid, total, info = run()
                if info["guest"].get("start", {}).get("by") != "restore":
                    raise SystemExit(f"pod {sid[:12]} was not restored: {info['guest'].get('start')}")
                shim_s.append(total)
                ph = restore_phases(Path(tmp) / "shim.log", sid)
                for k in ("copy", "restore", "personalize"):
                    shim_split[k].append(ph[k] / 1000)
                shim_split["other"].append(total - sum(ph.values()) / 1000)
                if not libvirt_argv:
                    stack.update(stack_versions())
                    libvirt_argv = qemu_cmdline(info["domain"])
                    guest = DirectGuest.from_domain_xml(live_xml(info["domain"]), cgroup_parent=machine_cgroup())
                remove(sid)

            def bare_run() -> None:
                nonlocal readback_commands, mapped, mapped_mib
                assert guest is not None
                with tempfile.TemporaryDirectory(prefix="vmsandbox-bare-") as run_tmp:
                    steps = bare_restore(bare_argv(libvirt_argv, Path(run_tmp)), images[0], guest, Path(run_tmp))
                readback_commands = int(steps.pop("cpu_readback_commands"))
                for k, v in steps.items():
                    bare[k].append(v)
                if mapped is None:
                    return
                with tempfile.TemporaryDirectory(prefix="vmsandbox-bare-") as run_tmp:
                    got = bare_mapped_ram(bare_argv(libvirt_argv, Path(run_tmp)), images[0], guest, Path(run_tmp))
                mapped_mib = got["file_mib"]
                mapped["load"].append(got["load"])
                mapped["agent_first_answer"].append(got["agent_first_answer"])

            def direct() -> None:
                assert guest is not None
                direct_s.append(boot_direct(guest).seconds)

            restored()  # the first: it gives the command line and the guest the others copy
            with tempfile.TemporaryDirectory(prefix="vmsandbox-bare-") as run_tmp:
                assert guest is not None
                if has_mapped_ram(bare_argv(libvirt_argv, Path(run_tmp)), guest, Path(run_tmp)):
                    mapped = {"load": [], "agent_first_answer": []}
            for i in range(args.runs):
                for step in [bare_run, direct, restored] if i % 2 == 0 else [restored, bare_run, direct]:
                    if step is not restored or i > 0:
                        step()
            # last, on a pod of its own: libvirt's restore from a raw and from a sparse image
            sid, _, info = run()
            by_format = libvirt_formats(info["domain"], Path(tmp) / "formats", args.runs)
            remove(sid)
    p50 = {k: percentile(v, 50) for k, v in bare.items()}
    p50_direct = percentile(direct_s, 50)
    result = {
        "benchmark": "restore_floor",
        "runs": args.runs,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "stack": stack,
        "snapshot": snapshot,
        "shim_restore_s": stats(shim_s),
        # copy: the image to the pod's copy; restore: libvirt's (QEMU start, read-back, load, cont);
        # personalize: agent connection and the op; other: sizing, placement, define, ledger, gRPC
        "shim_split_s": {k: stats(v) for k, v in shim_split.items()},
        # bare_qemu = qemu_start + load + cont (no read-back): what QEMU itself needs
        "bare_split_s": {k: stats(v) for k, v in bare.items()},
        # QMP commands of the read-back (libvirt issues the same number against this QEMU)
        "cpu_readback_commands": readback_commands,
        # the same guest loaded by a bare QEMU from a mapped-ram file instead of the stream
        # (bare_split_s.load), when this QEMU has mapped-ram; null when it has not
        "mapped_ram": None
        if mapped is None
        else {
            "file_mib": mapped_mib,
            "load_s": stats(mapped["load"]),
            "agent_first_answer_s": stats(mapped["agent_first_answer"]),
        },
        # libvirt's restore (virDomainRestoreParams, QEMU start to running guest) of one pod's guest
        # from the raw image the shim uses and from a sparse one (mapped-ram); null before libvirt 11
        "libvirt_restore_by_format": by_format,
        "direct_boot_s": stats(direct_s),
        # libvirt's restore beyond QEMU's own start, load, cont and the CPU read-back
        "libvirt_overhead_s": round(percentile(shim_split["restore"], 50) - p50["bare_qemu"] - p50["cpu_readback"], 3),
        "ratio_restore_p50": round(percentile(shim_s, 50) / p50_direct, 3),
        "ratio_bare_qemu_p50": round(
            (p50["bare_qemu"] + p50["agent_first_answer"] + p50["personalize_request"]) / p50_direct, 3
        ),
        "ratio_bare_with_readback_p50": round(
            (p50["bare_qemu"] + p50["cpu_readback"] + p50["agent_first_answer"] + p50["personalize_request"])
            / p50_direct,
            3,
        ),
        "target_restore_ratio": 0.12,
    }
    smoke.report(result, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
