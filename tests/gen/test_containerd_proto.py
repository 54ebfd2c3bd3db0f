"""containerd's runtime shim API as generated from proto/gen/containerd/: up to date, and the
names and numbers the wire depends on (containerd/containerd/api v1.12.0, containerd v2.4.2)."""

from __future__ import annotations

import filecmp
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gen.regenerated import assert_up_to_date
from gen.containerd.cgroups.v2 import metrics_pb2 as cgroup_metrics
from gen.containerd.events import task_pb2 as events
from gen.containerd.runtime.bootstrap.v1 import bootstrap_pb2
from gen.containerd.runtime.sandbox.v1 import sandbox_pb2
from gen.containerd.runtime.task.v3 import shim_pb2
from gen.containerd.services.ttrpc.events.v1 import events_pb2
from gen.containerd.types.runc.options import oci_pb2 as runc_options
from gen.containerd.types.runtimeoptions.v1 import api_pb2 as runtimeoptions
from gen.cri.runtime.v1 import api_pb2 as cri
from shim.containerd import launch, sandbox_service
from shim.translate import containerd_spec

def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    assert_up_to_date(tmp_path, "containerd")


@pytest.mark.parametrize(
    ("descriptor", "service", "methods"),
    [
        (
            sandbox_pb2.DESCRIPTOR,
            "containerd.runtime.sandbox.v1.Sandbox",
            ["CreateSandbox", "StartSandbox", "Platform", "StopSandbox", "WaitSandbox", "SandboxStatus",
             "PingSandbox", "ShutdownSandbox", "SandboxMetrics", "UpdateSandbox"],
        ),
        (
            shim_pb2.DESCRIPTOR,
            "containerd.task.v3.Task",
            ["State", "Create", "Start", "Delete", "Pids", "Pause", "Resume", "Checkpoint", "Kill", "Exec",
             "ResizePty", "CloseIO", "Update", "Wait", "Stats", "Connect", "Shutdown"],
        ),
        (events_pb2.DESCRIPTOR, "containerd.services.events.ttrpc.v1.Events", ["Forward"]),
    ],
)  # fmt: skip
def test_services_as_containerd_calls_them(descriptor: object, service: str, methods: list[str]) -> None:
    found = {s.full_name: [m.name for m in s.methods] for s in descriptor.services_by_name.values()}  # type: ignore[attr-defined]
    assert found[service] == methods


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        (sandbox_pb2.CreateSandboxRequest, {"sandbox_id": 1, "bundle_path": 2, "rootfs": 3, "options": 4,
                                             "netns_path": 5, "annotations": 6}),
        (shim_pb2.CreateTaskRequest, {"id": 1, "bundle": 2, "rootfs": 3, "terminal": 4, "stdin": 5, "stdout": 6,
                                      "stderr": 7, "checkpoint": 8, "parent_checkpoint": 9, "options": 10}),
        (events.TaskExit, {"container_id": 1, "id": 2, "pid": 3, "exit_status": 4, "exited_at": 5}),
        (bootstrap_pb2.BootstrapResult, {"version": 1, "address": 2, "protocol": 3, "capabilities": 4,
                                         "metadata": 5, "extensions": 6}),
        (runtimeoptions.Options, {"type_url": 1, "config_path": 2, "config_body": 3}),
        (runc_options.Options, {"no_pivot_root": 1, "no_new_keyring": 2, "shim_cgroup": 3, "io_uid": 4,
                                "io_gid": 5, "binary_name": 6, "root": 7, "systemd_cgroup": 9,
                                "criu_image_path": 10, "criu_work_path": 11, "task_api_address": 12,
                                "task_api_version": 13}),
    ],
)  # fmt: skip
def test_field_numbers(message: type, fields: dict[str, int]) -> None:
    got = {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]
    assert {k: got.get(k) for k in fields} == fields


# The Any type URLs on the wire. containerd's typeurl (v2.3.0, types.go TypeURL) names a
# protobuf-go message that nobody registered by its full name, with no "type.googleapis.com/"
# prefix: the task events ("containerd.events.TaskExit", the Envelope's event), the CRI plugin's
# PodSandboxConfig in CreateSandboxRequest.options (k8s.io/cri-api v0.37.0 is protobuf-go), the
# runtime options of the bootstrap, runc's task options (CreateTaskRequest.options), and the
# cgroup v2 metrics a shim answers Stats with.
@pytest.mark.parametrize(
    ("message", "type_url"),
    [
        (events.TaskCreate, "containerd.events.TaskCreate"),
        (events.TaskStart, "containerd.events.TaskStart"),
        (events.TaskDelete, "containerd.events.TaskDelete"),
        (events.TaskExit, "containerd.events.TaskExit"),
        (events.TaskOOM, "containerd.events.TaskOOM"),
        (events.TaskExecAdded, "containerd.events.TaskExecAdded"),
        (events.TaskExecStarted, "containerd.events.TaskExecStarted"),
        (events.TaskPaused, "containerd.events.TaskPaused"),
        (events.TaskResumed, "containerd.events.TaskResumed"),
        (cri.PodSandboxConfig, "runtime.v1.PodSandboxConfig"),
        (runtimeoptions.Options, "runtimeoptions.v1.Options"),
        (runc_options.Options, "containerd.runc.v1.Options"),
        (cgroup_metrics.Metrics, "io.containerd.cgroups.v2.Metrics"),
    ],
)
def test_type_urls_as_containerds_typeurl_forms_them(message: type, type_url: str) -> None:
    assert message.DESCRIPTOR.full_name == type_url  # type: ignore[attr-defined]


def test_shim_modes_type_urls_are_those() -> None:
    assert sandbox_service.POD_SANDBOX_CONFIG == cri.PodSandboxConfig.DESCRIPTOR.full_name
    assert launch.RUNTIME_OPTIONS == runtimeoptions.Options.DESCRIPTOR.full_name
    assert containerd_spec.RUNC_OPTIONS == runc_options.Options.DESCRIPTOR.full_name
