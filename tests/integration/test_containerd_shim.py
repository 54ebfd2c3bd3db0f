"""Shim mode end to end: containerd 2.4 (the pinned build) keeps the CRI socket and runs VM pods
through vmsandbox's runtime shim (``runtime_type io.containerd.vmsandbox.v1``, ``sandboxer shim``,
added by a drop-in), driven by crictl on containerd's socket: a pod sized from its config, a
container from the image containerd pulled (its disk made once), its output in ``crictl logs``,
``crictl exec``, ``crictl port-forward`` (containerd dials the pod namespace's loopback, which
vmsandbox forwards into the guest), a divergent container refused with vmsandbox's message, and
stop/remove leaving nothing (no domain, no macvtap, no record, no loopback rule or listener) while
containerd keeps its own bookkeeping."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.containerd_shim_kit import Env, container_config, pod_config, shim_mode
from tests.integration.downstream_kit import pause_image
from tests.ports import answer_when_listening, quiet_port
from tests.shim_kit import start_shim, state_domains, stop_shim

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with shim_mode("vmsandbox-cshim-", bridge="vmsbr-csh0", subnet="10.234.0.0/24") as env:
        yield env


def test_a_vm_pod_through_containerds_socket(env: Env) -> None:
    # containerd read the handler's features from the launcher's -info
    handlers = json.loads(env.crictl("info").stdout)["runtimeHandlers"]
    features = {"recursive_read_only_mounts": True, "user_namespaces": True}
    assert {"name": "vmsandbox", "features": features} in handlers, handlers
    env.crictl("pull", env.image)
    pod = env.write("pod.json", pod_config("web"))
    sid = env.crictl("runp", "--runtime", "vmsandbox", pod).stdout.strip()
    # the same pod, seen on vmsandbox's own socket: a VM, under containerd's id
    listed = env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30)
    assert [s.id for s in listed.items] == [sid]
    inspect = json.loads(env.crictl("inspectp", sid).stdout)
    assert inspect["status"]["state"] == "SANDBOX_READY"
    ip = inspect["status"]["network"]["ip"]
    assert ip.startswith("10.234.0.")

    ctr = env.write(
        "ctr.json", container_config("hello", ["/bin/sh", "-c", "echo hello from a VM; sleep 3600"], env.image)
    )
    cid = env.crictl("create", sid, ctr, pod).stdout.strip()
    env.crictl("start", cid)
    deadline = time.monotonic() + 60
    while "hello from a VM" not in env.crictl("logs", cid).stdout:
        assert time.monotonic() < deadline, env.crictl("logs", cid).stdout
        time.sleep(0.5)
    assert env.crictl("exec", cid, "cat", "/proc/self/cgroup").returncode == 0
    # containerd's stats come from the guest's sample of the container's cgroup
    deadline = time.monotonic() + 60
    while True:
        stats = json.loads(env.crictl("stats", "-o", "json", "--id", cid).stdout)["stats"]
        if stats and int(stats[0]["memory"]["workingSetBytes"]["value"]) > 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(1)
    out = env.crictl("exec", cid, "/bin/sh", "-c", "echo $((6*7)); exit 3", check=False)
    assert out.stdout.strip() == "42" and "exit code 3" in out.stderr, out.stderr

    # a container beyond what the pod's VM holds is refused with vmsandbox's reason, when containerd
    # makes its task (StartContainer: containerd's CreateContainer only records the container)
    big = env.write("big.json", container_config("big", ["/bin/sleep", "3600"], env.image, memory=4 << 30))
    big_id = env.crictl("create", sid, big, pod).stdout.strip()
    refused = env.crictl("start", big_id, check=False)
    assert refused.returncode != 0 and "memory" in refused.stderr, refused.stderr
    env.crictl("rm", big_id)

    env.crictl("stop", "--timeout", "5", cid)
    state = json.loads(env.crictl("inspect", cid).stdout)["status"]
    assert state["state"] == "CONTAINER_EXITED" and state["exitCode"] in (137, 143), state
    env.crictl("rm", cid)
    env.crictl("stopp", sid)
    env.crictl("rmp", sid)
    assert env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items == []
    assert not [p for p in Path("/sys/class/net").iterdir() if p.name == f"vmt{sid[:12]}"]


def test_containerd_killed_and_restarted_adopts_the_running_vm_pod(env: Env) -> None:
    """kill -9 of containerd: the VM pod and its container keep running in vmsandbox; containerd,
    started again, finds them through the shim's socket (its bundles' bootstrap.json) and serves
    them as before: the container running, its output, exec."""
    pod = env.write("pod2.json", pod_config("survivor"))
    sid = env.crictl("runp", "--runtime", "vmsandbox", pod).stdout.strip()
    ctr = env.write(
        "ctr2.json",
        container_config("ticker", ["/bin/sh", "-c", "i=0; while true; do echo tick $i; i=$((i+1)); sleep 1; done"],
                         env.image),
    )  # fmt: skip
    cid = env.crictl("create", sid, ctr, pod).stdout.strip()
    env.crictl("start", cid)
    env.ctd.kill()
    time.sleep(2)
    assert [s.id for s in env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items] == [sid]
    env.ctd.up()
    state = json.loads(env.crictl("inspect", cid).stdout)["status"]["state"]
    assert state == "CONTAINER_RUNNING", state
    assert json.loads(env.crictl("inspectp", sid).stdout)["status"]["state"] == "SANDBOX_READY"
    assert env.crictl("exec", cid, "echo", "still here").stdout.strip() == "still here"
    seen = env.crictl("logs", cid).stdout
    deadline = time.monotonic() + 30
    while env.crictl("logs", cid).stdout == seen:  # output written after the restart reaches the log
        assert time.monotonic() < deadline, seen[-500:]
        time.sleep(1)
    env.crictl("stop", "--timeout", "2", cid)
    env.crictl("rm", cid)
    env.crictl("stopp", sid)
    env.crictl("rmp", sid)
    assert env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items == []


def test_vmsandbox_killed_its_pods_are_exited_for_containerd_and_removed_at_its_restart(env: Env) -> None:
    """kill -9 of vmsandbox, the shim of every VM pod: containerd sees the shim's connections go and
    reports the container exited and the pod not ready; vmsandbox, started again, removes the
    guest and everything it held (containerd never asks about a shim it lost), and the kubelet's
    StopPodSandbox and RemovePodSandbox through containerd then succeed."""
    pod = env.write("pod3.json", pod_config("orphan"))
    sid = env.crictl("runp", "--runtime", "vmsandbox", pod).stdout.strip()
    ctr = env.write("ctr3.json", container_config("sleeper", ["/bin/sleep", "3600"], env.image))
    cid = env.crictl("create", sid, ctr, pod).stdout.strip()
    env.crictl("start", cid)
    stop_shim(env.shim, kill=True)
    deadline = time.monotonic() + 60
    while json.loads(env.crictl("inspect", cid).stdout)["status"]["state"] != "CONTAINER_EXITED":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert json.loads(env.crictl("inspectp", sid).stdout)["status"]["state"] == "SANDBOX_NOTREADY"
    env.shim = start_shim(env.tmp / "shim", extra_config=env.shim_config, pull_busybox=False)
    assert env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items == []
    assert state_domains(env.shim.state_dir) == []
    assert "removed pod" in env.shim.log_text()
    env.crictl("rm", cid)
    env.crictl("stopp", sid)
    env.crictl("rmp", sid)


def test_attach_reaches_the_containers_stdin_and_output(env: Env) -> None:
    """crictl attach -i through containerd: what is typed after a while reaches the shell in the guest
    (its answer is in the container's log), and the end of stdin ends the shell (stdin_once:
    containerd's Task.CloseIO)."""
    env.crictl("pull", env.image)
    pod = env.write("pod4.json", pod_config("attach"))
    sid = env.crictl("runp", "--runtime", "vmsandbox", pod).stdout.strip()
    config = container_config("shell", ["/bin/sh"], env.image)
    config["stdin"] = True
    config["stdin_once"] = True  # containerd closes its stdin (Task.CloseIO) when the attach ends
    ctr = env.write("ctr4.json", config)
    cid = env.crictl("create", sid, ctr, pod).stdout.strip()
    env.crictl("start", cid)
    attach = subprocess.Popen(
        [env.crictl_bin, "--runtime-endpoint", env.ctd.endpoint, "attach", "-i", cid],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert attach.stdin is not None
    time.sleep(12)  # as critest's attach spec waits: the container's stdin must still be there
    attach.stdin.write(b"echo hello from attach\n")
    attach.stdin.flush()
    deadline = time.monotonic() + 60
    while "hello from attach" not in env.crictl("logs", cid).stdout:
        assert time.monotonic() < deadline, env.shim.log_text()[-2000:]
        time.sleep(1)
    attach.stdin.close()  # the end of stdin ends the shell (containerd's CloseIO: stdin once)
    attach.wait(60)
    deadline = time.monotonic() + 60
    while json.loads(env.crictl("inspect", cid).stdout)["status"]["state"] != "CONTAINER_EXITED":
        assert time.monotonic() < deadline
        time.sleep(1)
    env.crictl("stopp", sid)
    env.crictl("rmp", sid)


def test_attach_gets_the_output_of_what_it_typed(env: Env) -> None:
    """critest's attach spec through containerd: a shell without a log path (so containerd keeps no
    log of it), attached at once with stdin held open; what is typed after a couple of seconds is
    answered on the attach's own stdout, before its stdin ends, though the answer ends with no
    newline (critest's ``echo -n hello``)."""
    env.crictl("pull", env.image)
    config = pod_config("attach-out")
    del config["log_directory"]
    pod = env.write("pod5.json", config)
    sid = env.crictl("runp", "--runtime", "vmsandbox", pod).stdout.strip()
    shell = container_config("shell", ["/bin/sh"], env.image)
    del shell["log_path"]
    shell["stdin"] = True
    shell["stdin_once"] = True
    ctr = env.write("ctr5.json", shell)
    cid = env.crictl("create", sid, ctr, pod).stdout.strip()
    env.crictl("start", cid)
    attach = subprocess.Popen(
        [env.crictl_bin, "--runtime-endpoint", env.ctd.endpoint, "attach", "-i", cid],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert attach.stdin is not None and attach.stdout is not None
    out, stdout = bytearray(), attach.stdout

    def read() -> None:
        while chunk := os.read(stdout.fileno(), 4096):
            out.extend(chunk)

    threading.Thread(target=read, daemon=True).start()
    time.sleep(2)
    attach.stdin.write(b"echo -n hello\n")
    attach.stdin.flush()
    deadline = time.monotonic() + 60
    while b"hello" not in out:
        assert time.monotonic() < deadline, (bytes(out), env.shim.log_text()[-3000:])
        time.sleep(0.5)
    time.sleep(2)
    assert bytes(out) == b"hello"
    attach.stdin.close()
    attach.wait(60)
    env.crictl("stopp", sid)
    env.crictl("rmp", sid)


def test_an_image_volume_containerd_mounts_is_the_images_disk_in_the_guest(env: Env) -> None:
    """An image volume (KEP-4639) through containerd: containerd mounts the image's snapshot on the
    host and binds it into the spec; the VM pod gets the image's disk instead (made once, from the
    layers the mount table names), its sub path too."""
    env.crictl("pull", env.image)
    pod = env.write("pod5.json", pod_config("imagevol"))
    sid = env.crictl("runp", "--runtime", "vmsandbox", pod).stdout.strip()
    config = container_config(
        "reader", ["/bin/sh", "-c", "ls /vol/bin/busybox /sub/busybox && echo volumes-read; sleep 3600"], env.image
    )
    config["mounts"] = [
        {"container_path": "/vol", "image": {"image": env.image}, "readonly": True},
        {"container_path": "/sub", "image": {"image": env.image}, "image_sub_path": "bin", "readonly": True},
    ]
    cid = env.crictl("create", sid, env.write("ctr5.json", config), pod).stdout.strip()
    env.crictl("start", cid)
    deadline = time.monotonic() + 60
    while "volumes-read" not in env.crictl("logs", cid).stdout:
        assert time.monotonic() < deadline, env.crictl("logs", cid).stdout + env.shim.log_text()[-2000:]
        time.sleep(0.5)
    # written to in the guest? no: an image volume is read-only
    denied = env.crictl("exec", cid, "/bin/sh", "-c", "touch /vol/x", check=False)
    assert denied.returncode != 0, denied
    env.crictl("stop", "--timeout", "2", cid)
    env.crictl("rm", cid)
    env.crictl("stopp", sid)
    env.crictl("rmp", sid)
    assert env.shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items == []


def test_the_disk_of_an_image_containerd_removed_leaves_vmsandboxs_store(env: Env) -> None:
    """The kubelet's image GC counts and removes containerd's images only: once containerd no
    longer has an image a VM pod ran, and no container holds it, its disk leaves vmsandbox's store;
    an image containerd still has stays."""
    image = pause_image()
    env.crictl("pull", image)
    env.crictl("pull", env.image)
    pod = env.write("pod6.json", pod_config("prune"))
    sid = env.crictl("runp", "--runtime", "vmsandbox", pod).stdout.strip()
    ids = []
    for name, ref in (("gone", image), ("kept", env.image)):
        ctr = env.write(f"ctr6-{name}.json", container_config(name, ["/bin/sleep", "3600"], ref))
        cid = env.crictl("create", sid, ctr, pod).stdout.strip()
        env.crictl("start", cid)
        ids.append(cid)

    def stored() -> set[str]:
        return {i.id for i in env.shim.images.ListImages(pb.ListImagesRequest(), timeout=30).images}

    gone_id = json.loads(env.crictl("inspecti", image).stdout)["status"]["id"]
    kept_id = json.loads(env.crictl("inspecti", env.image).stdout)["status"]["id"]
    assert {gone_id, kept_id} <= stored()
    env.crictl("rmi", image)  # containerd removes an image its containers still run from
    time.sleep(5)  # prunes ran meanwhile
    assert gone_id in stored()  # held by the container in the guest
    for cid in ids:
        env.crictl("stop", "--timeout", "2", cid)
        env.crictl("rm", cid)
    env.crictl("stopp", sid)
    env.crictl("rmp", sid)
    deadline = time.monotonic() + 60
    while gone_id in stored():
        assert time.monotonic() < deadline, env.shim.log_text()[-2000:]
        time.sleep(1)
    assert kept_id in stored()
    assert "no longer has, removed from vmsandbox's store" in env.shim.log_text()


def in_netns(ns_fd: int, *argv: str) -> str:
    done = subprocess.run(
        ["nsenter", f"--net=/proc/{os.getpid()}/fd/{ns_fd}", *argv], capture_output=True, text=True, check=True
    )
    return done.stdout


def test_port_forward_through_containerd_reaches_the_guest_and_goes_with_the_pod(env: Env) -> None:
    """crictl port-forward on containerd's socket: containerd's streaming server dials
    ``localhost:<port>`` in the pod's namespace, which vmsandbox redirects to its listener there and
    relays to that port on the guest's loopback. Once the pod is removed, the namespace holds
    neither vmsandbox's rule nor its listener."""
    env.crictl("pull", env.image)
    pod = env.write("pod7.json", pod_config("forwarded"))
    sid = env.crictl("runp", "--runtime", "vmsandbox", pod).stdout.strip()
    # a server in the guest: each connection gets "pong:" and its first line back
    script = "while true; do nc -l -p 8080 -e sh -c 'read l; echo pong:$l'; done"
    ctr = env.write("ctr7.json", container_config("server", ["/bin/sh", "-c", script], env.image))
    cid = env.crictl("create", sid, ctr, pod).stdout.strip()
    env.crictl("start", cid)
    # the first connection a port-forward cannot make ends crictl's forwarding: the server listens first
    env.until_listening(env.ctd.endpoint, cid, 8080)
    record = json.loads((env.shim.state_dir / "network" / f"{sid}.json").read_text())
    ns_fd = os.open(record["netns"], os.O_RDONLY | os.O_CLOEXEC)  # the namespace, even once containerd drops it
    try:
        assert "vmsandbox port-forward" in in_netns(ns_fd, "iptables", "-t", "nat", "-S", "OUTPUT")
        assert "127.0.0.1:" in in_netns(ns_fd, "ss", "-Hltn")

        local = quiet_port()
        proc = subprocess.Popen(
            [env.crictl_bin, "--runtime-endpoint", env.ctd.endpoint, "port-forward", sid, f"{local}:8080"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            answer = answer_when_listening(local, b"ping\n", 90)  # once the container's server listens
            assert answer == b"pong:ping\n", (answer, env.shim.log_text()[-2000:])
        finally:
            proc.terminate()
            proc.wait(timeout=10)

        env.crictl("stopp", sid)
        env.crictl("rmp", sid)
        assert "vmsandbox port-forward" not in in_netns(ns_fd, "iptables", "-t", "nat", "-S", "OUTPUT")
        assert in_netns(ns_fd, "ss", "-Hltn").strip() == ""
    finally:
        os.close(ns_fd)
