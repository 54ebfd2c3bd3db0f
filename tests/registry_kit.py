"""A real local registry and images built from local files, for tests, the benchmark and scripts.

``Registry`` runs Debian's ``docker-registry`` on 127.0.0.1 with its own configuration, storage
and free port (optionally behind htpasswd basic auth), and stops it by PID. ``Layout`` writes
an OCI image layout (blobs, manifests, configs, indexes) from layers built here with ``tarfile``
— ordinary files from the host (busybox-static), whiteouts, hostile entries — and ``push`` copies
a tag of it to the registry with skopeo, as a CI pipeline would. ``Buildah`` builds Docker-format
images (and Docker manifest lists) with Debian's ``buildah``, an independent builder that writes
Docker-only config fields; ``put_blob``/``put_manifest`` push raw documents over the registry API
(what no builder here makes: Docker zstd layers, foreign layers), and ``served_manifest`` reads
back what the registry serves, for tests to compare with.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import interrupts
from tests.ports import quiet_port

BUSYBOX = Path("/bin/busybox")
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
ACCEPT_ALL = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))


def free_port() -> int:
    return quiet_port()


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- layers -------------------------------------------------------------------------------------------
@dataclass
class Entry:
    info: tarfile.TarInfo
    data: bytes = b""


def file(
    name: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0, pax: dict[str, str] | None = None
) -> Entry:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, uid, gid, 1_700_000_000
    info.pax_headers = dict(pax or {})
    return Entry(info, data)


def directory(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Entry:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.mtime = tarfile.DIRTYPE, mode, uid, gid, 1_700_000_000
    return Entry(info)


def symlink(name: str, target: str) -> Entry:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
    return Entry(info)


def hardlink(name: str, target: str, mode: int = 0o644) -> Entry:
    """A hard link; ``mode`` is what the header says (tar writes the linked file's; containerd applies it)."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = tarfile.LNKTYPE, target, mode
    return Entry(info)


def device(name: str, kind: bytes = tarfile.CHRTYPE, major: int = 1, minor: int = 3) -> Entry:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor, info.mode = kind, major, minor, 0o666
    return Entry(info)


def fifo(name: str) -> Entry:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.FIFOTYPE, 0o644
    return Entry(info)


def whiteout(path: str) -> Entry:
    head, _, base = path.rpartition("/")
    return file(f"{head}/.wh.{base}" if head else f".wh.{base}", b"")


def opaque(directory_path: str) -> Entry:
    return file(f"{directory_path.rstrip('/')}/.wh..wh..opq", b"")


def busybox_entries(applets: tuple[str, ...] = ("sh", "ls", "cat", "echo", "sleep", "id", "top")) -> list[Entry]:
    """A busybox root: /bin/busybox from the host's busybox-static, applet symlinks, /etc/passwd."""
    passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
    group = b"root:x:0:\nnogroup:x:65534:\n"
    out = [
        directory("bin"),
        file("bin/busybox", BUSYBOX.read_bytes(), 0o755),
        directory("etc"),
        directory("tmp", 0o1777),
    ]
    out += [symlink(f"bin/{a}", "busybox") for a in applets]
    out += [file("etc/passwd", passwd), file("etc/group", group)]
    return out


def tar_bytes(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            tar.addfile(e.info, io.BytesIO(e.data) if e.info.isreg() else None)
    return buf.getvalue()


# -- OCI layout ---------------------------------------------------------------------------------------
@dataclass
class Layout:
    """An OCI image layout directory built blob by blob."""

    path: Path
    refs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        (self.path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self._write_index()

    def blob(self, data: bytes, media_type: str) -> dict[str, Any]:
        d = digest_of(data)
        (self.path / "blobs" / "sha256" / d[7:]).write_bytes(data)
        return {"mediaType": media_type, "digest": d, "size": len(data)}

    def layer(self, entries: list[Entry], compress: bool = True) -> tuple[dict[str, Any], str]:
        """(descriptor, diff id) of a layer made of ``entries``."""
        raw = tar_bytes(entries)
        data = gzip.compress(raw, compresslevel=1, mtime=0) if compress else raw
        return self.blob(data, LAYER_GZIP if compress else LAYER_TAR), digest_of(raw)

    def raw_layer(self, data: bytes, diff_id: str, media_type: str = LAYER_GZIP) -> tuple[dict[str, Any], str]:
        return self.blob(data, media_type), diff_id

    def zstd_layer(self, entries: list[Entry]) -> tuple[dict[str, Any], str]:
        import zstandard

        raw = tar_bytes(entries)
        return self.blob(zstandard.ZstdCompressor().compress(raw), LAYER_ZSTD), digest_of(raw)

    def manifest(self, config: dict[str, Any], layers: list[dict[str, Any]]) -> dict[str, Any]:
        """The descriptor of a manifest of ``config`` (a descriptor) and ``layers``, whatever the config says."""
        doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config, "layers": layers}
        return self.blob(json.dumps(doc, sort_keys=True).encode(), OCI_MANIFEST)

    def config_of(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """The config descriptor of the manifest ``manifest`` describes."""
        doc = json.loads((self.path / "blobs" / "sha256" / str(manifest["digest"])[7:]).read_bytes())
        return dict(doc["config"])

    def image(
        self,
        layers: list[tuple[dict[str, Any], str]],
        *,
        user: str = "",
        arch: str = "amd64",
        os_name: str = "linux",
        cmd: tuple[str, ...] = ("/bin/sh",),
        env: tuple[str, ...] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",),
        labels: dict[str, str] | None = None,
        salt: str = "",
    ) -> dict[str, Any]:
        """The manifest descriptor of an image of ``layers`` (``salt`` makes otherwise equal images differ)."""
        config: dict[str, Any] = {
            "architecture": arch,
            "os": os_name,
            "created": "2024-01-01T00:00:00Z",
            "config": {"Env": list(env), "Cmd": list(cmd), "User": user, "Labels": {**(labels or {}), "salt": salt}},
            "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]},
        }
        cdesc = self.blob(json.dumps(config, sort_keys=True).encode(), OCI_CONFIG)
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": cdesc, "layers": [d for d, _ in layers]}
        desc = self.blob(json.dumps(manifest, sort_keys=True).encode(), OCI_MANIFEST)
        desc["platform"] = {"architecture": arch, "os": os_name}
        return desc

    def index(self, manifests: list[dict[str, Any]]) -> dict[str, Any]:
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}
        return self.blob(json.dumps(index, sort_keys=True).encode(), OCI_INDEX)

    def tag(self, name: str, desc: dict[str, Any]) -> None:
        d = {k: v for k, v in desc.items() if k != "platform"}
        self.refs[name] = {**d, "annotations": {"org.opencontainers.image.ref.name": name}}
        self._write_index()

    def _write_index(self) -> None:
        doc = {"schemaVersion": 2, "manifests": list(self.refs.values())}
        (self.path / "index.json").write_text(json.dumps(doc))


def push(layout: Layout, tag: str, dest: str, *, creds: str = "") -> None:
    """``skopeo copy`` the tag of ``layout`` to ``dest`` (``host:port/repo:tag``), every platform of an index."""
    argv = ["skopeo", "copy", "--quiet", "--all", "--dest-tls-verify=false", "--insecure-policy"]
    if creds:
        argv += ["--dest-creds", creds]
    argv += [f"oci:{layout.path}:{tag}", f"docker://{dest}"]
    subprocess.run(argv, check=True, capture_output=True, stdin=subprocess.DEVNULL)


# -- raw registry API (distribution spec) ---------------------------------------------------------------
def put_blob(host: str, repo: str, data: bytes) -> str:
    """Upload ``data`` as a blob of ``repo`` (monolithic upload); returns its digest."""
    start = urllib.request.Request(f"http://{host}/v2/{repo}/blobs/uploads/", method="POST")
    with urllib.request.urlopen(start, timeout=30) as r:
        location = r.headers["Location"]
    if location.startswith("/"):
        location = f"http://{host}{location}"
    digest = digest_of(data)
    sep = "&" if "?" in location else "?"
    put = urllib.request.Request(
        f"{location}{sep}digest={digest}", data=data, method="PUT", headers={"Content-Type": "application/octet-stream"}
    )
    urllib.request.urlopen(put, timeout=30).close()
    return digest


def put_manifest(host: str, repo: str, reference: str, doc: dict[str, Any]) -> tuple[bytes, str]:
    """Push ``doc`` (its ``mediaType`` is the content type) as ``repo:reference``; (bytes, digest)."""
    data = json.dumps(doc).encode()
    req = urllib.request.Request(
        f"http://{host}/v2/{repo}/manifests/{reference}",
        data=data,
        method="PUT",
        headers={"Content-Type": str(doc["mediaType"])},
    )
    urllib.request.urlopen(req, timeout=30).close()
    return data, digest_of(data)


def served_manifest(host: str, repo: str, reference: str, accept: str = ACCEPT_ALL) -> bytes:
    """The manifest or index bytes the registry serves for ``repo:reference`` (or ``@digest``)."""
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{reference}", headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=30) as r:
        return bytes(r.read())


# -- buildah ------------------------------------------------------------------------------------------
@dataclass
class Buildah:
    """Debian's ``buildah`` with storage of its own under ``root`` (vfs: plain directories, nothing
    mounted), building images from scratch and pushing them in Docker format (v2s2)."""

    root: Path

    def run(self, *args: str) -> str:
        argv = ["buildah", "--root", str(self.root / "storage"), "--runroot", str(self.root / "run")]
        argv += ["--storage-driver", "vfs", *args]
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"buildah {' '.join(args[:2])} failed: {done.stderr[-2000:]}")
        return done.stdout.strip()

    def image(
        self,
        name: str,
        layers: list[dict[str, bytes]],
        *,
        arch: str = "amd64",
        cmd: str = "",
        user: str = "",
        env: tuple[str, ...] = (),
    ) -> None:
        """Commit ``name`` (Docker format) with one layer per mapping of path -> file contents."""
        work = self.root / "ctx"
        parent = "scratch"
        for n, files in enumerate(layers):
            container = self.run("from", "--arch", arch, parent)
            shutil.rmtree(work, ignore_errors=True)
            for path, data in files.items():
                target = work / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                target.chmod(0o755)
            self.run("copy", container, str(work), "/")
            if n == len(layers) - 1:
                args = ["--arch", arch, "--os", "linux"]
                if cmd:
                    args += ["--cmd", cmd]
                if user:
                    args += ["--user", user]
                for e in env:
                    args += ["--env", e]
                self.run("config", *args, container)
            parent = f"{name}-layer{n}" if n < len(layers) - 1 else name
            self.run("commit", "--quiet", "--format", "docker", container, parent)
            self.run("rm", container)

    def push(self, name: str, dest: str) -> None:
        self.run("push", "--quiet", "--tls-verify=false", "--format", "v2s2", name, f"docker://{dest}")

    def push_list(self, name: str, images: list[str], dest: str) -> None:
        """A Docker manifest list of ``images`` (each with its own platform), pushed with all of them."""
        self.run("manifest", "create", name)
        for image in images:
            self.run("manifest", "add", name, f"containers-storage:localhost/{image}")
        self.run(
            "manifest", "push", "--quiet", "--all", "--tls-verify=false", "--format", "v2s2", name, f"docker://{dest}"
        )


# -- registry -----------------------------------------------------------------------------------------
@dataclass
class Registry:
    """Debian's docker-registry on 127.0.0.1:``port``, storage and config under ``root``."""

    root: Path
    users: dict[str, str] = field(default_factory=dict)  # username -> password (htpasswd basic auth)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "registry.log"

    def start(self) -> Registry:
        """Start it and wait until it answers; stopped again if that fails or is interrupted (SIGTERM
        and SIGINT are exceptions from here on: ``tests.interrupts``), so the caller stops only a
        registry it was handed."""
        interrupts.install()
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        config: dict[str, Any] = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(self.root / "data")}, "delete": {"enabled": True}},
            "http": {"addr": self.host},
            # accept manifests whose non-distributable layers name URLs (the default refuses any URL)
            "validation": {"manifests": {"urls": {"allow": ["^https?://"]}}},
        }
        if self.users:
            lines = [
                subprocess.run(
                    ["htpasswd", "-nbB", user, password], check=True, capture_output=True, text=True
                ).stdout.strip()
                for user, password in self.users.items()
            ]
            (self.root / "htpasswd").write_text("\n".join(lines) + "\n")
            config["auth"] = {"htpasswd": {"realm": "vmsandbox-test", "path": str(self.root / "htpasswd")}}
        (self.root / "config.json").write_text(json.dumps(config))  # YAML is a superset of JSON
        self.process = subprocess.Popen(
            ["docker-registry", "serve", str(self.root / "config.json")],
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            self._wait_answering(self.process, time.monotonic() + 20)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_answering(self, process: subprocess.Popen[bytes], deadline: float) -> None:
        while True:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # 401 with auth on: it answers
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"docker-registry did not start: {self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def blob_gets(self) -> dict[str, int]:
        """digest -> how many times a client GET the blob (from the access log)."""
        counts: dict[str, int] = {}
        for line in self.log_path.read_text(errors="replace").splitlines():
            if '"GET /v2/' in line and "/blobs/sha256:" in line and '" 200 ' in line:
                d = line.split("/blobs/", 1)[1].split(" ", 1)[0]
                counts[d] = counts.get(d, 0) + 1
        return counts

    def remove_data(self) -> None:
        shutil.rmtree(self.root / "data", ignore_errors=True)
