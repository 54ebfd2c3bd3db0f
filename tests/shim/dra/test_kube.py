"""shim.dra.kube against a local HTTPS server that asks for the kubeconfig's client certificate: the
paths and verbs the driver's RBAC allows, the status codes it maps, and its bounds."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from shim.dra import kube
from shim.dra.kube import ApiError, Conflict, KubeClient
from vmsandbox.errors import InfrastructureError, InvalidArgument, NotFound


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"), "-days", "2",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")  # fmt: skip
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):  # fmt: skip
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"),
                 "-CAkey", str(d / "ca.key"), "-set_serial", "1", "-days", "2",
                 "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.crt"))  # fmt: skip
    return d


class Api(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str, Any, str]]] = []
    replies: ClassVar[dict[tuple[str, str], tuple[int, bytes]]] = {}

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append((self.command, self.path, body, self.headers.get("Authorization", "")))
        status, data = self.replies.get((self.command, self.path), (200, b"{}"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(pki: Path) -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki / "server.crt", pki / "server.key")
    ctx.load_verify_locations(pki / "ca.crt")
    ctx.verify_mode = ssl.CERT_REQUIRED
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    Api.seen, Api.replies = [], {}
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def kubeconfig(tmp: Path, pki: Path, port: int, inline: bool = False, token: str = "") -> str:
    user: dict[str, Any] = {"token": token} if token else {}
    cluster: dict[str, Any] = {"server": f"https://127.0.0.1:{port}"}
    if inline:
        cluster["certificate-authority-data"] = base64.b64encode((pki / "ca.crt").read_bytes()).decode()
        user["client-certificate-data"] = base64.b64encode((pki / "client.crt").read_bytes()).decode()
        user["client-key-data"] = base64.b64encode((pki / "client.key").read_bytes()).decode()
    else:
        cluster["certificate-authority"] = str(pki / "ca.crt")
        user.update({"client-certificate": str(pki / "client.crt"), "client-key": str(pki / "client.key")})
    doc = {
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("inline", [False, True])
def test_calls(tmp_path: Path, pki: Path, server: int, inline: bool) -> None:
    client = KubeClient(kubeconfig(tmp_path, pki, server, inline=inline))
    claim_path = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c1"
    Api.replies[("GET", claim_path)] = (200, b'{"metadata": {"name": "c1"}}')
    assert client.get_claim("ns", "c1") == {"metadata": {"name": "c1"}}
    listed = "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.driver%3Dd%2Cspec.nodeName%3Dn"
    Api.replies[("GET", listed)] = (200, b'{"items": [{"metadata": {"name": "s"}}]}')
    assert client.list_slices("d", "n") == [{"metadata": {"name": "s"}}]
    client.create_slice({"metadata": {"name": "s"}})
    client.update_slice("s", {"metadata": {"name": "s"}})
    Api.replies[("DELETE", "/apis/resource.k8s.io/v1/resourceslices/gone")] = (404, b"{}")
    client.delete_slice("gone")  # already gone: fine
    assert [(m, p) for m, p, _, _ in Api.seen[2:]] == [
        ("POST", "/apis/resource.k8s.io/v1/resourceslices"),
        ("PUT", "/apis/resource.k8s.io/v1/resourceslices/s"),
        ("DELETE", "/apis/resource.k8s.io/v1/resourceslices/gone"),
    ]
    assert Api.seen[2][2] == {"metadata": {"name": "s"}}


def test_claim_status_is_applied_server_side(tmp_path: Path, pki: Path, server: int) -> None:
    client = KubeClient(kubeconfig(tmp_path, pki, server))
    client.apply_claim_status("ns", "c1", {"status": {"devices": []}}, "vmsandbox.dev")
    method, path, body, _ = Api.seen[-1]
    assert (method, body) == ("PATCH", {"status": {"devices": []}})
    assert (
        path == "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c1/status?fieldManager=vmsandbox.dev&force=true"
    )


def test_token_and_escaped_names(tmp_path: Path, pki: Path, server: int) -> None:
    client = KubeClient(kubeconfig(tmp_path, pki, server, token="s3cret"))
    client.get_claim("ns", "a/../b")
    assert Api.seen[-1][1] == "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/a%2F..%2Fb"
    assert Api.seen[-1][3] == "Bearer s3cret"


@pytest.mark.parametrize(
    ("status", "body", "error", "text"),
    [
        (404, b"{}", NotFound, "not found"),
        (409, b'{"message": "the object has been modified"}', Conflict, "409 the object has been modified"),
        (403, b'{"message": "forbidden"}', ApiError, "403 forbidden"),
        (200, b"not json", InfrastructureError, "not JSON"),
        (200, b" " * (kube.MAX_REPLY_BYTES + 1), InfrastructureError, "larger than"),
    ],
)
def test_errors(
    tmp_path: Path, pki: Path, server: int, status: int, body: bytes, error: type[Exception], text: str
) -> None:
    Api.replies[("GET", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c")] = (status, body)
    with pytest.raises(error, match=text):
        KubeClient(kubeconfig(tmp_path, pki, server)).get_claim("ns", "c")


def test_untrusted_server_refused(tmp_path: Path, pki: Path, server: int) -> None:
    path = kubeconfig(tmp_path, pki, server)
    doc = yaml.safe_load(Path(path).read_text())
    doc["clusters"][0]["cluster"]["certificate-authority"] = str(pki / "client.crt")  # not the server's CA
    Path(path).write_text(yaml.safe_dump(doc))
    with pytest.raises(InfrastructureError):
        KubeClient(path).get_claim("ns", "c")


@pytest.mark.parametrize(
    ("doc", "text"),
    [
        ("[]", "must be a mapping"),
        ("current-context: nope", "no context"),
        ("{contexts: [{name: x, context: {cluster: c, user: u}}], current-context: x, "
         "clusters: [{name: c, cluster: {server: 'http://a'}}], users: [{name: u, user: {}}]}", "https://"),
    ],
)  # fmt: skip
def test_kubeconfig_refused(tmp_path: Path, doc: str, text: str) -> None:
    (tmp_path / "k").write_text(doc)
    with pytest.raises(InvalidArgument, match=text):
        KubeClient(str(tmp_path / "k"))
