"""A CRI client that walks one pod through vmsandbox, printing what happens at each step.

Run against a live shim: ``python -m cli.demo --socket /run/vmsandbox/vmsandbox.sock``.
It declares an init container and two app containers (one with hugepages-2Mi), boots the pod,
shows the VM shape, the pinning, the host hugepages and the guest's own report, pulls ``--image``
and runs a container from it inside the VM (its log, exit code, an ExecSync), tries a divergent
CreateContainer, and finally stops and removes the pod.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from gen.cri.apimachinery.resource.generated_pb2 import Quantity
from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc


def resources(requests: dict[str, str], limits: dict[str, str]) -> pb.KubernetesResources:
    return pb.KubernetesResources(
        requests={k: Quantity(string=v) for k, v in requests.items()},
        limits={k: Quantity(string=v) for k, v in limits.items()},
    )


INIT = ("setup", resources({"cpu": "500m", "memory": "64Mi"}, {"cpu": "500m", "memory": "64Mi"}))
WEB = ("web", resources({"cpu": "1", "memory": "128Mi"}, {"cpu": "1", "memory": "128Mi"}))
CACHE = (
    "cache",
    resources(
        {"cpu": "500m", "memory": "64Mi", "hugepages-2Mi": "32Mi"},
        {"cpu": "500m", "memory": "64Mi", "hugepages-2Mi": "32Mi"},
    ),
)


def pod_config(name: str, log_directory: str) -> pb.PodSandboxConfig:
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace="default", uid=str(uuid.uuid4()), attempt=0),
        hostname=name,
        log_directory=log_directory,
        labels={"app": "vmsandbox-demo"},
        pod_resources=pb.PodResourceConfig(
            init_containers=[pb.ContainerResourceConfig(name=INIT[0], kubernetes_resources=INIT[1])],
            containers=[
                pb.ContainerResourceConfig(name=WEB[0], kubernetes_resources=WEB[1]),
                pb.ContainerResourceConfig(name=CACHE[0], kubernetes_resources=CACHE[1]),
            ],
        ),
    )


SCRIPT = (
    "echo hello from a container in the VM; echo kernel: $(uname -r); echo user: $(id); "
    "echo hostname: $(hostname); trap 'echo stopping; exit 0' TERM; while :; do sleep 1; done"
)


def container_config(name: str, res: pb.KubernetesResources, image: str) -> pb.ContainerConfig:
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=0),
        image=pb.ImageSpec(image=image),
        command=["sh", "-c", SCRIPT],
        log_path=f"{name}.log",
        kubernetes_resources=res,
    )


def wait_for_line(path: str, text: str, timeout_s: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            lines = Path(path).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        if any(text in line for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def hugepages_free() -> int:
    return int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())


def say(step: str, text: str = "") -> None:
    print(f"\n== {step}" + (f"\n{text}" if text else ""), flush=True)


def run(socket: str, handler: str, image: str, log_directory: str) -> int:
    channel = grpc.insecure_channel(f"unix:{socket}")
    rt = pb_grpc.RuntimeServiceStub(channel)
    images = pb_grpc.ImageServiceStub(channel)
    version = rt.Version(pb.VersionRequest(), timeout=10)
    status = rt.Status(pb.StatusRequest(), timeout=30)
    conditions = ", ".join(f"{c.type}={c.status}" for c in status.status.conditions)
    say(
        "runtime", f"{version.runtime_name} {version.runtime_version} (CRI {version.runtime_api_version}); {conditions}"
    )

    free_before = hugepages_free()
    say("PullImage", image)
    ref = images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=image)), timeout=300).image_ref
    print(f"pulled: {ref}")
    config = pod_config("demo-pod", log_directory)
    say(
        "RunPodSandbox",
        "declared: init setup(cpu 500m, memory 64Mi); app web(cpu 1, memory 128Mi); "
        "app cache(cpu 500m, memory 64Mi, hugepages-2Mi 32Mi)",
    )
    sandbox_id = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config, runtime_handler=handler), timeout=300)
    sid = sandbox_id.pod_sandbox_id
    st = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=30)
    info = json.loads(st.info["info"])
    shape, guest = info["shape"], info["guest"]
    free_running = hugepages_free()
    print(
        f"sandbox {sid[:12]} is {pb.PodSandboxState.Name(st.status.state)} (domain {info['domain']}, "
        f"{info['accel']}, ready in {info['boot_ms']} ms)"
    )
    print(
        f"VM shape: {shape['vcpus']} vCPUs, {shape['memory_bytes'] >> 20} MiB guest RAM backed by "
        f"{shape['backing_page_size'] >> 10} KiB pages, sized from {shape['demand']['mode']} resources"
    )
    pins = ", ".join(f"vCPU{i}->CPU{c}" for i, c in enumerate(info["pinned_cpus"]))
    print(f"pinning: {pins}; emulator threads on CPUs {info['emulator_cpus']}")
    for h in info["hugepages"]:
        print(
            f"host hugepages held: {h['pages']} x {h['page_size'] >> 10} KiB on node {h['node']} "
            f"(host HugePages_Free {free_before} -> {free_running})"
        )
    pod_ip = st.status.network.ip
    nics = ", ".join(f"{n['name']} {n['mac']} {' '.join(n['addresses'])}" for n in guest.get("nics", []))
    print(f"pod IP {pod_ip or '(none)'} from CNI; the guest's NIC: {nics or '(none)'}")
    networked = bool(pod_ip) and any(a.split("/")[0] == pod_ip for n in guest.get("nics", []) for a in n["addresses"])
    pages = ", ".join(f"{int(k)} KiB: {v['total']} total" for k, v in guest["hugepages"].items())
    print(
        f"the guest reports: {guest['vcpus']} vCPUs, MemTotal {guest['mem_total_kib']} KiB, hugepages [{pages}], "
        f"kernel {guest['kernel']}"
    )

    say("CreateContainer + StartContainer web (as declared; crun runs it inside the VM)")
    created = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sid, config=container_config(*WEB, image), sandbox_config=config),
        timeout=120,
    )
    cid = created.container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    cst = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
    print(f"container {cid[:12]} is {pb.ContainerState.Name(cst.state)}; its log ({cst.log_path}):")
    lines = wait_for_line(cst.log_path, "hostname:")
    for line in lines:
        print(f"  {line}")
    ran_ok = any("hello from a container in the VM" in line for line in lines)
    say("ExecSync web: cat /proc/meminfo | head -1")
    res = rt.ExecSync(
        pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "cat /proc/meminfo | head -1"], timeout=10), timeout=60
    )
    print(f"exit {res.exit_code}: {res.stdout.decode(errors='replace').strip()}")
    say("StopContainer web (SIGTERM, then SIGKILL after 10 s)")
    rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=10), timeout=120)
    cst = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
    print(f"{pb.ContainerState.Name(cst.state)}, exit code {cst.exit_code}, reason {cst.reason}")
    print(f"  {Path(cst.log_path).read_text().splitlines()[-1]}")

    say("CreateContainer cache (asks for more memory than declared)")
    bigger = resources(
        {"cpu": "500m", "memory": "64Mi", "hugepages-2Mi": "32Mi"},
        {"cpu": "500m", "memory": "1Gi", "hugepages-2Mi": "32Mi"},
    )
    rejected_ok = False
    try:
        rt.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=sid, config=container_config("cache", bigger, image), sandbox_config=config
            ),
            timeout=30,
        )
        print("UNEXPECTED: the divergent container was accepted")
    except grpc.RpcError as err:
        print(f"rejected: {err.code().name}: {err.details()}")
        rejected_ok = err.code() == grpc.StatusCode.FAILED_PRECONDITION

    say("StopPodSandbox + RemovePodSandbox")
    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    left = rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
    free_after = hugepages_free()
    print(f"sandboxes left: {len(left)}; host HugePages_Free back to {free_after} (was {free_before})")
    ok = networked and ran_ok and rejected_ok and free_after == free_before and not [s for s in left if s.id == sid]
    print("\ndemo " + ("completed" if ok else "FAILED"))
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", default="/run/vmsandbox/vmsandbox.sock")
    parser.add_argument("--handler", default="vmsandbox")
    parser.add_argument("--image", required=True, help="image reference the demo container runs from")
    args = parser.parse_args()
    try:
        with tempfile.TemporaryDirectory(prefix="vmsandbox-demo-logs-") as logs:
            return run(args.socket, args.handler, args.image, logs)
    except grpc.RpcError as err:
        print(f"demo failed: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
