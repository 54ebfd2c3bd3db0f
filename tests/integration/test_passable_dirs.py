"""A state directory (or guest image) below a directory other users cannot pass: each sandbox's
QEMU, as an unprivileged uid, could not reach its files, so ``vmsandbox serve`` refuses to start
with one message naming the directory and the fix, and ``vmsandbox profile validate`` says the
same; once the directory is passable the shim starts."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.shim_kit import IMAGE_DIR, LIBVIRT_URI, REPO, require_host, write_profiles

pytestmark = pytest.mark.integration


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vmsandbox-passable-", dir="/var/tmp"))
    d.chmod(0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shim", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_a_state_dir_below_a_closed_directory_stops_the_shim_at_start(work: Path) -> None:
    require_host()
    closed = work / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0o700)
    write_profiles(work / "profiles.yaml")
    config = {
        "socket_path": str(work / "cri.sock"),
        "state_dir": str(closed / "state"),
        "console_dir": str(work / "console"),
        "libvirt_uri": LIBVIRT_URI,
        "profile_files": [str(work / "profiles.yaml")],
        "pod_network": "none",
    }
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    fix = f"run 'chmod o+x {closed}', or move state_dir below directories others can pass"

    served = _cli("serve", "--config", str(work / "config.yaml"))
    assert served.returncode != 0, served.stderr
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1, served.stderr  # one message, no traceback
    assert lines[0].startswith(f"vmsandbox serve: directory {closed} (mode 0700) cannot be passed by other users")
    assert fix in lines[0]
    assert not (closed / "state").exists() and not (work / "cri.sock").exists()

    checked = _cli("profile", "validate", str(work / "profiles.yaml"), "--config", str(work / "config.yaml"))
    assert checked.returncode != 0
    text = (work / "config.yaml").read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if t.startswith("state_dir:"))
    assert f"{work / 'config.yaml'}:{line}: state_dir: directory {closed} (mode 0700)" in checked.stdout, checked.stdout
    assert fix in checked.stdout

    closed.chmod(0o711)
    assert IMAGE_DIR.is_dir()
    checked = _cli("profile", "validate", str(work / "profiles.yaml"), "--config", str(work / "config.yaml"))
    assert "state_dir:" not in checked.stdout, checked.stdout
    process = subprocess.Popen(
        [sys.executable, "-m", "shim", "serve", "--config", str(work / "config.yaml")],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(600):
            if (work / "cri.sock").exists() or process.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert (work / "cri.sock").exists(), process.stderr.read() if process.stderr else ""
    finally:
        process.terminate()
        process.wait(timeout=30)
