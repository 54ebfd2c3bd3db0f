"""The host that scripts/setup-host.sh prepared: libvirtd answers, hugepages and hugetlbfs are in
place, virtlogd runs, and a second run of the script changes nothing.

Run after `sudo scripts/setup-host.sh`. Needs root (the script refuses to run otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.exclusive]

REPO_ROOT = Path(__file__).resolve().parents[2]
SETUP = REPO_ROOT / "scripts" / "setup-host.sh"
URI = "qemu:///system"
HUGEPAGES_2M = int(os.environ.get("VMSANDBOX_HUGEPAGES_2M", "1024"))
HUGETLBFS_MOUNT = "/dev/hugepages"
VIRTLOGD_PIDFILE = Path("/run/virtlogd.pid")
LIBVIRTD_TINI_PIDFILE = Path("/run/vmsandbox/libvirtd-tini.pid")
STEP_LINE = re.compile(r"^\[(\d+)/(\d+)\] ([^:]+): (.*)$")


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("host set-up checks need root")


def _pid_from(pidfile: Path) -> int:
    assert pidfile.exists(), f"{pidfile} missing: run scripts/setup-host.sh"
    text = pidfile.read_text().strip()
    assert text.isdigit(), f"{pidfile} holds {text!r}, not a pid"
    return int(text)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _exe(pid: int) -> str:
    return os.path.basename(os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)"))


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise AssertionError(f"{key} not in /proc/meminfo")


def test_libvirtd_answers_on_qemu_system() -> None:
    _needs_root()
    out = subprocess.run(
        ["virsh", "-c", URI, "version", "--daemon"], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "Running against daemon:" in out.stdout
    assert "QEMU" in out.stdout


def test_libvirtd_runs_under_tini_from_its_pidfile() -> None:
    _needs_root()
    pid = _pid_from(LIBVIRTD_TINI_PIDFILE)
    assert _alive(pid)
    assert _exe(pid) in {"tini", "tini-static"}
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert any(_exe(int(c)) == "libvirtd" for c in children), "tini has no libvirtd child"


def test_hugetlbfs_is_mounted() -> None:
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    assert any(m[1] == HUGETLBFS_MOUNT and m[2] == "hugetlbfs" for m in mounts), f"no hugetlbfs at {HUGETLBFS_MOUNT}"


def test_hugepages_reserved() -> None:
    nr = int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages").read_text())
    assert nr >= HUGEPAGES_2M
    if _meminfo("Hugepagesize") == 2048:
        assert _meminfo("HugePages_Total") >= HUGEPAGES_2M


def test_virtlogd_running_from_its_pidfile() -> None:
    _needs_root()
    pid = _pid_from(VIRTLOGD_PIDFILE)
    assert _alive(pid), f"virtlogd pid {pid} from {VIRTLOGD_PIDFILE} is not running"
    assert _exe(pid) == "virtlogd"


def test_libvirt_qemu_can_open_dev_kvm() -> None:
    """root:kvm 0660 with libvirt-qemu in kvm: else libvirt re-probes QEMU on every define."""
    _needs_root()
    if not os.path.exists("/dev/kvm"):
        pytest.skip("no /dev/kvm on this host")
    import grp
    import pwd

    st = os.stat("/dev/kvm")
    assert grp.getgrgid(st.st_gid).gr_name == "kvm"
    assert st.st_mode & 0o060 == 0o060, oct(st.st_mode)
    qemu = pwd.getpwnam("libvirt-qemu")
    assert grp.getgrnam("kvm").gr_gid in os.getgrouplist("libvirt-qemu", qemu.pw_gid)


def test_second_run_is_a_no_op() -> None:
    _needs_root()
    # converge first (make test has usually done this already), then the rerun must do nothing
    subprocess.run(
        ["bash", str(SETUP)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=600,
        check=True,
        env={**os.environ, "CI": "true"},
    )
    proc = subprocess.run(
        ["bash", str(SETUP)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "CI": "true"},
    )
    assert proc.returncode == 0, f"setup-host.sh failed:\n{proc.stdout}\n{proc.stderr}"
    steps: dict[int, list[str]] = {}
    total = 0
    for line in proc.stdout.splitlines():
        m = STEP_LINE.match(line)
        if m:
            steps.setdefault(int(m[1]), []).append(m[4])
            total = int(m[2])
    assert total >= 8 and sorted(steps) == list(range(1, total + 1)), proc.stdout
    has_image_recipe = (REPO_ROOT / "images" / "build.sh").exists()
    for n, messages in steps.items():
        if n == total:  # the summary
            continue
        for msg in messages:
            if n == 7 and not has_image_recipe:
                assert "not found" in msg, msg
            else:
                assert msg.startswith("already done"), f"step {n} did work on a rerun: {msg}"


def test_image_tools_are_installed_and_no_packaged_registry_runs() -> None:
    _needs_root()
    for tool in ("skopeo", "umoci", "docker-registry", "htpasswd"):
        assert subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode == 0, tool

    def cmdline(pid: str) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return b""  # gone meanwhile

    packaged = [p for p in os.listdir("/proc") if p.isdigit() and b"/etc/docker/registry/config.yml" in cmdline(p)]
    assert packaged == [], "the docker-registry package's own daemon must not be left running"
