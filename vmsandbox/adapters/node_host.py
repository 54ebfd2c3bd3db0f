"""The host side of a node install (``vmsandbox node``, ``cli/node.py``): files written atomically
with their mode, the launchers' links, directories made and removed (never across a mount),
containerd restarted by the admin's command and waited for on its CRI socket, and the Node's
label patched through the API server. What is changed is decided by ``vmsandbox/node_install.py``."""

from __future__ import annotations

import base64
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from vmsandbox.errors import InfrastructureError, InvalidArgument
from vmsandbox.mountinfo import unescape
from vmsandbox.node_install import PROFILES_HEADER, profiles_on_image

READ_LIMIT = 16 << 20
"""The largest configuration file read (bytes)."""


def read_bytes(path: str) -> bytes | None:
    """The file's bytes; None when there is no such file."""
    try:
        with open(path, "rb") as f:
            data = f.read(READ_LIMIT + 1)
    except FileNotFoundError:
        return None
    if len(data) > READ_LIMIT:
        raise InvalidArgument(f"{path}: larger than {READ_LIMIT} bytes")
    return data


def file_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o7777


def write_atomic(path: str, data: bytes, mode: int) -> None:
    """``data`` at ``path`` with ``mode``, renamed into place (a reader sees the old file or the new)."""
    parent = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def existing_dirs(path: str) -> list[str]:
    """The directories of ``path``, from ``/`` down, that exist."""
    out = ["/"]
    current = ""
    for part in os.path.normpath(path).strip("/").split("/"):
        current += "/" + part
        if not os.path.isdir(current):
            break
        out.append(current)
    return out


def make_dirs(path: str, mode: int = 0o755) -> None:
    os.makedirs(path, mode=mode, exist_ok=True)


def link(target: str, at: str) -> None:
    """A symlink at ``at`` to ``target``; refused when something else is there."""
    if os.path.lexists(at):
        if os.path.islink(at) and os.readlink(at) == target:
            return
        raise InvalidArgument(f"{at} exists already (not the installer's link to {target})")
    os.symlink(target, at)


def unlink_ours(at: str, target: str) -> bool:
    """Remove the symlink at ``at`` when it points to ``target``; whether it did."""
    if os.path.islink(at) and os.readlink(at) == target:
        os.unlink(at)
        return True
    return False


def remove_file(path: str) -> None:
    Path(path).unlink(missing_ok=True)


def _mounts() -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        return [unescape(line.split()[4]) for line in f if len(line.split()) > 4]


def remove_tree(path: str) -> None:
    """``path`` and everything under it; refused while something is mounted there."""
    if not os.path.lexists(path):
        return
    real = os.path.realpath(path)
    mounted = [m for m in _mounts() if m == real or m.startswith(real.rstrip("/") + "/")]
    if mounted:
        raise InfrastructureError(f"{path}: {mounted[0]} is mounted there; not removed")
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def restart_containerd(command: str, timeout_s: float) -> None:
    """The admin's restart command (``sh -c``), with a plain environment."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise InfrastructureError(f"restarting containerd ({command!r}) took more than {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise InfrastructureError(
            f"restarting containerd ({command!r}) failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )


def wait_cri(address: str, timeout_s: float) -> str:
    """Wait until containerd's CRI answers ``Version`` on ``address`` (its gRPC socket); its version."""
    import grpc

    from gen.cri.runtime.v1 import api_pb2 as pb
    from gen.cri.runtime.v1 import api_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            with grpc.insecure_channel(f"unix:{address}") as channel:
                reply = pb_grpc.RuntimeServiceStub(channel).Version(pb.VersionRequest(), timeout=5)
                return str(reply.runtime_version)
        except grpc.RpcError as e:
            last = str(e.details() if hasattr(e, "details") else e)
        if time.monotonic() > deadline:
            raise InfrastructureError(f"containerd's CRI on {address} did not answer within {timeout_s:.0f} s: {last}")
        time.sleep(1)


def _client_cert(user: dict[str, Any], scratch: str) -> tuple[str, str] | None:
    """The client certificate and key files of a kubeconfig user (inline data written to ``scratch``)."""
    files = []
    for key in ("client-certificate", "client-key"):
        if user.get(f"{key}-data"):
            path = os.path.join(scratch, key)
            with open(path, "wb") as f:
                f.write(base64.b64decode(user[f"{key}-data"]))
            files.append(path)
        elif user.get(key):
            files.append(str(user[key]))
    return (files[0], files[1]) if len(files) == 2 else None


def patch_node_label(
    node: str, body: bytes, *, server: str, token: str = "", ca_pem: str = "", kubeconfig: str = ""
) -> None:
    """A JSON merge patch of the Node ``node``: with a bearer ``token`` and the CA's PEM (the
    service account's), or with a kubeconfig's server, CA and client certificate."""
    with tempfile.TemporaryDirectory(prefix="vmsandbox-node-") as scratch:
        context = ssl.create_default_context()
        if kubeconfig:
            with open(kubeconfig, encoding="utf-8") as f:
                conf = yaml.safe_load(f.read(READ_LIMIT))
            cluster = conf["clusters"][0]["cluster"]
            user = conf["users"][0]["user"]
            server = str(cluster["server"])
            if cluster.get("certificate-authority-data"):
                context.load_verify_locations(
                    cadata=base64.b64decode(cluster["certificate-authority-data"]).decode("ascii")
                )
            elif cluster.get("certificate-authority"):
                context.load_verify_locations(cafile=str(cluster["certificate-authority"]))
            cert = _client_cert(user, scratch)
            if cert is not None:
                context.load_cert_chain(*cert)
            token = str(user.get("token") or "")
        elif ca_pem:
            context.load_verify_locations(cadata=ca_pem)
        headers = {"Content-Type": "application/merge-patch+json", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        url = f"{server.rstrip('/')}/api/v1/nodes/{node}"
        request = urllib.request.Request(url, data=body, method="PATCH", headers=headers)
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as reply:
                reply.read(READ_LIMIT)
        except urllib.error.HTTPError as e:
            detail = e.read(4096).decode("utf-8", errors="replace").strip()
            raise InfrastructureError(f"PATCH node {node}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise InfrastructureError(f"PATCH node {node} at {server}: {e}") from None


def profiles_for_node(text: str, image_dir: str) -> str:
    """The payload's profiles file, as the installed one: ``node_install.profiles_on_image`` of its
    YAML documents."""
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise InvalidArgument(f"profiles: not YAML: {e}") from None
    return PROFILES_HEADER + yaml.safe_dump_all(profiles_on_image(docs, image_dir), sort_keys=False)
