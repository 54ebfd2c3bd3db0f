"""The installer of ``deploy/install/`` in the one-node cluster, from a node with plain containerd
(``CLUSTER_MODE=plain``: no vmsandbox, the node labelled ``vmsandbox.dev/install=true``):
``kubectl apply`` of its manifests (the image built by ``deploy/install/image/build.sh`` and pushed
to the cluster's registry; the ConfigMap pointing every path into the cluster's directory) makes the
node ready (the DaemonSet's pod ready, the node labelled ``vmsandbox.dev/runtime=true``), a pod of
the ``vmsandbox`` RuntimeClass then runs in a VM, and ``kubectl delete`` of the same manifests puts
the node back: the files the installer touches (with their modes and hashes), containerd's
configuration and drop-ins, the node's labels, the processes and mounts of the installed daemon and
its domains are as they were before (mounts: those under the cluster's directory, where every path of
the install is)."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gen.cri.runtime.v1 import api_pb2 as pb
from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc
from tests.integration.cluster_support import REGISTRY, Cluster, apply, push_image, running_cluster, until
from tests.shim_kit import REPO, state_domains
from vmsandbox.containerd_config import SHIM_DIR_FILE, launcher_name

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(2400)]

INSTALL = REPO / "deploy" / "install"
INSTALLER_IMAGE = f"{REGISTRY}/vmsandbox/installer:test"
NAMESPACE = "vmsandbox-system"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from running_cluster(mode="plain")


def installed(cluster: Cluster) -> Path:
    """Where the installed daemon keeps its state, sockets and consoles (the installer makes it)."""
    return cluster.dir / "vms"


def overrides(cluster: Cluster) -> dict[str, str]:
    """The ConfigMap's values for this cluster: every path in its directory, containerd restarted by
    ``scripts/containerd.sh restart``, the host's namespace that of the cluster's containerd."""
    c = cluster.dir
    shim = yaml.safe_load((c / "shim" / "config.yaml").read_text())
    vms = installed(cluster)
    config = {
        "containerd_address": f"{c}/containerd/containerd.sock",
        "containerd_root": f"{c}/containerd/root",
        "containerd_shim_dir": f"{vms}/run/containerd",
        "socket_path": f"{vms}/run/vmsandbox.sock",
        "state_dir": f"{vms}/state",
        "console_dir": f"{vms}/console",
        "libvirt_uri": "qemu:///system",
        "profile_files": ["profiles.yaml"],
        "default_handler": "vmsandbox",
        "shared_cpus": shim["shared_cpus"],
        "kubelet_pods_dir": shim["kubelet_pods_dir"],
    }
    port = os.environ.get("CLUSTER_APISERVER_PORT", "16443")
    return {
        "prefix": f"{c}/opt/vmsandbox",
        "containerd-config": f"{c}/containerd/config.toml",
        # not in the directory containerd.sh's configuration imports: the install adds it to `imports`
        "containerd-drop-in": f"{c}/containerd/vmsandbox.d/vmsandbox.toml",
        "launcher-dir": f"{c}/bin",
        "restart-command": f"CONTAINERD_BIN_DIR={c}/bin bash {REPO}/scripts/containerd.sh restart {c}/containerd",
        "host-pid-file": f"{c}/containerd/containerd.pid",
        "host-python": os.path.realpath(sys.executable),
        "api-server": f"https://127.0.0.1:{port}",
        "kubelet-kubeconfig": f"{c}/pki/kubelet.kubeconfig",
        "config.yaml": yaml.safe_dump(config, sort_keys=False),
    }


def manifests(cluster: Cluster, out: Path) -> Path:
    """deploy/install/ with the test's image and ConfigMap values, written to ``out``; nothing else
    changed."""
    out.mkdir()
    for source in sorted(INSTALL.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(source.read_text()) if d]
        for doc in docs:
            if doc["kind"] == "ConfigMap":
                assert set(overrides(cluster)) == set(doc["data"]), "the test sets every key of the ConfigMap"
                doc["data"] = overrides(cluster)
            if doc["kind"] == "DaemonSet":
                doc["spec"]["template"]["spec"]["containers"][0]["image"] = INSTALLER_IMAGE
        (out / source.name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return out


def files(*roots: Path) -> dict[str, str]:
    """Every path under ``roots`` (those that exist): its mode and hash, or its link's target."""
    out: dict[str, str] = {}

    def one(p: Path) -> None:
        st = p.lstat()
        if p.is_symlink():
            out[str(p)] = f"link -> {os.readlink(p)}"
        elif p.is_dir():
            out[str(p)] = f"dir {st.st_mode & 0o7777:o}"
        else:
            out[str(p)] = f"file {st.st_mode & 0o7777:o} {hashlib.sha256(p.read_bytes()).hexdigest()}"

    for root in roots:
        if not os.path.lexists(root):
            continue
        one(root)
        if root.is_dir() and not root.is_symlink():
            for dirpath, dirnames, filenames in os.walk(root):
                for name in sorted(dirnames + filenames):
                    one(Path(dirpath, name))
    return out


def our_processes(cluster: Cluster) -> list[str]:
    """Processes whose command line names the cluster's install (the daemon, the launcher) or its
    QEMUs' consoles."""
    out = []
    needles = (str(cluster.dir / "opt"), str(installed(cluster)))
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            out.append(cmdline[:200])
    return sorted(out)


def our_domains(cluster: Cluster) -> list[str]:
    """libvirt's domains whose definition names the cluster's install (their consoles are there)."""
    virsh = ["virsh", "-c", "qemu:///system"]
    names = subprocess.run([*virsh, "list", "--all", "--name"], capture_output=True, text=True, check=True)
    out = []
    for name in filter(None, names.stdout.split()):
        xml = subprocess.run([*virsh, "dumpxml", name], capture_output=True, text=True, check=False).stdout
        if str(installed(cluster)) in xml:
            out.append(name)
    return sorted(out)


def node_mounts(cluster: Cluster) -> list[str]:
    """The mount points, with their types, in the node's mount namespace (containerd's and the
    kubelet's) under the cluster's directory and the installer's default prefix, but containerd's
    own (running containers'); mounts elsewhere are other processes' of the host."""
    pid = (cluster.dir / "containerd" / "containerd.pid").read_text().strip()
    under = (f"{cluster.dir}/", "/opt/vmsandbox")
    skip = (str(cluster.dir / "containerd" / "state"), str(cluster.dir / "containerd" / "root"))
    out = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        point, fstype = fields[4], fields[fields.index("-") + 1]
        if point.startswith(under) and not point.startswith(skip):
            out.append(f"{point} {fstype}")
    return sorted(out)


def host_snapshot(cluster: Cluster) -> dict[str, Any]:
    c = cluster.dir
    node = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"][0]
    return {
        "files": files(
            c / "opt",
            installed(cluster),
            c / "bin",
            c / "containerd" / "config.toml",
            c / "containerd" / "conf.d",
            c / "containerd" / "vmsandbox.d",
            Path("/opt/vmsandbox"),
            Path("/usr/local/bin/containerd-shim-vmsandbox-v1"),
            Path(f"/usr/local/bin/{SHIM_DIR_FILE}"),
            Path("/etc/containerd/conf.d/vmsandbox.toml"),
        ),
        "containerd config": (c / "containerd" / "config.toml").read_text(),
        "node labels": node["metadata"]["labels"],
        "processes": our_processes(cluster),
        "domains": our_domains(cluster),
        "mounts": node_mounts(cluster),
        "runtime classes": cluster.kubectl("get", "runtimeclass", "-o", "name").stdout.split(),
    }


def installer_log(cluster: Cluster) -> str:
    done = cluster.kubectl("-n", NAMESPACE, "logs", "daemonset/vmsandbox-installer", "--tail", "60", check=False)
    return done.stdout + done.stderr


def sandboxes(cluster: Cluster) -> list[pb.PodSandbox]:
    """The installed daemon's pods, on its own CRI socket."""
    with grpc.insecure_channel(f"unix:{installed(cluster) / 'run' / 'vmsandbox.sock'}") as channel:
        rt = pb_grpc.RuntimeServiceStub(channel)
        return list(rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items)


def vm_pod(image: str) -> dict[str, Any]:
    resources = {"cpu": "300m", "memory": "96Mi"}
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "installed-vm", "namespace": "default"},
        "spec": {
            "runtimeClassName": "vmsandbox",
            "terminationGracePeriodSeconds": 2,
            "containers": [{"name": "main", "image": image, "resources": {"requests": resources, "limits": resources}}],
        },
    }  # fmt: skip


def test_install_runs_vm_pods_and_its_removal_puts_the_node_back(cluster: Cluster, tmp_path: Path) -> None:
    before = host_snapshot(cluster)
    assert before["node labels"].get("vmsandbox.dev/install") == "true"
    assert "vmsandbox.dev/runtime" not in before["node labels"] and before["runtime classes"] == []

    t0 = time.monotonic()
    built = subprocess.run(
        ["bash", str(INSTALL / "image" / "build.sh"), INSTALLER_IMAGE],
        capture_output=True,
        text=True,
        env={**os.environ, "INSECURE": "1"},
        timeout=900,
        check=False,
    )
    assert built.returncode == 0, f"build.sh failed:\n{built.stderr[-4000:]}"
    print(f"\ninstaller image built and pushed in {time.monotonic() - t0:.1f} s")
    dir_ = manifests(cluster, tmp_path / "install")
    hello = push_image(tmp_path)

    t0 = time.monotonic()
    cluster.kubectl("apply", "-f", str(dir_))

    def ready() -> bool:
        ds = json.loads(
            cluster.kubectl("-n", NAMESPACE, "get", "daemonset", "vmsandbox-installer", "-o", "json").stdout
        )
        labels = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"][0]["metadata"]["labels"]
        return bool(ds["status"].get("numberReady") == 1 and labels.get("vmsandbox.dev/runtime") == "true")

    try:
        until("the installer's pod ready and the node labelled", 600, ready)
    except AssertionError:
        print(installer_log(cluster))
        raise
    print(f"node ready for VM pods {time.monotonic() - t0:.1f} s after kubectl apply")
    drop_in = cluster.dir / "containerd" / "vmsandbox.d" / "vmsandbox.toml"
    runtimes = tomllib.loads(drop_in.read_text())["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert runtimes["vmsandbox"]["runtime_type"] == "io.containerd.vmsandbox.v1"
    assert all("options" not in r for r in runtimes.values()), runtimes
    assert str(drop_in) in (cluster.dir / "containerd" / "config.toml").read_text()
    # each handler's launcher on containerd's PATH, the daemon's shim directory named beside them
    for handler in runtimes:
        assert (cluster.dir / "bin" / launcher_name(handler)).is_symlink(), handler
    shim_dir = (cluster.dir / "bin" / SHIM_DIR_FILE).read_text()
    assert shim_dir == f"{installed(cluster)}/run/containerd\n"

    try:
        apply(cluster, tmp_path, vm_pod(hello))
        until(
            "the VM pod Running",
            400,
            lambda: (
                json.loads(cluster.kubectl("get", "pod", "installed-vm", "-o", "json").stdout)["status"].get("phase")
                == "Running"
            ),
        )
        # a VM of the installed daemon's, booted from the guest image the installer brought
        names = [s.metadata.name for s in sandboxes(cluster)]
        assert names == ["installed-vm"], names
        assert len(state_domains(installed(cluster) / "state")) == 1
        until("its log", 60, lambda: "hello from a docker image" in cluster.kubectl("logs", "installed-vm").stdout)
        print(cluster.kubectl("logs", "installed-vm").stdout)
        cluster.kubectl("delete", "pod", "installed-vm", "--wait=true", timeout=180)
        until("the VM pod gone", 180, lambda: sandboxes(cluster) == [])
    except AssertionError:
        print(installer_log(cluster))
        raise

    t0 = time.monotonic()
    # the uninstall's log, followed while the pod goes
    log_path = tmp_path / "uninstall.log"
    with log_path.open("w") as log:
        follow = subprocess.Popen(
            cluster.kubectl_argv("-n", NAMESPACE, "logs", "-f", "daemonset/vmsandbox-installer", "--tail", "5"),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        cluster.kubectl("delete", "-f", str(dir_), "--wait=true", "--timeout=420s", timeout=480)
    except AssertionError:
        node_log = cluster.dir / "opt" / "vmsandbox" / "node.log"  # the uninstall's own log on the host
        print(f"--- {node_log}\n" + (node_log.read_text()[-8000:] if node_log.is_file() else "(none)"))
        raise
    finally:
        if follow.poll() is None:
            follow.terminate()
        follow.wait(timeout=30)
    uninstall_log = log_path.read_text()
    print(uninstall_log)
    until(
        "the installer's namespace gone",
        120,
        lambda: cluster.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0,
    )
    print(f"uninstalled {time.monotonic() - t0:.1f} s after kubectl delete")
    # the uninstall may outlive its pod (it runs on the host, out of the container's cgroups)
    deadline = time.monotonic() + 180
    while (after := host_snapshot(cluster)) != before and time.monotonic() < deadline:
        time.sleep(2)
    if after != before:
        diff = difflib.unified_diff(
            json.dumps(before, indent=1, sort_keys=True).splitlines(),
            json.dumps(after, indent=1, sort_keys=True).splitlines(),
            "before",
            "after",
            lineterm="",
        )
        node_log = cluster.dir / "opt" / "vmsandbox" / "node.log"  # kept when the uninstall did not finish
        kept = node_log.read_text() if node_log.is_file() else ""
        pytest.fail(
            "the node is not as it was:\n"
            + "\n".join(diff)
            + "\n--- the uninstall's log\n"
            + uninstall_log
            + ("\n--- node.log\n" + kept if kept else "")
        )
