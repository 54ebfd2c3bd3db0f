"""``deploy/`` holds together: the sample config loads and plans, the kubelet settings agree with it,
the systemd unit runs commands that exist, the installer's manifests agree with the profiles and
with each other."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shim.config import load_config
from tests.cli.vmsandbox_cmd import DEPLOY, MANIFESTS, TWO_SOCKET, vmsandbox, vmsandbox_json
from vmsandbox.host import parse_cpulist


def test_sample_config_plans_with_the_sample_profiles() -> None:
    code, doc = vmsandbox_json(
        "plan", MANIFESTS / "guaranteed-pod.yaml", "--config", DEPLOY / "config.yaml", "--host-sysfs", TWO_SOCKET
    )
    assert code == 0
    assert (doc["handler"], doc["profile"]) == ("vmsandbox", "small")  # runtimeClassName: vmsandbox
    assert doc["host"]["owned_cpus"] == "2-7"
    assert set(doc["placement"]["cpus"]) <= set(range(2, 8))


def test_kubelet_reserved_cpus_are_the_complement_of_the_pool() -> None:
    config = load_config(str(DEPLOY / "config.yaml"))
    kubelet = yaml.safe_load((DEPLOY / "kubelet-config.yaml").read_text())
    assert kubelet["kind"] == "KubeletConfiguration"
    reserved = set(parse_cpulist(kubelet["reservedSystemCPUs"]))
    pool = set(config.cpu_pool or ())
    assert reserved.isdisjoint(pool) and reserved | pool == set(range(8))  # the 8-CPU example node
    assert kubelet["containerRuntimeEndpoint"] == f"unix://{config.socket_path}"
    assert config.metrics_address == "127.0.0.1:9464" and config.log_format == "json"


def test_systemd_unit_commands_exist() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "vmsandbox.service")
    start = unit["Service"]["ExecStart"].split()
    pre = unit["Service"]["ExecStartPre"].split()
    assert start[1:3] == ["serve", "--config"] and pre[1:3] == ["profile", "validate"]
    for words in (start[1:2], pre[1:3]):
        assert vmsandbox(*words, "--help").returncode == 0


INSTALL = DEPLOY / "install"


def test_the_installers_runtime_classes_are_the_profiles() -> None:
    done = vmsandbox("profile", "runtimeclass", DEPLOY / "profiles.yaml")
    assert done.returncode == 0, done.stderr
    generated = done.stdout.replace(str(DEPLOY / "profiles.yaml"), "deploy/profiles.yaml")  # the header names it
    assert (INSTALL / "40-runtimeclass.yaml").read_text() == generated
    assert (DEPLOY / "runtimeclass.yaml").read_text() == generated


def test_the_installers_pod_reads_every_setting_of_its_config_map(tmp_path: Path) -> None:
    config_map = yaml.safe_load((INSTALL / "20-configmap.yaml").read_text())
    daemonset = yaml.safe_load((INSTALL / "30-daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]["spec"]
    keys = {
        e["valueFrom"]["configMapKeyRef"]["key"]
        for e in pod["containers"][0]["env"]
        if "configMapKeyRef" in e.get("valueFrom", {})
    }
    assert keys | {"config.yaml"} == set(config_map["data"])
    assert pod["nodeSelector"] == {"vmsandbox.dev/install": "true"}
    assert pod["hostPID"] and pod["hostNetwork"] and pod["containers"][0]["securityContext"]["privileged"]
    # the daemon's configuration loads (shim mode) and names containerd
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"].replace("[profiles.yaml]", f"[{DEPLOY / 'profiles.yaml'}]"))
    config = load_config(str(path))
    assert config.containerd_address == "/run/containerd/containerd.sock"


def test_the_installers_entrypoint_parses() -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("no busybox")
    done = subprocess.run(
        [busybox, "sh", "-n", str(INSTALL / "image" / "entrypoint.sh")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
