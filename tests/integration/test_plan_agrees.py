"""``vmsandbox plan`` and RunPodSandbox cannot disagree: for each manifest, the plan of a shim's
host and state (``--config``, ``--state-dir``) names the VM shape and placement, then the request
the plan says a KEP-4112 kubelet would send goes through the real socket, and the sandbox the shim
boots has exactly that shape, those CPUs and those hugepages."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from gen.cri.apimachinery.resource.generated_pb2 import Quantity
from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import REPO, Shim

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SIDECAR_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "sidecar", "namespace": "test", "annotations": {"io.vmsandbox/sidecars": "proxy"}},
    "spec": {
        "initContainers": [
            {"name": "proxy", "restartPolicy": "Always", "resources": {"limits": {"cpu": "250m", "memory": "32Mi"}}},
            {"name": "setup", "resources": {"limits": {"cpu": "1", "memory": "96Mi"}}},
        ],
        "containers": [
            {"name": "app", "resources": {"limits": {"cpu": "500m", "memory": "64Mi", "hugepages-2Mi": "16Mi"}}}
        ],
    },
}
DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "web", "namespace": "test"},
    "spec": {
        "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {
                "containers": [
                    {"name": "web", "resources": {"requests": {"cpu": "300m", "memory": "48Mi"}}},
                    {"name": "log", "resources": {"limits": {"cpu": "100m", "memory": "16Mi"}}},
                ]
            },
        }
    },
}
DEFAULTS_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "defaults", "namespace": "test"},
    "spec": {"containers": [{"name": "app", "image": "busybox"}]},
}


def _resources(c: dict[str, Any]) -> pb.KubernetesResources:
    return pb.KubernetesResources(
        requests={k: Quantity(string=v) for k, v in c["requests"].items()},
        limits={k: Quantity(string=v) for k, v in c["limits"].items()},
    )


def _request(planned: dict[str, Any], annotations: dict[str, str]) -> pb.RunPodSandboxRequest:
    """The RunPodSandbox request a KEP-4112 kubelet sends for the planned pod."""
    declared = planned["pod_resources"]
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(
            name=planned["pod"]["name"], namespace=planned["pod"]["namespace"], uid=str(uuid.uuid4())
        ),
        annotations=annotations,
        pod_resources=pb.PodResourceConfig(
            init_containers=[
                pb.ContainerResourceConfig(name=c["name"], kubernetes_resources=_resources(c))
                for c in declared["init_containers"]
            ],
            containers=[
                pb.ContainerResourceConfig(name=c["name"], kubernetes_resources=_resources(c))
                for c in declared["containers"]
            ],
        ),
    )
    return pb.RunPodSandboxRequest(config=config, runtime_handler=planned["handler"])


@pytest.mark.parametrize("manifest", [SIDECAR_POD, DEPLOYMENT, DEFAULTS_POD], ids=["sidecar", "deployment", "defaults"])
def test_plan_and_run_pod_sandbox_agree(shim: Shim, tmp_path: Path, manifest: dict[str, Any]) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(manifest))
    config = shim.state_dir.parent / "config.yaml"
    argv = ["plan", str(path), "--config", str(config), "--state-dir", str(shim.state_dir), "--format", "json"]
    done = subprocess.run(
        [sys.executable, "-m", "shim", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    planned = json.loads(done.stdout)
    assert planned["fits"], planned["refusal"]
    annotations = manifest["metadata"].get("annotations", {})
    sid = shim.runtime.RunPodSandbox(_request(planned, annotations), timeout=300).pod_sandbox_id
    try:
        status = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=30)
        got = json.loads(status.info["info"])
        assert got["shape"] == planned["shape"]
        assert got["pinned_cpus"] == planned["placement"]["cpus"]
        assert got["hugepages"] == planned["placement"]["hugepages"]
        assert got["accel"] == planned["host"]["accel"]
    finally:
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
