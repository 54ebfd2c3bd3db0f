"""The CRI proxy with real parts: containerd + runc beside vmsandbox, both on one CNI bridge.

One shim is configured with ``downstream_endpoint`` pointing at a containerd started by
``scripts/containerd.sh``; an ordinary pod (default handler ``""``, runc) and a VM pod run side
by side and talk TCP; both are listed together; containerd is killed and comes back; the shim
restarts into the same routing. A capture server stands in for the downstream to show that bytes
the shim's protos do not know pass through unchanged in both directions.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gen.cri.runtime.v1 import api_pb2 as pb
from tests.integration.cni_kit import cni_env
from tests.integration.downstream_kit import Containerd, containerd, tools_image
from tests.shim_kit import (
    Shim,
    busybox_registry,
    pod,
    q,
    remove_all,
    require_host,
    start_shim,
    stop_shim,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNTIME = "/runtime.v1.RuntimeService/"


class Env:
    def __init__(self, tmp: Path, ctd: Containerd, config: dict[str, object]) -> None:
        self.tmp = tmp
        self.ctd = ctd
        self.config = config
        self.shim: Shim = start_shim(tmp / "shim", extra_config=config, pull_busybox=False)
        self.ids: dict[str, str] = {}

    def restart(self) -> None:
        stop_shim(self.shim)
        self.shim = start_shim(self.tmp / "shim", extra_config=self.config, pull_busybox=False)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    require_host()
    if busybox_registry() is None:
        pytest.skip("no local registry (docker-registry, skopeo, busybox-static)")
    tmp = Path(tempfile.mkdtemp(prefix="vmsandbox-proxy-"))
    (tmp / "cni").mkdir()
    try:
        with (
            cni_env(tmp / "cni", bridge="vmsbr-prx0", subnet="10.237.0.0/24") as cni,
            containerd(tmp / "containerd", cni.conf_dir) as ctd,
        ):
            (tmp / "shim").mkdir()
            registry = ctd.registry
            config = {
                **cni.shim_config(),
                "downstream_endpoint": ctd.endpoint,
                "downstream_timeout_s": 30,
                "registries": [
                    {"prefix": registry, "insecure": True},
                    {"prefix": "docker.io", "location": registry, "insecure": True},
                ],
            }
            e = Env(tmp, ctd, config)
            try:
                yield e
            finally:
                try:
                    if not ctd.running():
                        ctd.up()  # a test that stopped it: the merged list needs it back
                    remove_all(e.shim)
                except Exception:
                    # the VM pod is the one that holds CPUs and hugepages: remove it by its id
                    for key in ("vm",):
                        if key in e.ids:
                            e.shim.runtime.StopPodSandbox(
                                pb.StopPodSandboxRequest(pod_sandbox_id=e.ids[key]), timeout=120
                            )
                            e.shim.runtime.RemovePodSandbox(
                                pb.RemovePodSandboxRequest(pod_sandbox_id=e.ids[key]), timeout=120
                            )
                    raise
                finally:
                    stop_shim(e.shim)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _conditions(shim: Shim) -> dict[str, pb.RuntimeCondition]:
    return {c.type: c for c in shim.runtime.Status(pb.StatusRequest(), timeout=30).status.conditions}


def _sandbox_config(name: str, tmp: Path) -> pb.PodSandboxConfig:
    config = pod(name, containers=[("app", q({"cpu": "1", "memory": "64Mi"}))])
    logs = tmp / "logs" / name
    logs.mkdir(parents=True)
    config.log_directory = str(logs)
    return config


def _container(image: str, script: str, name: str = "app") -> pb.ContainerConfig:
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=image),
        command=["/bin/sh", "-c", script],
        log_path=f"{name}.log",
        kubernetes_resources=q({"cpu": "1", "memory": "64Mi"}),
    )


def _wait_exit(shim: Shim, cid: str, timeout_s: float = 90) -> pb.ContainerStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=30).status
        if status.state == pb.CONTAINER_EXITED or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def test_ordinary_and_vm_pods_side_by_side_talk_tcp_and_list_together(env: Env) -> None:
    shim, tmp = env.shim, env.tmp
    conditions = _conditions(shim)
    assert conditions["DownstreamRuntimeReady"].status, conditions
    assert conditions["RuntimeReady"].status
    image = tools_image()

    # an ordinary pod: the default handler goes to containerd, which runs it with runc
    plain_config = _sandbox_config("plain", tmp)
    plain = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=plain_config), timeout=120).pod_sandbox_id
    env.ids["plain"] = plain
    with env.ctd.runtime() as direct:
        assert [s.id for s in direct.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items] == [plain]
    # its image goes to containerd's store only (PullImage names its pod); ImageStatus says present
    # (the kubelet reads the image's user there), so the kubelet will not pull for the VM pod
    shim.images.PullImage(
        pb.PullImageRequest(image=pb.ImageSpec(image=image), sandbox_config=plain_config), timeout=120
    )
    present = shim.images.ImageStatus(pb.ImageStatusRequest(image=pb.ImageSpec(image=image)), timeout=30).image
    assert present.id

    # a VM pod beside it
    vm_config = _sandbox_config("vm", tmp)
    vm = shim.runtime.RunPodSandbox(
        pb.RunPodSandboxRequest(config=vm_config, runtime_handler="vmsandbox"), timeout=180
    ).pod_sandbox_id
    env.ids["vm"] = vm
    vm_ip = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=vm), timeout=30).status
    vm_ip_text = vm_ip.network.ip
    assert vm_ip_text.startswith("10.237.0.")
    # the kubelet names the image by the id ImageStatus gave: vmsandbox's store lacks it, so the
    # proxy pulls it there (by the digest containerd knows it by) before the container is created
    server = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=vm,
            config=_container(present.id, "echo from-the-vm | nc -l -p 8080"),
            sandbox_config=vm_config,
        ),
        timeout=120,
    ).container_id
    assert "is in the downstream store only" in shim.log_text()
    listed = shim.images.ListImages(pb.ListImagesRequest(), timeout=30).images
    assert [i.id for i in listed].count(present.id) == 1  # one entry per image over both stores
    env.ids["vm-container"] = server
    shim.runtime.StartContainer(pb.StartContainerRequest(container_id=server), timeout=60)
    client = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=plain,
            config=_container(image, f"for i in $(seq 60); do nc {vm_ip_text} 8080 && exit 0; sleep 1; done; exit 1"),
            sandbox_config=plain_config,
        ),
        timeout=120,
    ).container_id
    env.ids["plain-container"] = client
    shim.runtime.StartContainer(pb.StartContainerRequest(container_id=client), timeout=60)
    done = _wait_exit(env.shim, client)
    log = (Path(plain_config.log_directory) / "app.log").read_text()
    assert done.exit_code == 0 and "from-the-vm" in log, (done, log)

    sandboxes = {s.id: s for s in shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items}
    assert {sid: s.runtime_handler for sid, s in sandboxes.items()} == {plain: "", vm: "vmsandbox"}
    assert {c.id for c in shim.runtime.ListContainers(pb.ListContainersRequest(), timeout=30).containers} >= {
        server,
        client,
    }
    # a filter naming one side's sandbox lists that side's containers only
    only = shim.runtime.ListContainers(
        pb.ListContainersRequest(filter=pb.ContainerFilter(pod_sandbox_id=plain[:12])), timeout=30
    ).containers
    assert [c.id for c in only] == [client]
    # a prefix is resolved across both sides; calls reach the side owning it
    assert (
        shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=client[:10]), timeout=30).status.id
        == client
    )
    # streaming and ExecSync into an ordinary container: containerd's own URL and answer
    sleeper = shim.runtime.CreateContainer(
        pb.CreateContainerRequest(
            pod_sandbox_id=plain, config=_container(image, "sleep 3600", "sleeper"), sandbox_config=plain_config
        ),
        timeout=120,
    ).container_id
    shim.runtime.StartContainer(pb.StartContainerRequest(container_id=sleeper), timeout=60)
    url = shim.runtime.Exec(pb.ExecRequest(container_id=sleeper, cmd=["true"], stdout=True), timeout=30).url
    with env.ctd.runtime() as direct:
        theirs = direct.Exec(pb.ExecRequest(container_id=sleeper, cmd=["true"], stdout=True), timeout=30).url
    assert url.rsplit("/", 2)[0] == theirs.rsplit("/", 2)[0]  # containerd's streaming server, not the shim's
    said = shim.runtime.ExecSync(pb.ExecSyncRequest(container_id=sleeper, cmd=["echo", "runc"], timeout=10), timeout=30)
    assert said.stdout == b"runc\n" and said.exit_code == 0
    # a stats filter naming the VM pod asks vmsandbox alone (containerd, asked for pods without a
    # cgroup parent, fails the whole list, as it would directly)
    stats = shim.runtime.ListPodSandboxStats(
        pb.ListPodSandboxStatsRequest(filter=pb.PodSandboxStatsFilter(id=vm)), timeout=60
    ).stats
    assert [s.attributes.id for s in stats] == [vm]


def test_downstream_killed_then_back_vm_pods_untouched(env: Env) -> None:
    if "plain" not in env.ids:
        pytest.skip("needs the pods of the first test")
    shim, ctd = env.shim, env.ctd
    ctd.kill()
    try:
        # VM pod calls go on
        vm = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=env.ids["vm"]), timeout=30)
        assert vm.status.state == pb.SANDBOX_READY
        # downstream calls: UNAVAILABLE naming the endpoint, quickly
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            shim.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=env.ids["plain-container"]), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ctd.endpoint in (err.value.details() or "")
        assert time.monotonic() - t0 < 5
        conditions = _conditions(shim)
        assert not conditions["DownstreamRuntimeReady"].status
        assert ctd.endpoint in conditions["DownstreamRuntimeReady"].message
        assert conditions["RuntimeReady"].status  # the node stays ready for VM pods
        # the merged list: containerd's pods as it last listed them, not left out
        listed = shim.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
        assert {s.id for s in listed} == {env.ids["plain"], env.ids["vm"]}
        # a pull for no pod it knows goes to both stores: vmsandbox's alone is enough now
        pulled = shim.images.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")), timeout=120)
        assert pulled.image_ref.startswith("sha256:")
    finally:
        ctd.up()
    # back, without a shim restart
    deadline = time.monotonic() + 20
    while True:
        try:
            status = shim.runtime.ContainerStatus(
                pb.ContainerStatusRequest(container_id=env.ids["plain-container"]), timeout=30
            ).status
            break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert status.id == env.ids["plain-container"]
    # the shim's own channel to it reconnects within its backoff (at most a second), whatever
    # the front found meanwhile
    deadline = time.monotonic() + 5
    while not _conditions(shim)["DownstreamRuntimeReady"].status:
        assert time.monotonic() < deadline, "Status never saw the downstream back"
        time.sleep(0.2)


def test_restarted_shim_finds_the_same_routing(env: Env) -> None:
    if "plain" not in env.ids:
        pytest.skip("needs the pods of the first test")
    env.restart()
    shim = env.shim
    for key in ("plain", "vm"):
        got = shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=env.ids[key]), timeout=30)
        assert got.status.id == env.ids[key]
    assert (
        shim.runtime.ContainerStatus(
            pb.ContainerStatusRequest(container_id=env.ids["plain-container"]), timeout=30
        ).status.state
        == pb.CONTAINER_EXITED
    )
    # teardown of the ordinary pod reaches containerd
    shim.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=env.ids["plain"]), timeout=60)
    shim.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=env.ids["plain"]), timeout=60)
    with env.ctd.runtime() as direct:
        assert direct.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items == []


# -- bytes pass through: a capture server as the downstream ------------------------------------


class Capture:
    """A gRPC server that records every request's bytes and answers canned bytes."""

    def __init__(self, sock: Path, answers: dict[str, bytes]) -> None:
        self.seen: list[tuple[str, bytes, dict[str, object]]] = []
        self.answers = answers
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))

        def handle(method: str) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
            def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
                self.seen.append((method, request, dict(context.invocation_metadata())))
                return self.answers.get(method, b"")

            return grpc.unary_unary_rpc_method_handler(answer)

        class Generic(grpc.GenericRpcHandler):  # type: ignore[type-arg]
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:  # type: ignore[type-arg]
                return handle(details.method)

        self.server.add_generic_rpc_handlers((Generic(),))
        self.server.add_insecure_port(f"unix:{sock}")
        self.server.start()


UNKNOWN = b"\xfa\x3e\x07unknown"  # field 999, length-delimited: no message of the CRI has it


def test_unknown_fields_pass_through_unchanged(tmp_path: Path) -> None:
    require_host()
    cid = "ab" * 32
    sid = "cd" * 32
    listed = pb.ListContainersResponse(containers=[pb.Container(id=cid, pod_sandbox_id=sid)])
    item = pb.PodSandbox(id=sid, runtime_handler="runc").SerializeToString() + UNKNOWN
    pods = pb.ListPodSandboxResponse.FromString(b"\x0a" + bytes([len(item)]) + item)
    status_reply = pb.ContainerStatusResponse(status=pb.ContainerStatus(id=cid)).SerializeToString() + UNKNOWN
    capture = Capture(
        tmp_path / "down.sock",
        {
            RUNTIME + "ListContainers": listed.SerializeToString(),
            RUNTIME + "ListPodSandbox": pods.SerializeToString(),
            RUNTIME + "ContainerStatus": status_reply,
        },
    )
    (tmp_path / "shim").mkdir()
    shim = start_shim(
        tmp_path / "shim", extra_config={"downstream_endpoint": f"unix://{tmp_path / 'down.sock'}"}, pull_busybox=False
    )
    try:
        sent = pb.ContainerStatusRequest(container_id=cid, verbose=True).SerializeToString() + UNKNOWN
        call = shim.channel.unary_unary(RUNTIME + "ContainerStatus", None, None)
        reply = call(sent, timeout=10, metadata=(("x-trace", "t-1"),))
        forwarded = [(m, b, md) for m, b, md in capture.seen if m.endswith("/ContainerStatus")]
        assert forwarded[-1][1] == sent  # the request bytes as sent, unknown field included
        assert forwarded[-1][2].get("x-trace") == "t-1"  # metadata propagates
        assert reply.endswith(UNKNOWN)  # the reply as the downstream answered it
        merged = shim.channel.unary_unary(RUNTIME + "ListPodSandbox", None, None)(b"", timeout=10)
        assert UNKNOWN in merged  # a merged list keeps the downstream's unknown fields
    finally:
        stop_shim(shim)
        capture.server.stop(0)


def test_downstream_absent_at_start_is_found_when_it_comes(tmp_path: Path) -> None:
    """No VM is booted: the shim starts before its containerd, says so, and serves it once it is up."""
    require_host()
    if busybox_registry() is None:
        pytest.skip("no local registry (docker-registry, skopeo, busybox-static)")
    (tmp_path / "shim").mkdir()
    (tmp_path / "net.d").mkdir()
    ctd = Containerd(tmp_path / "containerd", tmp_path / "net.d", str(busybox_registry()))
    shim = start_shim(tmp_path / "shim", extra_config={"downstream_endpoint": ctd.endpoint}, pull_busybox=False)
    try:
        down = _conditions(shim)["DownstreamRuntimeReady"]
        assert not down.status and ctd.endpoint in down.message
        host_pod = pod("host-net", containers=[])
        host_pod.linux.security_context.namespace_options.network = pb.NODE
        with pytest.raises(grpc.RpcError) as err:
            shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=host_pod), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and ctd.endpoint in (err.value.details() or "")
        assert "Downstream" not in shim.runtime.Version(pb.VersionRequest(), timeout=10).runtime_name
        ctd.up()
        try:
            deadline = time.monotonic() + 20
            while not _conditions(shim)["DownstreamRuntimeReady"].status:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            sid = shim.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=host_pod), timeout=120).pod_sandbox_id
            with ctd.runtime() as direct:
                assert [s.id for s in direct.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items] == [sid]
            assert (
                shim.runtime.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=30).status.state
                == pb.SANDBOX_READY
            )
        finally:
            if ctd.running():
                ctd.remove_all()
            ctd.down()
    finally:
        stop_shim(shim)
