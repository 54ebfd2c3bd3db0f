"""The pod network's cost: what it adds to RunPodSandbox, and guest <-> namespace TCP throughput.

    .venv/bin/python bench/pod_network.py --runs 5
    .venv/bin/python bench/pod_network.py --smoke   # one run, 1 MiB transfers; checks the JSON

- **Start**: RunPodSandbox -> READY of the same pod through two shim processes running side by
  side, one with ``pod_network: cni`` (Debian's bridge + host-local + portmap plugins on a bridge
  of the benchmark's own) and one with ``pod_network: none``, interleaved; the difference is what
  the network adds. The shim's own "pod network ... in N ms" log lines give the set-up step alone
  (namespace, CNI ADD, macvtap).
- **Throughput**: a container in the guest sends ``--mib`` MiB of zeros with busybox ``nc`` to a
  receiver in a network namespace of the benchmark's own on the same bridge; the baseline sends the
  same bytes with the same busybox from a second plain namespace on the bridge. Under TCG the
  guest's side is CPU-bound, so only the ratio means anything.

Prints one JSON document. Traffic stays on the benchmark's bridge and namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smoke
from bench.qemu_direct import percentile
from bench.shim_process import shim_process
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from tests import interrupts
from tests.integration.cni_kit import PLUGIN_DIR, bridge_conflist
from tests.registry_kit import Layout, Registry, busybox_entries, push

IMAGE_DIR = os.environ.get("VMSANDBOX_IMAGE_DIR", "/var/lib/vmsandbox/images/default")
# a bridge and subnet of this run's own (from its pid), so two runs at once do not take each other's
_NET = 1 + os.getpid() % 250
BRIDGE = f"vmsbr-b{os.getpid() % 100000}"
SUBNET = f"10.234.{_NET}.0/24"
GATEWAY = f"10.234.{_NET}.1"
PEER = (f"10.234.{_NET}.200", f"10.234.{_NET}.201")  # receiver and baseline sender: outside host-local's range
PORT = 5001
BUSYBOX = "/bin/busybox"
RECEIVER = (
    "import socket,sys,time\n"
    "s=socket.create_server((sys.argv[1],int(sys.argv[2])))\n"
    "print('ready',flush=True)\n"
    "c,_=s.accept();n=0;t0=None\n"
    "while True:\n"
    "    b=c.recv(1<<16)\n"
    "    if not b: break\n"
    "    t0=t0 or time.monotonic();n+=len(b)\n"
    "print(n,time.monotonic()-t0,flush=True)\n"
)


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def make_peer(tmp: Path, name: str, address: str) -> Path:
    path = tmp / name
    path.touch()
    sh("unshare", f"--net={path}", "true")
    host_end = f"vbp{name[-1]}{uuid.uuid4().hex[:6]}"
    sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", str(_pid_holding(path)))
    sh("ip", "link", "set", host_end, "master", BRIDGE, "up")
    for cmd in (
        ["addr", "add", f"{address}/24", "dev", "eth0"],
        ["link", "set", "eth0", "up"],
        ["link", "set", "lo", "up"],
    ):
        sh("nsenter", f"--net={path}", "ip", *cmd)
    return path


def _pid_holding(path: Path) -> int:
    """A process in the namespace ``path``, so ``ip link ... netns PID`` can reach it."""
    proc = subprocess.Popen(["nsenter", f"--net={path}", "sleep", "30"])
    time.sleep(0.1)
    _HOLDERS.append(proc)
    return proc.pid


_HOLDERS: list[subprocess.Popen[bytes]] = []


def receive(peer: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["nsenter", f"--net={peer}", sys.executable, "-c", RECEIVER, PEER[0], str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def received(proc: subprocess.Popen[str]) -> float:
    assert proc.stdout is not None
    n, seconds = proc.stdout.readline().split()
    proc.wait(timeout=30)
    return int(n) / float(seconds) / (1 << 20)


def send_script(mib: int) -> str:
    return f"dd if=/dev/zero bs=65536 count={mib * 16} 2>/dev/null | {BUSYBOX} nc {PEER[0]} {PORT}"


SETUP_KEY = "network_setup_ms (namespace + CNI ADD + macvtap, from the shim's log)"
SHAPE: dict[str, Any] = {
    "benchmark": "pod_network",
    "runs": smoke.COUNT,
    "run_pod_sandbox_s": {
        "with_cni_p50": smoke.POSITIVE,
        "without_network_p50": smoke.POSITIVE,
        "added_p50_ms": smoke.FINITE,  # a difference of two noisy starts
        "ratio_p50": smoke.POSITIVE,
        "samples": smoke.Keyed(smoke.Each(smoke.POSITIVE), frozenset(("cni", "none"))),
    },
    SETUP_KEY: {"p50": smoke.POSITIVE, "samples": smoke.Each(smoke.POSITIVE)},
    "tcp_throughput_mib_s": {
        "direction": smoke.TEXT,
        "mib_per_transfer": smoke.COUNT,
        "guest_p50": smoke.POSITIVE,
        "namespace_to_namespace_p50": smoke.POSITIVE,
        "ratio_p50": smoke.POSITIVE,
        "samples": smoke.Keyed(smoke.Each(smoke.POSITIVE), frozenset(("guest", "namespace"))),
    },
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument(
        "--smoke", action="store_true", help="one run, 1 MiB transfers; check the JSON, exit 1 if wrong"
    )
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.mib = 1, 1
    smoke.require(
        smoke.missing_guest_host(),
        smoke.missing_image_tools(),
        smoke.missing_tools("ip", "unshare", "nsenter"),
        smoke.missing_files(*(PLUGIN_DIR / p for p in ("bridge", "host-local", "portmap", "loopback"))),
    )
    forward = Path("/proc/sys/net/ipv4/ip_forward").read_text()
    with tempfile.TemporaryDirectory(prefix="vmsandbox-bench-net-") as tmp_s:
        tmp = Path(tmp_s)
        try:
            result = run(tmp, args.runs, args.mib)
        finally:
            for proc in _HOLDERS:
                proc.kill()
            for peer in ("peer0", "peer1"):
                subprocess.run(["umount", "--lazy", str(tmp / peer)], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
            Path("/proc/sys/net/ipv4/ip_forward").write_text(forward)
    smoke.report(result, SHAPE, smoke=args.smoke)
    return 0


def run(tmp: Path, runs: int, mib: int) -> dict[str, object]:
    conf = tmp / "net.d"
    conf.mkdir()
    network = bridge_conflist("vmsandbox-bench", BRIDGE, SUBNET, GATEWAY, tmp / "ipam")
    ipam = network["plugins"][0]["ipam"]  # type: ignore[index]
    ipam["ranges"][0][0]["rangeEnd"] = f"10.234.{_NET}.150"
    (conf / "10-bench.conflist").write_text(json.dumps(network))
    config = tmp / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "pod_network": "cni",
                "cni_conf_dir": str(conf),
                "cni_bin_dirs": ["/usr/lib/cni"],
                "netns_dir": str(tmp / "netns"),
            }
        )
    )
    profile = tmp / "profile.yaml"
    profile.write_text(json.dumps({"name": "vmsandbox", "handler": "vmsandbox", "guest": {"image_dir": IMAGE_DIR}}))
    registry = Registry(tmp / "registry").start()
    try:
        layout = Layout(tmp / "layout")
        layout.tag("bb", layout.image([layout.layer(busybox_entries(("sh", "dd")))]))
        ref = f"{registry.host}/bench/busybox:1"
        push(layout, "bb", ref)
        for d in ("with", "without"):
            (tmp / d).mkdir()
        with (
            shim_process(tmp / "with", "--config", str(config), "--profile", str(profile), pod_network=None) as net,
            shim_process(tmp / "without", "--profile", str(profile)) as plain,
        ):
            starts: dict[str, list[float]] = {"cni": [], "none": []}
            for _ in range(runs):
                for label, rt in (("cni", net), ("none", plain)):
                    t0 = time.monotonic()
                    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=_pod(tmp)), timeout=300).pod_sandbox_id
                    starts[label].append(time.monotonic() - t0)
                    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
                    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            setup_ms = [
                int(m)
                for m in re.findall(r"pod network of \w+: .* in (\d+) ms", (tmp / "with" / "shim.log").read_text())
            ]
            throughput = _throughput(tmp, net, ref, runs, mib)
    finally:
        registry.stop()
    p50 = {k: percentile(v, 50) for k, v in starts.items()}
    return {
        "benchmark": "pod_network",
        "runs": runs,
        "run_pod_sandbox_s": {
            "with_cni_p50": round(p50["cni"], 3),
            "without_network_p50": round(p50["none"], 3),
            "added_p50_ms": round((p50["cni"] - p50["none"]) * 1000, 1),
            "ratio_p50": round(p50["cni"] / p50["none"], 3),
            "samples": {k: [round(x, 3) for x in v] for k, v in starts.items()},
        },
        SETUP_KEY: {
            "p50": percentile([float(x) for x in setup_ms], 50) if setup_ms else None,
            "samples": setup_ms,
        },
        "tcp_throughput_mib_s": throughput,
    }


def _pod(tmp: Path) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="bench", namespace="bench", uid=str(uuid.uuid4())),
        log_directory=str(tmp / "logs"),
        linux=pb.LinuxPodSandboxConfig(resources=pb.LinuxContainerResources(memory_limit_in_bytes=192 << 20)),
    )


def _throughput(tmp: Path, rt: pb_grpc.RuntimeServiceStub, ref: str, runs: int, mib: int) -> dict[str, object]:
    with grpc.insecure_channel(f"unix:{tmp / 'with' / 'cri.sock'}") as channel:
        pb_grpc.ImageServiceStub(channel).PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
    receiver_ns = make_peer(tmp, "peer0", PEER[0])
    sender_ns = make_peer(tmp, "peer1", PEER[1])
    config = _pod(tmp)
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    guest, plain = [], []
    try:
        for i in range(runs):
            proc = receive(receiver_ns)
            ctr = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name=f"send{i}"),
                image=pb.ImageSpec(image=ref),
                command=["/bin/busybox", "sh", "-c", send_script(mib)],
                log_path=f"send{i}.log",
            )
            cid = rt.CreateContainer(
                pb.CreateContainerRequest(pod_sandbox_id=sid, config=ctr, sandbox_config=config), timeout=120
            ).container_id
            rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
            guest.append(received(proc))
            rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=120)
            proc = receive(receiver_ns)
            subprocess.run(
                ["nsenter", f"--net={sender_ns}", BUSYBOX, "sh", "-c", send_script(mib)], check=True, timeout=300
            )
            plain.append(received(proc))
    finally:
        rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    return {
        "direction": "guest container -> namespace on the bridge",
        "mib_per_transfer": mib,
        "guest_p50": round(percentile(guest, 50), 2),
        "namespace_to_namespace_p50": round(percentile(plain, 50), 2),
        "ratio_p50": round(percentile(guest, 50) / percentile(plain, 50), 4),
        "samples": {"guest": [round(x, 2) for x in guest], "namespace": [round(x, 2) for x in plain]},
    }


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
