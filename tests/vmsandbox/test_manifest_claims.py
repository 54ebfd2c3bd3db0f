"""vmsandbox.manifest: a pod's spec.resourceClaims as ``vmsandbox plan`` reads them."""

from __future__ import annotations

from typing import Any

import pytest

from vmsandbox.errors import InvalidArgument
from vmsandbox.manifest import pod_from_manifest


def pod(claims: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"resourceClaims": claims, "containers": [{"name": "c", "image": "i"}]}}  # fmt: skip


def test_claims_read() -> None:
    got = pod_from_manifest(
        pod([{"name": "a", "resourceClaimTemplateName": "t"}, {"name": "b", "resourceClaimName": "c"}])
    )
    assert got.resource_claims == (("a", "t", ""), ("b", "", "c"))
    assert pod_from_manifest(pod(None)).resource_claims == ()


@pytest.mark.parametrize(
    "claims",
    [
        [{"name": "a"}],
        [{"name": "a", "resourceClaimTemplateName": "t", "resourceClaimName": "c"}],
        [{"resourceClaimName": "c"}],
        ["a"],
        {"name": "a"},
    ],
)
def test_claims_refused(claims: Any) -> None:
    with pytest.raises(InvalidArgument, match="resourceClaims"):
        pod_from_manifest(pod(claims))
