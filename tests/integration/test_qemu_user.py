"""Each sandbox's QEMU runs as a host user of its own, through the CRI socket with real guests: two
pods, each with a container of its own image. Every QEMU of them runs as a non-root uid and gid
from ``qemu_uids`` (the one its sandbox record names), with no capability, QEMU's seccomp filter
and a mount namespace of its own; the two uids differ, and a process with either uid can open none
of the other sandbox's files (its directory and shared directory, console log, image disk and
hugepage directory), while it does reach its own shared directory. A restarted shim reports the
same uid for each sandbox, whose QEMU runs on as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.image_setup import require_image_tools
from tests.registry_kit import Layout, Registry, busybox_entries, file, push
from tests.shim_kit import Shim, pod, q, remove_all, require_host, start_shim, stop_shim
from vmsandbox.domain import domain_name

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SMALL = q({"cpu": "250m", "memory": "32Mi"})
UIDS = "2100000000-2100000099"

# run as another user: try to open each path, print what happened as JSON
PROBE = """
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            os.close(os.open(path, os.O_RDONLY))
        out[path] = "opened"
    except OSError as exc:
        out[path] = exc.strerror
print(json.dumps(out))
"""


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _probe(uid: int, paths: list[str]) -> dict[str, str]:
    done = subprocess.run(
        ["/usr/bin/python3", "-c", PROBE, *paths],  # the venv may lie where the uid cannot pass
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return dict(json.loads(done.stdout))


def _run_pod(shim: Shim, tmp: Path, name: str, image: str) -> str:
    config = pod(name, containers=[("c", SMALL)])
    config.log_directory = str(tmp / f"logs-{name}")
    rt = shim.runtime
    sid = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    ctr = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="c"),
        image=pb.ImageSpec(image=image),
        command=["sh", "-c", "cat /etc/secret; sleep 600"],
        log_path="c.log",
    )
    ctr.kubernetes_resources.CopyFrom(SMALL)
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=sid, config=ctr, sandbox_config=config), timeout=120
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    log = tmp / f"logs-{name}" / "c.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and log.read_text().strip()):
        assert time.monotonic() < deadline, f"no log line from pod {name}"
        time.sleep(0.1)
    assert log.read_text().split(" ", 3)[3].strip() == name
    return sid


def _record_uid(shim: Shim, sid: str) -> int:
    status = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True))
    return int(json.loads(status.info["info"])["qemu_uid"])


def test_each_pods_qemu_is_its_own_unprivileged_user(tmp_path: Path) -> None:
    require_host()
    require_image_tools()
    registry = Registry(tmp_path / "registry").start()
    try:
        layout = Layout(tmp_path / "layout")
        for name in ("alpha", "beta"):
            entries = [*busybox_entries(("sh", "cat", "sleep")), file("etc/secret", f"{name}\n".encode())]
            layout.tag(name, layout.image([layout.layer(entries)]))
            push(layout, name, f"{registry.host}/test/{name}:1")
        (tmp_path / "shim").mkdir()
        shim = start_shim(tmp_path / "shim", extra_config={"qemu_uids": UIDS}, pull_busybox=False)
        try:
            for name in ("alpha", "beta"):
                ref = f"{registry.host}/test/{name}:1"
                shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=ref)), timeout=300)
            sids = {
                name: _run_pod(shim, tmp_path, name, f"{registry.host}/test/{name}:1") for name in ("alpha", "beta")
            }
            state = shim.state_dir.resolve()  # a uid of QEMU's cannot pass through pytest's directories
            uids: dict[str, int] = {}
            own: dict[str, list[str]] = {}
            private: dict[str, list[str]] = {}
            for name, sid in sids.items():
                pid = int(Path(f"/run/libvirt/qemu/{domain_name(sid)}.pid").read_text())
                st = _status(pid)
                uid = _record_uid(shim, sid)
                assert 2_100_000_000 <= uid <= 2_100_000_099, uid
                assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [str(uid)] * 4, st
                assert st["Groups"].split() in ([], [str(uid)]), st  # no group but its own
                assert st["CapEff"] == st["CapPrm"] == "0000000000000000", st
                assert st["Seccomp"] == "2", st  # QEMU's -sandbox filter
                assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
                live = subprocess.run(
                    ["virsh", "-c", "qemu:///system", "dumpxml", domain_name(sid)], capture_output=True, text=True
                ).stdout
                disks = [line.split("'")[1] for line in live.splitlines() if "<source file=" in line]
                maps = [line.split(maxsplit=5) for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
                hugepages = [
                    m[5].removesuffix(" (deleted)") for m in maps if len(m) == 6 and m[5].startswith("/dev/hugepages")
                ]
                uids[name] = uid
                own[name] = [str(state / "sandboxes" / sid / "shared")]
                private[name] = [
                    str(state / "sandboxes" / sid),
                    str(state / "sandboxes" / sid / "shared"),
                    str(tmp_path / "shim" / "console" / f"{sid}.log"),
                    *disks,  # QEMU's view of its image disk: a bind in its own mount namespace
                    *(str(p) for p in (state / "images" / "disks").iterdir()),  # the store's files
                    *{str(Path(h).parent) for h in hugepages},
                ]
                assert disks and hugepages, (live, maps)  # the image's disk is attached; RAM from hugetlbfs
            assert uids["alpha"] != uids["beta"]
            for me, other in (("alpha", "beta"), ("beta", "alpha")):
                mine = _probe(uids[me], own[me])
                assert set(mine.values()) == {"opened"}, mine
                theirs = _probe(uids[me], private[other])
                assert theirs and all(v == "Permission denied" for v in theirs.values()), theirs
            # a restarted shim finds each sandbox's uid in its record, and the QEMUs run on as they were
            pids = {n: Path(f"/run/libvirt/qemu/{domain_name(sid)}.pid").read_text() for n, sid in sids.items()}
            stop_shim(shim)
            shim = start_shim(tmp_path / "shim", extra_config={"qemu_uids": UIDS}, pull_busybox=False)
            for name, sid in sids.items():
                assert _record_uid(shim, sid) == uids[name]
                assert _status(int(pids[name]))["Uid"].split()[0] == str(uids[name])
        finally:
            try:
                remove_all(shim)
            finally:
                stop_shim(shim)
                shutil.rmtree(tmp_path / "shim", ignore_errors=True)
    finally:
        registry.stop()
