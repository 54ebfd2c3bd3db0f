"""``LinuxPodSandboxConfig.cgroup_parent`` at the translation edge (shim.translate.inbound): kept as
it is in the pod's spec when it is an absolute cgroupfs path (``vmsandbox.pod_cgroup``), refused
precisely otherwise, before anything is held."""

from __future__ import annotations

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from shim.translate import inbound
from vmsandbox.errors import InvalidArgument


def request(cgroup_parent: str) -> pb.RunPodSandboxRequest:
    return pb.RunPodSandboxRequest(
        config=pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name="web", namespace="default", uid="u-1"),
            linux=pb.LinuxPodSandboxConfig(cgroup_parent=cgroup_parent),
        ),
        runtime_handler="vmsandbox",
    )


@pytest.mark.parametrize("value", ["", "/kubepods/burstable/pod6f1c2a3e-0b1d-4c5e-9f00-123456789abc"])
def test_the_pods_cgroup_is_kept_in_its_spec(value: str) -> None:
    assert inbound.run_pod_sandbox(request(value)).spec.cgroup_parent == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("kubepods-burstable-pod1.slice", "is a systemd slice name, but this runtime's cgroup driver is cgroupfs"),
        ("/kubepods/../../etc", "must not contain an empty, '.' or '..' component"),
        ("kubepods/pod1", "must be an absolute cgroupfs path"),
        ("/" + "x" * 600, "longer than 512 bytes"),
    ],
)
def test_a_bad_cgroup_parent_is_refused_naming_the_field(value: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        inbound.run_pod_sandbox(request(value))
    assert "PodSandboxConfig.linux.cgroup_parent" in str(err.value)
    assert message in str(err.value)
