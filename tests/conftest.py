"""The suite's shared fixtures, in one place; the helpers they use live in ``tests.shim_kit``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.shim_kit import Shim, require_host, running_shim

#: The integration test files that take longest, longest first (``--durations`` of the phase-1
#: run): ``scripts/test.sh`` gives each worker a whole file, in collection order, so starting these
#: first lets the workers end together. An ordering hint only; a file not named keeps its place.
LONGEST_FIRST = (
    "test_bench_smoke.py",
    "test_streaming.py",
    "test_containers_socket.py",
    "test_qemu_user.py",
    "test_log_hostile.py",
    "test_image_service_socket.py",
    "test_image_visibility.py",
    "test_volume_propagation.py",
    "test_proxy_hung.py",
    "test_guest_containers.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shim]:
    """One real shim per test module, on a private state and the host's libvirt."""
    require_host()
    with running_shim(tmp_path_factory.mktemp("shim")) as running:
        yield running


@pytest.fixture
def qemu() -> Iterator[int]:
    """The pid of a process in a mount namespace of its own, slave to the host's (as libvirt's for
    QEMU): where the bind tests attach what the shim attaches in a QEMU's namespace."""
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sleep", "300"])
    try:
        ns = f"/proc/{proc.pid}/ns/mnt"
        while os.readlink(ns) == os.readlink("/proc/self/ns/mnt"):  # until unshare has run
            pass
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
