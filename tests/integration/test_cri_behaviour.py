"""CRI behaviour a kubelet, crictl and critest rely on, through the real socket: Version, Status,
ImageFsInfo, UNIMPLEMENTED answers, socket and state-dir modes; status and list round trips,
filters, READY -> NOTREADY, idempotent stop/remove, and RemovePodSandbox taking its containers.

Two guests for the whole module: "web" (declared, exclusive CPU, handler vmsandbox) and "db"
(no pod_resources, sized from containerd's sandbox annotations, handler "db-vm"), both pinned.
"""

from __future__ import annotations

import json
import sqlite3
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import libvirt
import pytest
import yaml

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.shim_kit import (
    IMAGE_DIR,
    LIBVIRT_URI,
    Shim,
    container,
    our_domains,
    pod,
    q,
    require_host,
    running_shim,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MI = 1 << 20
WEB_LABELS = {"app": "web", "tier": "front", "io.kubernetes.pod.name": "web"}
WEB_ANNOTATIONS = {"example.com/owner": "team-a", "io.kubernetes.pod.uid": "irrelevant"}
DB_ANNOTATIONS = {
    "io.kubernetes.cri.sandbox-cpu-period": "100000",
    "io.kubernetes.cri.sandbox-cpu-quota": "50000",
    "io.kubernetes.cri.sandbox-cpu-shares": "512",
    "io.kubernetes.cri.sandbox-memory": str(192 * MI),
}


def serving(shim: Shim) -> None:
    assert shim.runtime.Version(pb.VersionRequest(), timeout=10).runtime_name == "vmsandbox"


def rejected(shim: Shim, call: Callable[[], object], code: grpc.StatusCode, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert needle in str(err.value.details())
    serving(shim)


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shim]:
    """A shim of its own, serving two handlers (the module does not depend on the shared fixture's profiles)."""
    require_host()
    tmp = tmp_path_factory.mktemp("cri")
    profiles = tmp / "cri-profiles.yaml"
    guest = {"image_dir": str(IMAGE_DIR), "boot_timeout_s": 60}
    profiles.write_text(
        yaml.safe_dump_all(
            [
                {"name": "vmsandbox", "handler": "vmsandbox", "snapshots": False, "guest": guest},
                {"name": "db", "handler": "db-vm", "snapshots": False, "guest": guest},
            ]
        )
    )
    with running_shim(tmp, extra_config={"profile_files": [str(profiles)]}) as running:
        yield running


@dataclass
class Pods:
    web: str
    db: str
    web_config: pb.PodSandboxConfig
    db_config: pb.PodSandboxConfig


@pytest.fixture(scope="module")
def pods(shim: Shim) -> Iterator[Pods]:
    web_config = pod(
        "web", containers=[("web", q({"cpu": "1", "memory": "64Mi"})), ("log", q({"cpu": "0", "memory": "16Mi"}))]
    )
    web_config.labels.update(WEB_LABELS)
    web_config.annotations.update(WEB_ANNOTATIONS)
    web_config.hostname = "web-0"
    web_config.log_directory = "/var/log/pods/test_web_uid"
    db_config = pod("db", declared=False, labels={"app": "db"})
    db_config.annotations.update(DB_ANNOTATIONS)
    ids: list[str] = []
    domains: list[str] = []
    try:
        for config, handler in ((web_config, "vmsandbox"), (db_config, "db-vm")):
            ids.append(
                shim.runtime.RunPodSandbox(
                    pb.RunPodSandboxRequest(config=config, runtime_handler=handler), timeout=300
                ).pod_sandbox_id
            )
        domains = [info(shim, sid)["domain"] for sid in ids]
        yield Pods(web=ids[0], db=ids[1], web_config=web_config, db_config=db_config)
    finally:
        for sid in ids:
            shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
            shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    assert not set(domains) & set(our_domains())
    assert claims(shim) == 0  # every CPU and page this shim claimed is back


def claims(shim: Shim) -> int:
    db = sqlite3.connect(f"file:{shim.state_dir / 'state.db'}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT count(*) FROM claims").fetchone()[0])
    finally:
        db.close()


def status(shim: Shim, sandbox_id: str, verbose: bool = False) -> pb.PodSandboxStatusResponse:
    return shim.runtime.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=verbose), timeout=30
    )


def info(shim: Shim, sandbox_id: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(status(shim, sandbox_id, verbose=True).info["info"])
    return doc


def listed(shim: Shim, **filter_args: Any) -> list[str]:
    f = pb.PodSandboxFilter(**filter_args)
    return sorted(s.id for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(filter=f), timeout=30).items)


def containers(shim: Shim, **filter_args: Any) -> list[str]:
    f = pb.ContainerFilter(**filter_args)
    return sorted(c.id for c in shim.runtime.ListContainers(pb.ListContainersRequest(filter=f), timeout=30).containers)


# -- runtime-level RPCs -------------------------------------------------------------------------------
def test_version_status_and_image_fs_info(shim: Shim) -> None:
    v = shim.runtime.Version(pb.VersionRequest(version="v1"), timeout=10)
    assert (v.runtime_name, v.runtime_api_version) == ("vmsandbox", "v1")
    assert v.runtime_version
    st = shim.runtime.Status(pb.StatusRequest(verbose=True), timeout=30)
    conditions = {c.type: c.status for c in st.status.conditions}
    assert conditions == {"RuntimeReady": True, "NetworkReady": True}
    assert sorted(h.name for h in st.runtime_handlers) == ["db-vm", "vmsandbox"]
    verbose = json.loads(st.info["info"])
    assert verbose["libvirt_version"] and verbose["owned_cpus"]
    fs = shim.images.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=30)
    assert fs.image_filesystems and fs.image_filesystems[0].fs_id.mountpoint == str(shim.state_dir / "images")
    assert fs.image_filesystems[0].HasField("used_bytes")  # the image store: blobs and unpacked trees
    assert fs.container_filesystems and fs.container_filesystems[0].fs_id.mountpoint == str(shim.state_dir)
    assert fs.container_filesystems[0].used_bytes.value > 0  # the state database at least


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        pytest.param(
            lambda s: s.runtime.CheckpointContainer(pb.CheckpointContainerRequest(container_id="x"), timeout=10),
            "CheckpointContainer is not implemented by vmsandbox",
            id="CheckpointContainer",
        ),
        pytest.param(
            lambda s: next(iter(s.runtime.GetContainerEvents(pb.GetEventsRequest(), timeout=10))),
            "container events are not streamed yet",
            id="GetContainerEvents",
        ),
    ],
)
def test_unimplemented_rpcs_say_why(shim: Shim, call: Callable[[Shim], object], needle: str) -> None:
    rejected(shim, lambda: call(shim), grpc.StatusCode.UNIMPLEMENTED, needle)


def test_socket_and_state_dir_modes(shim: Shim) -> None:
    sock = shim.socket.stat()
    assert stat.S_ISSOCK(sock.st_mode)
    assert stat.S_IMODE(sock.st_mode) == 0o660
    assert sock.st_uid == 0
    # passable, not listable, by others: each sandbox's QEMU runs as its own uid and reaches only its
    # own directory below (0700, its own)
    assert stat.S_IMODE(shim.state_dir.stat().st_mode) == 0o711


# -- sandboxes ------------------------------------------------------------------------------------------
def test_status_round_trips_what_the_kubelet_sent(shim: Shim, pods: Pods) -> None:
    for sid, config, handler in ((pods.web, pods.web_config, "vmsandbox"), (pods.db, pods.db_config, "db-vm")):
        st = status(shim, sid).status
        assert st.id == sid
        assert st.metadata == config.metadata
        assert dict(st.labels) == dict(config.labels)
        assert dict(st.annotations) == dict(config.annotations)
        assert st.runtime_handler == handler
        assert st.state == pb.SANDBOX_READY
        assert st.created_at > 0
    items = {s.id: s for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items}
    assert set(items) == {pods.web, pods.db}
    web = items[pods.web]
    assert web.metadata == pods.web_config.metadata
    assert dict(web.labels) == WEB_LABELS and dict(web.annotations) == WEB_ANNOTATIONS
    assert web.runtime_handler == "vmsandbox" and web.state == pb.SANDBOX_READY


def test_verbose_info_shows_mode_shape_pinning_hugepages_and_domain(shim: Shim, pods: Pods) -> None:
    web = info(shim, pods.web)
    assert web["sizing_mode"] == "declared"
    assert web["shape"]["vcpus"] == 1 and web["shape"]["cpu_policy"] == "exclusive"
    assert web["shape"]["memory_bytes"] == (64 + 16 + 64) * MI
    assert len(web["pinned_cpus"]) == 1
    assert web["hugepages"] == [{"node": 0, "page_size": 2 * MI, "pages": 72}]
    assert web["guest"]["vcpus"] == 1
    db = info(shim, pods.db)
    assert db["sizing_mode"] == "annotations"
    assert (db["shape"]["demand"]["cpu_millis"], db["shape"]["demand"]["memory_bytes"]) == (500, 192 * MI)
    assert db["profile"] == "db"
    assert len(db["pinned_cpus"]) == 1
    assert not set(web["pinned_cpus"]) & set(db["pinned_cpus"])  # exclusive CPUs are never shared
    conn = libvirt.open(LIBVIRT_URI)
    try:
        for doc in (web, db):
            assert doc["domain"].startswith("vmsandbox-")
            assert conn.lookupByName(doc["domain"]).isActive()
    finally:
        conn.close()


def test_list_filters(shim: Shim, pods: Pods) -> None:
    both = sorted([pods.web, pods.db])
    ready = pb.PodSandboxStateValue(state=pb.SANDBOX_READY)
    notready = pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY)
    cases: list[tuple[str, dict[str, Any], list[str]]] = [
        ("no filter", {}, both),
        ("full id", {"id": pods.web}, [pods.web]),
        ("id prefix", {"id": pods.db[:12]}, [pods.db]),
        ("unknown id", {"id": "f" * 64}, []),
        ("ready", {"state": ready}, both),
        ("notready", {"state": notready}, []),
        ("one label", {"label_selector": {"app": "web"}}, [pods.web]),
        ("two labels", {"label_selector": {"app": "web", "tier": "front"}}, [pods.web]),
        ("label value differs", {"label_selector": {"app": "web", "tier": "back"}}, []),
        ("label absent", {"label_selector": {"team": "x"}}, []),
        ("id and label disagree", {"id": pods.db, "label_selector": {"app": "web"}}, []),
        ("state and label", {"state": ready, "label_selector": {"app": "db"}}, [pods.db]),
    ]
    for name, args, want in cases:
        assert listed(shim, **args) == sorted(want), name


def test_containers_round_trip_filters_and_idempotent_stop_remove(shim: Shim, pods: Pods) -> None:
    config = container("web", q({"cpu": "1", "memory": "64Mi"}))
    config.labels["role"] = "server"
    config.annotations["example.com/note"] = "hello"
    config.log_path = "web/0.log"
    cid = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=pods.web, config=config, sandbox_config=pods.web_config), timeout=30
    ).container_id
    log_cid = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=pods.web, config=container("log", q({"cpu": "0", "memory": "16Mi"}))),
        timeout=30,
    ).container_id
    st = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
    assert (st.id, st.metadata.name, st.metadata.attempt) == (cid, "web", 0)
    assert st.state == pb.CONTAINER_CREATED and st.created_at > 0
    assert st.image.image == "busybox"
    assert st.log_path == "/var/log/pods/test_web_uid/web/0.log"  # log_directory joined with log_path
    assert dict(st.labels) == {"role": "server"} and dict(st.annotations) == {"example.com/note": "hello"}
    assert st.resources.linux.cpu_quota == 100_000 and st.resources.linux.memory_limit_in_bytes == 64 * MI
    created = pb.ContainerStateValue(state=pb.CONTAINER_CREATED)
    exited = pb.ContainerStateValue(state=pb.CONTAINER_EXITED)
    cases: list[tuple[str, dict[str, Any], list[str]]] = [
        ("sandbox", {"pod_sandbox_id": pods.web}, sorted([cid, log_cid])),
        ("other sandbox", {"pod_sandbox_id": pods.db}, []),
        ("id", {"id": cid}, [cid]),
        ("state created", {"state": created}, sorted([cid, log_cid])),
        ("state exited", {"state": exited}, []),
        ("label", {"label_selector": {"role": "server"}}, [cid]),
        ("label absent", {"label_selector": {"role": "client"}}, []),
    ]
    for name, args, want in cases:
        assert containers(shim, **args) == want, name
    # a container starts once (it runs the image's /bin/sh, which exits at once: no stdin)
    shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=60)
    rejected(
        shim,
        lambda: shim.runtime.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=30),
        grpc.StatusCode.FAILED_PRECONDITION,
        "it can start only once",
    )
    # stop: twice, and on an unknown id
    for _ in range(2):
        shim.runtime.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1), timeout=30)
    shim.runtime.StopContainer(pb.StopContainerRequest(container_id="0" * 64), timeout=30)
    assert containers(shim, state=exited) == [cid]
    # remove: twice, and on an unknown id
    for _ in range(2):
        shim.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=30)
    shim.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id="0" * 64), timeout=30)
    assert containers(shim, pod_sandbox_id=pods.web) == [log_cid]
    rejected(
        shim,
        lambda: shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30),
        grpc.StatusCode.NOT_FOUND,
        "not found",
    )
    # malformed: empty ids are INVALID_ARGUMENT, not silently accepted
    rejected(
        shim,
        lambda: shim.runtime.RemoveContainer(pb.RemoveContainerRequest(), timeout=30),
        grpc.StatusCode.INVALID_ARGUMENT,
        "container_id is empty",
    )
    rejected(
        shim,
        lambda: shim.runtime.ContainerStatus(pb.ContainerStatusRequest(), timeout=30),
        grpc.StatusCode.INVALID_ARGUMENT,
        "container_id is empty",
    )


def test_unknown_and_empty_sandbox_ids(shim: Shim, pods: Pods) -> None:
    unknown = "e" * 64
    shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=unknown), timeout=30)
    shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=unknown), timeout=30)
    rejected(shim, lambda: status(shim, unknown), grpc.StatusCode.NOT_FOUND, f"pod sandbox {unknown!r} not found")
    for call in (
        lambda: status(shim, ""),
        lambda: shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(), timeout=30),
        lambda: shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(), timeout=30),
    ):
        rejected(shim, call, grpc.StatusCode.INVALID_ARGUMENT, "pod_sandbox_id is empty")
    assert listed(shim) == sorted([pods.web, pods.db])  # nothing else changed


def test_a_unique_id_prefix_names_the_sandbox(shim: Shim, pods: Pods) -> None:
    """``crictl inspectp 3f2a9c1b0d4e5``: 13 characters name the sandbox, as in containerd."""
    assert status(shim, pods.web[:13]).status.id == pods.web
    rejected(
        shim,
        lambda: status(shim, "../" + pods.web),
        grpc.StatusCode.INVALID_ARGUMENT,
        "64 lowercase hexadecimal characters",
    )


def test_stop_then_remove_sandbox(shim: Shim, pods: Pods) -> None:
    """Runs last: stops "db" (READY -> NOTREADY, containers exit), then removes it with its containers."""
    cid = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=pods.db,
            config=container("db", None),
        ),
        timeout=30,
    ).container_id
    domain = info(shim, pods.db)["domain"]
    for _ in range(2):  # idempotent
        shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pods.db), timeout=120)
    st = status(shim, pods.db).status
    assert st.state == pb.SANDBOX_NOTREADY
    assert dict(st.labels) == {"app": "db"}  # still round-trips after stop
    assert domain not in our_domains()
    notready = pb.PodSandboxStateValue(state=pb.SANDBOX_NOTREADY)
    ready = pb.PodSandboxStateValue(state=pb.SANDBOX_READY)
    assert listed(shim, state=notready) == [pods.db]
    assert listed(shim, state=ready) == [pods.web]
    c = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
    assert c.state == pb.CONTAINER_EXITED
    rejected(
        shim,
        lambda: shim.runtime.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=pods.db, config=container("late", None)), timeout=30
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "is not ready (it was stopped)",
    )
    for _ in range(2):  # idempotent; removes the sandbox's containers too
        shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pods.db), timeout=120)
    assert listed(shim) == [pods.web]
    assert containers(shim, pod_sandbox_id=pods.db) == []
    rejected(
        shim,
        lambda: shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30),
        grpc.StatusCode.NOT_FOUND,
        "not found",
    )
    rejected(shim, lambda: status(shim, pods.db), grpc.StatusCode.NOT_FOUND, "not found")
    # the web pod was not disturbed
    assert status(shim, pods.web).status.state == pb.SANDBOX_READY
