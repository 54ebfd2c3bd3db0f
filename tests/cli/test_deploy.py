"""``deploy/`` holds together: the sample config loads and plans, the kubelet settings agree with it,
the systemd unit runs commands that exist."""

from __future__ import annotations

import configparser

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
