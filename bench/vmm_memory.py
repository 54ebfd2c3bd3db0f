"""QEMU's private memory beyond guest RAM per pod, per domain option: the shim cold-boots one pod,
and its live domain (the shim's domain as today) is booted again twice side by side for each
candidate change, once as it is (the baseline) and once with that one change, both as transient
libvirt domains of this benchmark, started together so they share the host's noise.

    .venv/bin/python bench/vmm_memory.py --runs 3
    .venv/bin/python bench/vmm_memory.py --smoke   # one candidate, one run; checks the JSON

For each candidate and run: the seconds from libvirt's create to the agent's hello, QEMU's
anonymous memory at hello and after a fixed guest workload (``WORKLOAD_ROUNDS`` rounds of the
agent's ``stats`` and ``list``: the same guest code in both guests, so both TCG caches fill
comparably), each as baseline, candidate, and saved (baseline - candidate); and the same after the
workload without the TCG translation cache (QEMU's executable anonymous mapping, from its smaps),
whose filling is what makes the total swing by a MiB or two between two boots of one domain.

The figure is smaps_rollup's ``Anonymous``: the pages of this QEMU alone that no file backs (TCG
translation cache, device state, heap, thread stacks, copied-on-write data). Guest RAM is not in
it: the guests are hugepage-backed (``Private_Hugetlb``, reported apart as ``guest_ram_mib``) and
hugetlb pages are never counted as anonymous, so "beyond guest RAM" needs no subtraction.
``Private_Clean`` is not used: it counts the page cache of QEMU's binary, its libraries and the
guest kernel it read whenever no other process maps them at the moment, which depends on how many
guests the host runs, not on the pod; that page cache is shared by every pod of the host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.qemu_direct import percentile
from bench.sandbox_start import LIBVIRT_URI, live_xml, pod
from bench.shim_process import shim_process
from gen.cri.runtime.v1 import api_pb2 as pb
from tests import interrupts
from vmsandbox.adapters.agent_client import AgentClient
from vmsandbox.domain import AGENT_CHANNEL, METADATA_NS
from vmsandbox.domain_xml import read_channel_path
from vmsandbox.qemu_memory import parse_smaps_rollup

IMAGE_DIR = os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default")
HANDLER = "vmsandbox"
WORKLOAD_ROUNDS = 200
HELLO_TIMEOUT_S = 240


# -- the candidates: each one change to the shim's domain XML -------------------------------------------
def _tb_cache(mib: int) -> Callable[[ET.Element], None]:
    def change(root: ET.Element) -> None:
        features = root.find("features")
        assert features is not None
        tcg = features.find("tcg")
        if tcg is None:
            tcg = ET.SubElement(features, "tcg")
        for old in list(tcg):
            tcg.remove(old)
        ET.SubElement(tcg, "tb-cache", unit="MiB").text = str(mib)

    return change


def _machine_pc(root: ET.Element) -> None:
    """i440fx: no PCIe, so no root ports (image disks would plug into the PCI root bus instead)."""
    os_type = root.find("os/type")
    assert os_type is not None
    os_type.set("machine", "pc")
    devices = root.find("devices")
    assert devices is not None
    for c in devices.findall("controller[@type='pci']"):
        devices.remove(c)


def _no_hotplug_ports(root: ET.Element) -> None:
    """No empty root ports (libvirt still gives each device its own)."""
    devices = root.find("devices")
    assert devices is not None
    for c in devices.findall("controller[@type='pci']"):
        devices.remove(c)


def _serial_null(root: ET.Element) -> None:
    devices = root.find("devices")
    assert devices is not None
    for s in devices.findall("serial"):
        devices.remove(s)
    serial = ET.SubElement(devices, "serial", type="null")
    ET.SubElement(serial, "target", port="0")


def _no_serial(root: ET.Element) -> None:
    devices = root.find("devices")
    assert devices is not None
    for tag in ("serial", "console"):
        for s in devices.findall(tag):
            devices.remove(s)


def _virtio_serial_ports(n: int) -> Callable[[ET.Element], None]:
    def change(root: ET.Element) -> None:
        c = root.find("devices/controller[@type='virtio-serial']")
        assert c is not None
        c.set("ports", str(n))

    return change


def _feature_off(name: str) -> Callable[[ET.Element], None]:
    def change(root: ET.Element) -> None:
        features = root.find("features")
        assert features is not None
        ET.SubElement(features, name, state="off")

    return change


def _no_hpet(root: ET.Element) -> None:
    clock = root.find("clock")
    assert clock is not None
    ET.SubElement(clock, "timer", name="hpet", present="no")
    ET.SubElement(clock, "timer", name="pit", present="no")


def _rom_off(root: ET.Element) -> None:
    """No option ROM BAR on any PCI device of ours (the NIC has none already)."""
    devices = root.find("devices")
    assert devices is not None
    for tag in ("filesystem", "rng"):
        for el in devices.findall(tag):
            if el.find("rom") is None:
                ET.SubElement(el, "rom", bar="off")


QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
ET.register_namespace("qemu", QEMU_NS)


def _qemu_env(name: str, value: str) -> Callable[[ET.Element], None]:
    """An environment variable of QEMU's process (libvirt's ``<qemu:commandline>``, which taints
    the domain: measured here, not something a pod's domain may carry)."""

    def change(root: ET.Element) -> None:
        cmd = root.find(f"{{{QEMU_NS}}}commandline")
        if cmd is None:
            cmd = ET.SubElement(root, f"{{{QEMU_NS}}}commandline")
        ET.SubElement(cmd, f"{{{QEMU_NS}}}env", name=name, value=value)

    return change


CANDIDATES: dict[str, Callable[[ET.Element], None]] = {
    "tb_cache_32": _tb_cache(32),
    "tb_cache_16": _tb_cache(16),
    "tb_cache_12": _tb_cache(12),
    "tb_cache_10": _tb_cache(10),
    "tb_cache_8": _tb_cache(8),
    "malloc_arena_max_1": _qemu_env("MALLOC_ARENA_MAX", "1"),
    "machine_pc": _machine_pc,
    "no_hotplug_ports": _no_hotplug_ports,
    "serial_null": _serial_null,
    "no_serial": _no_serial,
    "virtio_serial_ports_2": _virtio_serial_ports(2),
    "smm_off": _feature_off("smm"),
    "vmport_off": _feature_off("vmport"),
    "no_hpet_pit": _no_hpet,
    "rom_bar_off": _rom_off,
}
SMOKE_CANDIDATES = ("tb_cache_8",)


def clone_xml(xml: str, label: str, work: Path, change: Callable[[ET.Element], None] | None) -> str:
    """The shim's domain as a transient domain of this benchmark: its own name, uuid, console file
    and channel socket (libvirt's), an owner no shim has (no shim's reconcile touches it; the
    benchmark's clean-up removes it by its state directory), PCI addresses left to libvirt; then
    ``change``."""
    root = ET.fromstring(xml)
    name = f"vmsandbox-vmmbench-{label}-{uuid.uuid4().hex[:8]}"
    root.find("name").text = name  # type: ignore[union-attr]
    root.find("uuid").text = str(uuid.uuid4())  # type: ignore[union-attr]
    for tag in ("id",):
        root.attrib.pop(tag, None)
    sandbox = root.find(f"metadata/{{{METADATA_NS}}}sandbox")
    if sandbox is not None:
        sandbox.set("id", uuid.uuid4().hex * 2)
        owner = sandbox.find(f"{{{METADATA_NS}}}owner")
        if owner is None:
            owner = ET.SubElement(sandbox, f"{{{METADATA_NS}}}owner")
        owner.text = "vmm-bench"
    for parent in root.iter():
        for child in list(parent):
            if child.tag in ("address", "alias") and parent.tag != "source":
                parent.remove(child)
    for source in root.iterfind("devices/channel/source"):
        source.attrib.pop("path", None)
    for source in root.iterfind("devices/serial/source"):
        source.set("path", str(work / f"{name}.console"))
    for tag in ("seclabel",):  # the live XML's labels of the dynamic model; keep our static one
        for label_el in root.findall(tag):
            if label_el.get("model") != "dac":
                root.remove(label_el)
    if change is not None:
        change(root)
    return ET.tostring(root, encoding="unicode")


@dataclass
class Guest:
    name: str
    started: float
    hello_s: float = 0.0
    at_hello: dict[str, int] | None = None
    after_workload: dict[str, int] | None = None
    error: str = ""


def tcg_code_kib(smaps: str) -> int:
    """The anonymous KiB of QEMU's executable anonymous mappings: the TCG translation cache (the
    one ``rwxp`` mapping a QEMU without split W^X has, cut by its guard pages)."""
    total, in_code = 0, False
    for line in smaps.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and len(head[1]) == 4:
            in_code = head[1] == "rwxp" and (len(head) < 6 or not head[5].startswith("/"))
        elif in_code and line.startswith("Anonymous:"):
            total += int(line.split()[1])
    return total


def _smaps(pid: int) -> dict[str, int]:
    fields = parse_smaps_rollup(Path(f"/proc/{pid}/smaps_rollup").read_bytes())
    fields["tcg"] = tcg_code_kib(Path(f"/proc/{pid}/smaps").read_text(errors="replace"))
    return fields


def run_guest(conn: Any, xml: str, guest: Guest, ready: threading.Barrier) -> None:
    """Boot the transient domain, wait for the agent's hello, measure, run the workload (after the
    other guest reached hello too), measure again."""
    try:
        dom = conn.createXML(xml, 0)
        pid = int(Path(f"/run/libvirt/qemu/{guest.name}.pid").read_text())
        socket_path = read_channel_path(dom.XMLDesc(0), AGENT_CHANNEL)
        assert socket_path, f"{guest.name}: no channel socket in its live XML"
        client = AgentClient.open(socket_path, HELLO_TIMEOUT_S, label=guest.name)
        guest.hello_s = time.monotonic() - guest.started
        time.sleep(1)  # let the guest settle after its hello
        guest.at_hello = _smaps(pid)
        ready.wait(timeout=HELLO_TIMEOUT_S)
        with client:
            for _ in range(WORKLOAD_ROUNDS):
                client.stats("", timeout_s=30)
                client.list(timeout_s=30)
        time.sleep(1)
        guest.after_workload = _smaps(pid)
    except Exception as exc:  # reported by the caller; the other guest must not wait for ever
        guest.error = f"{type(exc).__name__}: {exc}"
        ready.abort()


def pair(conn: Any, base_xml: str, change: Callable[[ET.Element], None], label: str, work: Path) -> tuple[Guest, Guest]:
    xmls = {
        "baseline": clone_xml(base_xml, "base", work, None),
        label: clone_xml(base_xml, label.replace("_", "-"), work, change),
    }
    ready = threading.Barrier(2)
    guests, threads = [], []
    try:
        for xml in xmls.values():
            name = ET.fromstring(xml).findtext("name", "")
            g = Guest(name=name, started=time.monotonic())
            guests.append(g)
            t = threading.Thread(target=run_guest, args=(conn, xml, g, ready), daemon=True)
            threads.append(t)
            t.start()
        for t in threads:
            t.join()
    finally:
        for g in guests:
            with contextlib.suppress(Exception):  # never started, or gone
                conn.lookupByName(g.name).destroy()
    for g, (what, xml) in zip(guests, xmls.items(), strict=True):
        if g.error:
            raise SystemExit(f"{what} guest {g.name}: {g.error}\n{xml}")
    return guests[0], guests[1]


def mib(kib: int) -> float:
    return round(kib / 1024, 1)


def stats(samples: list[float], digits: int = 1) -> dict[str, Any]:
    return {
        "p50": round(percentile(samples, 50), digits),
        "samples": [round(x, digits) for x in samples],
    }


_STATS = {"p50": smoke.FINITE, "samples": smoke.Each(smoke.FINITE)}
_MEM = {"baseline": _STATS, "candidate": _STATS, "saved": _STATS}
SHAPE: dict[str, Any] = {
    "benchmark": "vmm_memory",
    "runs": smoke.COUNT,
    "load_avg_1m": smoke.NON_NEGATIVE,
    "measure": "smaps_rollup Anonymous (hugetlb guest RAM excluded)",
    "workload": {"rounds": smoke.COUNT, "ops": smoke.Each(smoke.TEXT)},
    "guest": {
        "machine": smoke.TEXT,
        "vcpus": smoke.COUNT,
        "guest_ram_mib": smoke.COUNT,
        "tcg_tb_cache_mib": smoke.Maybe(smoke.COUNT),
        "hotplug_ports": smoke.NON_NEGATIVE,
    },
    "shim_pod_mib": {"at_hello": smoke.POSITIVE, "private_clean": smoke.NON_NEGATIVE},
    "candidates": smoke.Keyed(
        {
            "anon_at_hello_mib": _MEM,
            "anon_after_workload_mib": _MEM,
            "anon_without_tcg_cache_mib": _MEM,
            "hello_s": {"baseline": _STATS, "candidate": _STATS, "change": _STATS},
        }
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--memory", default="64Mi", help="pod memory; the profile adds 64Mi guest overhead")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated: " + ", ".join(CANDIDATES))
    parser.add_argument("--smoke", action="store_true", help="one candidate, one run; check the JSON, exit 1 if wrong")
    args = parser.parse_args()
    chosen = list(SMOKE_CANDIDATES) if args.smoke else [c for c in args.candidates.split(",") if c]
    if args.smoke:
        args.runs = 1
    unknown = [c for c in chosen if c not in CANDIDATES]
    if unknown or args.runs < 1:
        parser.error(f"unknown candidates {unknown}" if unknown else "--runs must be at least 1")
    smoke.require(smoke.missing_guest_host())
    import libvirt

    results: dict[str, dict[str, list[float]]] = {
        c: {k: [] for k in ("hello_b", "hello_c", "b0", "c0", "b1", "c1", "bn", "cn")} for c in chosen
    }
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-") as tmp:
        work = Path(tmp)
        profiles = work / "profiles.yaml"
        profile = {"name": HANDLER, "handler": HANDLER, "snapshots": False, "guest": {"image_dir": IMAGE_DIR}}
        profiles.write_text(json.dumps(profile))
        with shim_process(tmp, "--profile", str(profiles)) as rt:
            request = pb.RunPodSandboxRequest(config=pod("1", args.memory), runtime_handler=HANDLER)
            sid = rt.RunPodSandbox(request, timeout=300).pod_sandbox_id
            status = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=30)
            domain = json.loads(status.info["info"])["domain"]
            shim_pid = int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text())
            shim_pod = _smaps(shim_pid)
            base_xml = live_xml(domain)
            root = ET.fromstring(base_xml)
            if root.find("memoryBacking/hugepages") is None:
                raise SystemExit("the pod's guest is not hugepage-backed: its RAM would be in the anonymous figure")
            conn = libvirt.open(LIBVIRT_URI)
            try:
                for i in range(args.runs):
                    for c in chosen if i % 2 == 0 else reversed(chosen):
                        b, k = pair(conn, base_xml, CANDIDATES[c], c, work)
                        assert b.at_hello and k.at_hello and b.after_workload and k.after_workload
                        r = results[c]
                        r["hello_b"].append(b.hello_s)
                        r["hello_c"].append(k.hello_s)
                        r["b0"].append(mib(b.at_hello["Anonymous"]))
                        r["c0"].append(mib(k.at_hello["Anonymous"]))
                        r["b1"].append(mib(b.after_workload["Anonymous"]))
                        r["c1"].append(mib(k.after_workload["Anonymous"]))
                        r["bn"].append(mib(b.after_workload["Anonymous"] - b.after_workload["tcg"]))
                        r["cn"].append(mib(k.after_workload["Anonymous"] - k.after_workload["tcg"]))
                        print(
                            f"run {i} {c}: hello {b.hello_s:.2f}/{k.hello_s:.2f} s, anon at hello "
                            f"{r['b0'][-1]}/{r['c0'][-1]} MiB, after workload {r['b1'][-1]}/{r['c1'][-1]} MiB "
                            f"(without the TCG cache {r['bn'][-1]}/{r['cn'][-1]} MiB)",
                            file=sys.stderr,
                        )
            finally:
                conn.close()
    tb = root.find("features/tcg/tb-cache")

    def mem(b: list[float], c: list[float]) -> dict[str, Any]:
        return {"baseline": stats(b), "candidate": stats(c), "saved": stats([x - y for x, y in zip(b, c, strict=True)])}

    result = {
        "benchmark": "vmm_memory",
        "runs": args.runs,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "measure": "smaps_rollup Anonymous (hugetlb guest RAM excluded)",
        "workload": {"rounds": WORKLOAD_ROUNDS, "ops": ["stats", "list"]},
        "guest": {
            "machine": root.find("os/type").get("machine", ""),  # type: ignore[union-attr]
            "vcpus": int(root.findtext("vcpu", "1")),
            "guest_ram_mib": shim_pod["Private_Hugetlb"] // 1024 or int(root.findtext("memory", "0")) // 1024,
            "tcg_tb_cache_mib": int(tb.text) // 1024 if tb is not None and tb.text else None,
            "hotplug_ports": len(root.findall("devices/controller[@model='pcie-root-port']")),
        },
        "shim_pod_mib": {"at_hello": mib(shim_pod["Anonymous"]), "private_clean": mib(shim_pod["Private_Clean"])},
        "candidates": {
            c: {
                "anon_at_hello_mib": mem(r["b0"], r["c0"]),
                "anon_after_workload_mib": mem(r["b1"], r["c1"]),
                "anon_without_tcg_cache_mib": mem(r["bn"], r["cn"]),
                "hello_s": {
                    "baseline": stats(r["hello_b"], 2),
                    "candidate": stats(r["hello_c"], 2),
                    "change": stats([y - x for x, y in zip(r["hello_b"], r["hello_c"], strict=True)], 2),
                },
            }
            for c, r in results.items()
        },
    }
    smoke.report(result, SHAPE, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
