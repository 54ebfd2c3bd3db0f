"""How much a sandbox's guest may write on the host (vmsandbox.shared_storage), pure: the pod's
ephemeral-storage limit by Kubernetes' rule, else the profile's ``shared_storage``; the image that
leaves that much free; and the split of its use among the pod's containers for the kubelet."""

from __future__ import annotations

import pytest

from vmsandbox import shared_storage
from vmsandbox.profile import Profile, ProfileError, profile_from_mapping
from vmsandbox.resources import ContainerDeclaration, ContainerResources, PodDeclaration, ResourceList

GI = 1 << 30
MI = 1 << 20


def _c(name: str, limit: str | None = None, request: str | None = None) -> ContainerDeclaration:
    return ContainerDeclaration(
        name=name,
        resources=ContainerResources(
            requests=ResourceList.parse({"ephemeral-storage": request} if request else {}, where="requests"),
            limits=ResourceList.parse({"ephemeral-storage": limit} if limit else {}, where="limits"),
        ),
    )


@pytest.mark.parametrize(
    ("decl", "sidecars", "expected"),
    [
        pytest.param(None, frozenset(), None, id="no-declaration"),
        pytest.param(PodDeclaration(containers=(_c("a"), _c("b"))), frozenset(), None, id="no-limits"),
        pytest.param(
            PodDeclaration(containers=(_c("a", request="1Gi"),)), frozenset(), None, id="a-request-is-no-limit"
        ),
        pytest.param(
            PodDeclaration(containers=(_c("a", "1Gi"), _c("b", "512Mi"))), frozenset(), GI + 512 * MI, id="sum"
        ),
        pytest.param(PodDeclaration(containers=(_c("a", "1Gi"), _c("b"))), frozenset(), GI, id="one-without-adds-0"),
        pytest.param(
            PodDeclaration(init_containers=(_c("init", "3Gi"),), containers=(_c("a", "1Gi"),)),
            frozenset(),
            3 * GI,
            id="init-larger",
        ),
        pytest.param(
            PodDeclaration(init_containers=(_c("side", "1Gi"),), containers=(_c("a", "1Gi"),)),
            frozenset({"side"}),
            2 * GI,
            id="sidecar-runs-beside",
        ),
    ],
)
def test_declared_limit_follows_kubernetes_pod_limit(
    decl: PodDeclaration | None, sidecars: frozenset[str], expected: int | None
) -> None:
    assert shared_storage.declared_limit(decl, sidecars) == expected


def test_capacity_is_the_declared_limit_else_the_profile_default_within_bounds() -> None:
    declared = PodDeclaration(containers=(_c("a", "300Mi"),))
    assert shared_storage.capacity(declared, frozenset(), GI) == 300 * MI
    assert shared_storage.capacity(None, frozenset(), 2 * GI) == 2 * GI
    assert shared_storage.capacity(PodDeclaration(containers=(_c("a", "1Ki"),)), frozenset(), GI) == 8 * MI
    assert shared_storage.capacity(PodDeclaration(containers=(_c("a", "4Pi"),)), frozenset(), GI) == 8 << 40


@pytest.mark.parametrize("capacity", [8 * MI, 100 * MI, GI, 100 * GI, 8 << 40])
def test_the_image_is_a_little_larger_than_its_capacity(capacity: int) -> None:
    size = shared_storage.image_bytes(capacity)
    assert size % MI == 0
    assert capacity < size <= capacity * 1.04 + 20 * MI


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (100, [], ()),
        (100, [0, 0, 0], (34, 33, 33)),
        (100, [1, 3], (25, 75)),
        (101, [1, 1], (51, 50)),
        (10, [GI, 0, GI], (5, 0, 5)),
        (0, [5, 5], (0, 0)),
    ],
)
def test_split_is_proportional_and_exact(total: int, weights: list[int], expected: tuple[int, ...]) -> None:
    parts = shared_storage.split(total, weights)
    assert parts == expected
    assert sum(parts) == (total if weights else 0)


def test_profile_key_shared_storage() -> None:
    assert profile_from_mapping({"name": "p"}, source="t").shared_storage_bytes == GI
    assert profile_from_mapping({"name": "p", "shared_storage": "20Gi"}, source="t").shared_storage_bytes == 20 * GI
    assert Profile(name="p", handler="p").shared_storage_bytes == GI
    for bad, problem in (("1Mi", "between 8Mi and 8Ti"), ("9Ti", "between 8Mi and 8Ti"), ("lots", "quantity")):
        with pytest.raises(ProfileError, match=problem) as exc:
            profile_from_mapping({"name": "p", "shared_storage": bad}, source="t")
        assert exc.value.key == "shared_storage"
