"""The NRI API and ttrpc's messages as generated from proto/gen/nri/: up to date, and the
names and numbers the wire depends on (containerd/nri v0.12.2, containerd/ttrpc v1.2.9)."""

from __future__ import annotations

import filecmp
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gen.regenerated import assert_up_to_date
from gen.nri import api_pb2, ttrpc_pb2

def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    assert_up_to_date(tmp_path, "nri")


@pytest.mark.parametrize(
    ("service", "method"),
    [
        ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin"),
        ("nri.pkg.api.v1alpha1.Runtime", "UpdateContainers"),
        ("nri.pkg.api.v1alpha1.Plugin", "Configure"),
        ("nri.pkg.api.v1alpha1.Plugin", "Synchronize"),
        ("nri.pkg.api.v1alpha1.Plugin", "RunPodSandbox"),
        ("nri.pkg.api.v1alpha1.Plugin", "UpdatePodSandbox"),
        ("nri.pkg.api.v1alpha1.Plugin", "CreateContainer"),
        ("nri.pkg.api.v1alpha1.Plugin", "PostUpdateContainer"),
    ],
)
def test_services(service: str, method: str) -> None:
    svc = api_pb2.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]]
    assert svc.full_name == service
    assert method in svc.methods_by_name


@pytest.mark.parametrize(
    ("message", "field", "number"),
    [
        (ttrpc_pb2.Request, "service", 1),
        (ttrpc_pb2.Request, "timeout_nano", 4),
        (ttrpc_pb2.Response, "status", 1),
        (ttrpc_pb2.Response, "payload", 2),
        (api_pb2.ConfigureResponse, "events", 2),
        (api_pb2.ContainerAdjustment, "annotations", 2),
        (api_pb2.ContainerAdjustment, "linux", 6),
        (api_pb2.PodSandbox, "ips", 10),
    ],
)
def test_field_numbers(message: type, field: str, number: int) -> None:
    assert message.DESCRIPTOR.fields_by_name[field].number == number  # type: ignore[attr-defined]
