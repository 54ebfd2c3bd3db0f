"""vmsandbox.resize: how far a resize grows a pod's envelope, what headroom that needs plugged, and
the refusal beyond the profile's resize_headroom."""

from __future__ import annotations

import pytest

from vmsandbox.admission import Usage
from vmsandbox.errors import Diverged
from vmsandbox.profile import Profile
from vmsandbox.resize import Growth, Plugged, container_growth, grown, needed, pod_growth
from vmsandbox.sizing import PodDemand, shape_for

MI = 1 << 20


def _shape(cpu: int, memory_mib: int, vcpus: int = 1, memory_headroom_mib: int = 256, extra: int = 0):  # type: ignore[no-untyped-def]
    profile = Profile(
        name="p",
        handler="p",
        vcpu_extra=extra,
        resize_headroom_vcpus=vcpus,
        resize_headroom_memory_bytes=memory_headroom_mib * MI,
    )
    return shape_for(PodDemand(cpu_millis=cpu, memory_bytes=memory_mib * MI, mode="linux-resources"), profile)


@pytest.mark.parametrize(
    ("cpu", "memory_mib", "extra", "growth", "want"),
    [
        (500, 64, 0, Growth(), Plugged()),  # nothing grown, nothing plugged
        (500, 64, 0, Growth(400, 0), Plugged()),  # 900m still fits the one vCPU
        (500, 64, 0, Growth(600, 0), Plugged(1, 0)),  # 1100m needs a second
        (1000, 64, 0, Growth(1000, 0), Plugged(1, 0)),
        (1000, 64, 1, Growth(1000, 0), Plugged(1, 0)),  # the profile's extra vCPU is kept, not plugged twice
        (500, 64, 0, Growth(0, 1), Plugged(0, 128 * MI)),  # memory in whole 128 MiB blocks
        (500, 64, 0, Growth(0, 129 * MI), Plugged(0, 256 * MI)),
        (500, 64, 0, Growth(-100, -MI), Plugged()),  # never a negative plug
    ],
)
def test_needed(cpu: int, memory_mib: int, extra: int, growth: Growth, want: Plugged) -> None:
    assert needed(_shape(cpu, memory_mib, extra=extra), growth) == want


def test_pod_growth_within_and_beyond_the_headroom() -> None:
    shape = _shape(500, 64)
    assert pod_growth(shape, Usage(cpu_millis=400, memory_bytes=64 * MI), who="w") == Growth()
    assert pod_growth(shape, Usage(cpu_millis=2000, memory_bytes=160 * MI), who="w") == Growth(1500, 96 * MI)
    with pytest.raises(Diverged) as err:
        pod_growth(shape, Usage(cpu_millis=3000, memory_bytes=512 * MI), who="the pod's new resources")
    message = str(err.value)
    assert message.startswith("the pod's new resources does not fit in the VM: it needs 2 more vCPUs")
    assert "the VM (1 vCPUs) can grow by 1" in message and "512Mi more memory" in message
    assert "can grow by 256Mi" in message and "resize_headroom" in message


def test_a_pod_without_headroom_is_refused_as_before() -> None:
    shape = _shape(500, 64, vcpus=0, memory_headroom_mib=0)
    assert pod_growth(shape, Usage(cpu_millis=500, memory_bytes=64 * MI), who="w") == Growth()
    with pytest.raises(Diverged, match="which cannot grow"):
        pod_growth(shape, Usage(cpu_millis=600, memory_bytes=64 * MI), who="w")
    with pytest.raises(Diverged, match="which cannot grow"):
        container_growth(shape, Growth(), [], Usage(cpu_millis=600), who="w")


def test_container_growth_keeps_what_the_pod_grew_and_adds_what_siblings_need() -> None:
    shape = _shape(500, 64)
    sibling = Usage(cpu_millis=300, memory_bytes=32 * MI)
    # fits the envelope as grown: no more growth
    assert container_growth(shape, Growth(500, 0), [sibling], Usage(cpu_millis=700), who="w") == Growth(500, 0)
    # the sum needs more: grown to it, never below what was grown
    got = container_growth(shape, Growth(100, 0), [sibling], Usage(cpu_millis=900, memory_bytes=48 * MI), who="w")
    assert got == Growth(700, 16 * MI)
    assert grown(shape.demand, got).cpu_millis == 1200
    with pytest.raises(Diverged, match="can grow by 1"):
        container_growth(shape, Growth(), [sibling], Usage(cpu_millis=2500), who="w")


def test_the_headroom_is_reserved_with_the_shape() -> None:
    shape = _shape(500, 64, vcpus=2, memory_headroom_mib=256)
    assert (shape.vcpus, shape.reserved_vcpus) == (1, 3)
    assert shape.memory_bytes == 192 * MI  # the least a guest with hot-plug slots boots in
    assert shape.reserved_memory_bytes == (192 + 256) * MI and shape.reserved_pages == (192 + 256) // 2
