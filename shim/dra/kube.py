"""The API server as the DRA driver uses it: plain HTTPS with a kubeconfig's credentials (its
current context's cluster and user: a CA, and a client certificate and key or a bearer token, as
files or inline ``-data``), JSON bodies, bounded replies. Only the calls the driver's RBAC allows
(deploy/dra/rbac.yaml): get a ResourceClaim; list, create, update and delete ResourceSlices."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import ssl
import tempfile
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from vmsandbox.errors import InfrastructureError, InvalidArgument, NotFound

MAX_REPLY_BYTES = 8 << 20
RESOURCE = "/apis/resource.k8s.io/v1"


class ApiError(InfrastructureError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Conflict(ApiError):
    pass


class KubeClient:
    def __init__(self, kubeconfig: str, timeout_s: float = 10.0) -> None:
        self.host, self.port, self._ssl, self._token = _from_kubeconfig(kubeconfig)
        self._timeout = timeout_s

    def _call(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, content_type: str = "application/json"
    ) -> Any:
        conn = http.client.HTTPSConnection(self.host, self.port, timeout=self._timeout, context=self._ssl)
        headers = {"Accept": "application/json", "User-Agent": "vmsandbox-dra"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        try:
            conn.request(method, path, body=data, headers=headers)
            reply = conn.getresponse()
            raw = reply.read(MAX_REPLY_BYTES + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise InfrastructureError(f"API server {self.host}:{self.port}: {method} {path}: {exc}") from None
        finally:
            conn.close()
        if len(raw) > MAX_REPLY_BYTES:
            raise InfrastructureError(f"API server: {method} {path}: reply larger than {MAX_REPLY_BYTES} bytes")
        try:
            decoded = json.loads(raw) if raw else {}
        except ValueError:
            raise InfrastructureError(f"API server: {method} {path}: reply is not JSON") from None
        if reply.status == 404:
            raise NotFound(f"{path}: not found")
        if reply.status >= 300:
            message = decoded.get("message", "") if isinstance(decoded, dict) else ""
            kind = Conflict if reply.status == 409 else ApiError
            raise kind(reply.status, f"API server: {method} {path}: {reply.status} {str(message)[:512]}")
        return decoded

    def get_claim(self, namespace: str, name: str) -> Any:
        return self._call("GET", f"{RESOURCE}/namespaces/{_seg(namespace)}/resourceclaims/{_seg(name)}")

    def apply_claim_status(self, namespace: str, name: str, body: Mapping[str, Any], manager: str) -> Any:
        """Server-side apply of a ResourceClaim's status as field manager ``manager`` (the driver):
        idempotent, and only the fields this manager owns change (``status.devices[]`` is a map
        keyed by driver, pool, device and share id)."""
        query = urllib.parse.urlencode({"fieldManager": manager, "force": "true"})
        path = f"{RESOURCE}/namespaces/{_seg(namespace)}/resourceclaims/{_seg(name)}/status?{query}"
        return self._call("PATCH", path, body, "application/apply-patch+yaml")

    def list_slices(self, driver: str, node: str) -> list[Any]:
        selector = urllib.parse.quote(f"spec.driver={driver},spec.nodeName={node}")
        got = self._call("GET", f"{RESOURCE}/resourceslices?fieldSelector={selector}")
        items = got.get("items") if isinstance(got, dict) else None
        return items if isinstance(items, list) else []

    def create_slice(self, body: Mapping[str, Any]) -> Any:
        return self._call("POST", f"{RESOURCE}/resourceslices", body)

    def update_slice(self, name: str, body: Mapping[str, Any]) -> Any:
        return self._call("PUT", f"{RESOURCE}/resourceslices/{_seg(name)}", body)

    def delete_slice(self, name: str) -> None:
        with contextlib.suppress(NotFound):  # already gone
            self._call("DELETE", f"{RESOURCE}/resourceslices/{_seg(name)}")


def _seg(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _from_kubeconfig(path: str) -> tuple[str, int, ssl.SSLContext, str]:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"kubeconfig {path}: cannot read: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"kubeconfig {path}: must be a mapping")
    base = Path(path).parent

    def named(kind: str, name: object) -> dict[str, Any]:
        for entry in doc.get(kind + "s") or []:
            if isinstance(entry, dict) and entry.get("name") == name and isinstance(entry.get(kind), dict):
                return dict(entry[kind])
        raise InvalidArgument(f"kubeconfig {path}: no {kind} {name!r}")

    context = named("context", doc.get("current-context"))
    cluster, user = named("cluster", context.get("cluster")), named("user", context.get("user"))
    url = urllib.parse.urlsplit(str(cluster.get("server", "")))
    if url.scheme != "https" or not url.hostname:
        raise InvalidArgument(f"kubeconfig {path}: the cluster's server must be an https:// URL")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca = _material(cluster, "certificate-authority", base)
    if ca is not None:
        ctx.load_verify_locations(cadata=ca.decode())
    cert, key = _material(user, "client-certificate", base), _material(user, "client-key", base)
    if cert is not None and key is not None:
        with tempfile.TemporaryDirectory() as tmp:  # ssl loads a key pair from files only (0700 dir)
            cert_file, key_file = os.path.join(tmp, "c"), os.path.join(tmp, "k")
            for file, content in ((cert_file, cert), (key_file, key)):
                fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(content)
            ctx.load_cert_chain(cert_file, key_file)
    token = str(user.get("token", ""))
    return url.hostname, url.port or 443, ctx, token


def _material(section: Mapping[str, Any], key: str, base: Path) -> bytes | None:
    if section.get(f"{key}-data"):
        return base64.b64decode(str(section[f"{key}-data"]))
    if section.get(key):
        return (base / str(section[key])).read_bytes()
    return None
