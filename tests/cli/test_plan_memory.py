"""``vmsandbox plan`` counts the ordinary memory of guests not backed by hugepages against the NUMA
node (MemTotal of the fixture's node0/meminfo, 8Gi, less its 64 x 2Mi pages, less ``memory_reserved``,
1Gi unless configured): the placement says how much it takes from which node, and a pod larger than
the node is refused (exit 1) naming the node, the shortfall and the pool's size."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.vmsandbox_cmd import ONE_NODE, vmsandbox, vmsandbox_json

MI, GI = 1 << 20, 1 << 30
PROFILE = "name: plain\nhandler: vmsandbox\npage_size: 4Ki\n"  # guest overhead: the default 64Mi


def _pod(tmp_path: Path, memory: str) -> Path:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: mem}\nspec:\n  containers:\n"
        f"    - name: app\n      image: x\n      resources: {{limits: {{cpu: '1', memory: {memory}}}}}\n"
    )
    return manifest


def _plan(tmp_path: Path, memory: str, *config: str) -> tuple[Path, list[str]]:
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(PROFILE)
    args = ["--host-sysfs", str(ONE_NODE), "--profiles", str(profiles)]
    if config:
        conf = tmp_path / "config.yaml"
        conf.write_text("\n".join(config) + "\n")
        args += ["--config", str(conf)]
    return _pod(tmp_path, memory), args


@pytest.mark.parametrize(
    ("memory", "config", "taken"),
    [
        pytest.param("1Gi", (), [{"node": 0, "bytes": GI + 64 * MI}], id="fits"),
        pytest.param("6976Mi", (), [{"node": 0, "bytes": 7040 * MI}], id="all-the-node-has"),
        pytest.param("7Gi", ("memory_reserved: 0",), [{"node": 0, "bytes": 7 * GI + 64 * MI}], id="nothing-reserved"),
    ],
)
def test_plan_shows_the_memory_a_guest_takes(
    tmp_path: Path, memory: str, config: tuple[str, ...], taken: list[dict[str, int]]
) -> None:
    manifest, args = _plan(tmp_path, memory, *config)
    code, doc = vmsandbox_json("plan", manifest, *args)
    assert code == 0, doc
    assert doc["placement"]["memory"] == taken and doc["placement"]["hugepages"] == []
    text = vmsandbox("plan", manifest, *args)
    size = f"{taken[0]['bytes'] >> 20}Mi" if taken[0]["bytes"] % GI else f"{taken[0]['bytes'] >> 30}Gi"
    assert f"; {size} of memory from node 0" in text.stdout


@pytest.mark.parametrize(
    ("memory", "config", "reason", "available"),
    [
        pytest.param(
            "1000Gi",
            (),
            "memory on node 0: need 1024064Mi, free 7040Mi (short by 1017024Mi); its pool there is only 7040Mi "
            "(MemTotal less hugepages and memory_reserved): waiting will not help",
            "7040Mi",
            id="1000Gi-pod",
        ),
        pytest.param(
            "1Gi",
            ("memory_reserved: {0: 7Gi}",),
            "memory on node 0: need 1088Mi, free 896Mi (short by 192Mi); its pool there is only 896Mi",
            "896Mi",
            id="admin-reserved-most-of-node-0",
        ),
    ],
)
def test_plan_refuses_what_no_node_can_hold(
    tmp_path: Path, memory: str, config: tuple[str, ...], reason: str, available: str
) -> None:
    manifest, args = _plan(tmp_path, memory, *config)
    code, doc = vmsandbox_json("plan", manifest, *args)
    assert code == 1
    assert reason in doc["refusal"]["reason"]
    assert doc["refusal"]["shortfalls"][0]["resource"] == "memory"
    assert doc["refusal"]["shortfalls"][0]["available"] == f"{available} free on node 0"
