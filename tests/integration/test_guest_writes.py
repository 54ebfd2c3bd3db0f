"""What guest root writes through the 9p share never becomes a host privilege, through the CRI
socket with a real guest: a privileged container, and guest init (reached with ``nsenter`` from a
container in the guest's PID namespace; init owns the 9p mounts), make setuid-root and setgid
copies of a shell, a file capability, device nodes, a fifo and symlinks on a writable volume and in the sandbox's
shared directory. On the host every one of them is a plain regular file or directory owned by
QEMU's user, without setuid/setgid bits or a file capability, while the guest still sees the owners,
modes and file types it set (libvirt's ``mapped`` 9p model, ``shim.containers``). On a volume,
which QEMU reaches through a bind idmapped so that host root's files are QEMU's, what the guest
makes belongs to host root, still a plain 0600 file or 0700 directory; QEMU runs as a uid of its own,
never root."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.critest_images import build_lookalike
from tests.integration.image_setup import one_image_registry
from tests.registry_kit import busybox_entries, file
from tests.shim_kit import Shim, pod, q, require_host, running_shim
from vmsandbox.domain import domain_name

pytestmark = [pytest.mark.slow, pytest.mark.integration]

APPLETS = ("sh", "cp", "chown", "chmod", "mknod", "mkfifo", "ln", "nsenter", "stat", "echo", "ls", "cat")
SMALL = q({"cpu": "250m", "memory": "32Mi"})

# Each line tries to make one kind of host privilege (a refusal does not stop the others); stat
# prints what the guest sees afterwards. Run once in the container's view and once in guest init's.
ATTACK = """
d=$1
cp /bin/busybox "$d/suid"; chown 0:0 "$d/suid"; chmod 4755 "$d/suid"
cp /bin/busybox "$d/sgid"; chown 0:0 "$d/sgid"; chmod 2755 "$d/sgid"
mkdir "$d/dir"; chmod 6777 "$d/dir"
mknod "$d/null" c 1 3
mknod "$d/disk" b 8 0
mkfifo "$d/fifo"
ln -s /etc/shadow "$d/link"
echo x > "$d/owned"; chown 65534:65534 "$d/owned"
cp /bin/busybox "$d/cap"; ${SETCAP:-setcap} "$d/cap"
stat -c '%n %a %u:%g %F' "$d/suid" "$d/sgid" "$d/null" "$d/fifo" "$d/link" "$d/owned"
"""


@dataclass
class Env:
    shim: Shim
    image: str
    sandbox: str
    config: pb.PodSandboxConfig
    logs: Path
    volume: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    require_host()
    tmp = tmp_path_factory.mktemp("guest-writes")
    # setcap: the look-alike program sets a file capability (busybox has no setcap)
    entries = [*busybox_entries(APPLETS), file("bin/setcap", build_lookalike(tmp / "lookalike"), 0o755)]
    with one_image_registry(tmp, entries, "test/guest-writes:1") as ref:
        allowed = tmp / "allowed"
        volume = allowed / "volume"
        volume.mkdir(parents=True)
        volume.chmod(0o777)
        (tmp / "shim").mkdir()
        with running_shim(tmp / "shim", extra_config={"mount_allowlist": [str(allowed)]}, pull_busybox=False) as shim:
            shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            config = pod("guest-writes", containers=[("attacker", SMALL), ("init-attacker", SMALL), ("mover", SMALL)])
            for decl in config.pod_resources.containers:
                decl.mounts.append(pb.Mount(container_path="/data", host_path=str(volume)))
            config.linux.security_context.privileged = True
            config.log_directory = str(tmp / "logs")
            sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
            try:
                yield Env(shim, ref, sid, config, tmp / "logs", volume)
            finally:
                shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
                shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)


def _run(env: Env, name: str, script: str, *args: str) -> tuple[int, list[str]]:
    """Runs a privileged container in the guest's PID namespace to its exit: its exit code and stdout."""
    rt = env.shim.runtime
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=env.image),
        command=["sh", "-c", script, "attack", *args],
        log_path=f"{name}.log",
        mounts=[pb.Mount(container_path="/data", host_path=str(env.volume))],
    )
    config.kubernetes_resources.CopyFrom(SMALL)
    config.linux.security_context.privileged = True
    config.linux.security_context.namespace_options.pid = pb.POD
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=env.sandbox, config=config, sandbox_config=env.config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    deadline = time.monotonic() + 120
    while True:
        status = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=60).status
        if status.state == pb.CONTAINER_EXITED:
            break
        assert time.monotonic() < deadline, f"container {name} did not exit"
        time.sleep(0.2)
    lines = [line.split(" ", 3) for line in (env.logs / f"{name}.log").read_text().splitlines()]
    # every file the final stat names exists in the guest (checked after the host side)
    return status.exit_code, [text for _, stream, _, text in lines if stream == "stdout"]


def _qemu_pid(env: Env) -> str:
    """The process of this sandbox's QEMU (libvirt's pid file of its domain names it)."""
    return Path(f"/run/libvirt/qemu/{domain_name(env.sandbox)}.pid").read_text().strip()


def _qemu_uid(env: Env) -> int:
    """The host user QEMU of this sandbox runs as."""
    return os.stat(f"/proc/{_qemu_pid(env)}").st_uid


def _assert_harmless(path: Path, qemu_uid: int) -> None:
    """``path`` (and what is below it) is a plain file or directory of QEMU's user, mode 0600/0700,
    without setuid/setgid bits or extended attributes other than QEMU's own ``user.virtfs.*``."""
    st = os.lstat(path)
    shown = f"{path}: {stat.filemode(st.st_mode)} {st.st_uid}:{st.st_gid}"
    assert stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode), shown
    assert stat.S_IMODE(st.st_mode) in (0o600, 0o700), shown
    assert st.st_uid == qemu_uid and st.st_gid in (qemu_uid, 0), shown
    assert all(x.startswith("user.virtfs.") for x in os.listxattr(path)), (path, os.listxattr(path))
    if stat.S_ISDIR(st.st_mode):
        for child in path.iterdir():
            _assert_harmless(child, qemu_uid)


MADE = ["cap", "dir", "disk", "fifo", "link", "null", "owned", "sgid", "suid"]


def test_a_privileged_container_makes_no_host_privilege_on_a_volume(env: Env) -> None:
    target = env.volume / "from-container"
    target.mkdir()
    target.chmod(0o777)
    code, seen = _run(env, "attacker", ATTACK, "/data/from-container")
    assert _qemu_uid(env) != 0
    for child in target.iterdir():  # QEMU's uid is host root's through the idmapped bind
        _assert_harmless(child, 0)
    assert sorted(p.name for p in target.iterdir()) == MADE
    # the guest keeps its own view: owners, modes and file types as it set them
    assert code == 0
    assert [line for line in seen if not line.startswith("setcap")] == [
        "/data/from-container/suid 4755 0:0 regular file",
        "/data/from-container/sgid 2755 0:0 regular file",
        "/data/from-container/null 644 0:0 character special file",
        "/data/from-container/fifo 644 0:0 fifo",
        "/data/from-container/link 777 0:0 symbolic link",
        "/data/from-container/owned 644 65534:65534 regular file",
    ]


def test_guest_init_makes_no_host_privilege_in_the_shared_directory(env: Env) -> None:
    # init's view of the share: the sandbox's whole shared directory, not just one volume
    # setcap is the container's: init's mount namespace reaches it through this shell's /proc root
    # (the shell must outlive nsenter: "; exit" keeps it from exec'ing nsenter in its place)
    enter = 'nsenter -t 1 -m env SETCAP=/proc/$$/root/bin/setcap sh -c "$1" attack "$2"; exit $?'
    code, seen = _run(env, "init-attacker", enter, ATTACK, "/run/vmsandbox/shared")
    shared = env.shim.state_dir / "sandboxes" / env.sandbox / "shared"
    assert _qemu_uid(env) != 0
    for name in MADE:
        _assert_harmless(shared / name, _qemu_uid(env))
    assert code == 0 and "/run/vmsandbox/shared/suid 4755 0:0 regular file" in seen


def test_a_volume_bind_the_guest_moved_is_still_let_go(env: Env) -> None:
    # guest init renames the directory holding the container's volume bind, which would take the
    # bind with it out of the container's own directory (with QEMU unprivileged the rename is
    # refused: those directories are root's); either way its exit must leave no bind in QEMU
    move = (
        "nsenter -t 1 -m sh -c 'for d in /run/vmsandbox/shared/containers/*/mounts; do c=${d%/mounts}; "
        'mv "$d" "/run/vmsandbox/shared/moved-${c##*/}"; done; '
        "ls -d /run/vmsandbox/shared/moved-*'; exit $?"
    )
    _run(env, "mover", move)
    shared = env.shim.state_dir / "sandboxes" / env.sandbox / "shared"
    points = [line.split()[4] for line in Path(f"/proc/{_qemu_pid(env)}/mountinfo").read_text().splitlines()]
    assert [p for p in points if p.startswith(f"{shared}/")] == []
