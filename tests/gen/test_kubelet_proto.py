"""The kubelet's DRA plugin and plugin registration APIs as generated from proto/gen/kubelet/: up to
date, and the names and numbers the wire depends on (k8s.io/kubelet v0.37.2, pkg/apis/dra/v1 and
pkg/apis/pluginregistration/v1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gen.kubelet.dra.v1 import api_pb2 as dra
from gen.kubelet.pluginregistration.v1 import api_pb2 as registration
from tests.gen.regenerated import assert_up_to_date


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    assert_up_to_date(tmp_path, "kubelet")


@pytest.mark.parametrize(
    ("descriptor", "service", "methods"),
    [
        (dra.DESCRIPTOR, "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
         ["NodePrepareResources", "NodeUnprepareResources"]),
        (registration.DESCRIPTOR, "pluginregistration.Registration", ["GetInfo", "NotifyRegistrationStatus"]),
    ],
)  # fmt: skip
def test_services_as_the_kubelet_calls_them(descriptor: object, service: str, methods: list[str]) -> None:
    found = {s.full_name: [m.name for m in s.methods] for s in descriptor.services_by_name.values()}  # type: ignore[attr-defined]
    assert found[service] == methods


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        (dra.Claim, {"namespace": 1, "uid": 2, "name": 3}),
        (dra.Device, {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5}),
        (dra.NodePrepareResourceResponse, {"devices": 1, "error": 2}),
        (dra.NodeUnprepareResourceResponse, {"error": 1}),
        (registration.PluginInfo, {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}),
        (registration.RegistrationStatus, {"plugin_registered": 1, "error": 2}),
    ],
)  # fmt: skip
def test_field_numbers(message: type, fields: dict[str, int]) -> None:
    got = {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]
    assert got == fields
