"""The registry transport: Debian's ``skopeo`` (containers/image) run as a child process.

``fetch_manifest`` reads a manifest or index as the registry serves it (``skopeo inspect --raw``);
``copy`` brings one platform manifest with its config and layers into an OCI layout whose blobs
land in the store's shared blob directory (``--dest-shared-blob-dir``): containers/image verifies
every blob's digest while it downloads, writes it to a temporary name and renames it into place,
and skips blobs the directory already holds. ``--preserve-digests`` keeps the manifest and config
as the registry served them (skopeo 1.9's OCI layout stores Docker schema 2 media types as they
are; without the flag it converts them to OCI, re-serialising the config under another digest).
An OCI layout takes non-distributable layers that name URLs by reference, without their blob;
``copy_dir`` (the ``dir:`` transport, which downloads them) brings those.

Credentials for one pull go into a temporary auth file (0600, in the store's private work
directory, deleted afterwards): never on a command line, never in a log. skopeo's own
``registries.conf`` and signature policy are replaced by empty ones we own, so only the shim's
configuration decides mirrors and insecure registries.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vmsandbox.errors import (
    CannotFit,
    InfrastructureError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    VmSandboxError,
)
from vmsandbox.registries import Credentials, Endpoint

log = logging.getLogger(__name__)

MAX_MESSAGE = 300


_PATTERNS: tuple[tuple[re.Pattern[str], type[VmSandboxError]], ...] = (
    (re.compile(r"no space left on device|disk quota exceeded", re.I), CannotFit),
    (re.compile(r"unauthorized|authentication required|invalid username/password|incorrect username", re.I),
     Unauthenticated),
    (re.compile(r"\bdenied\b|forbidden|status 403", re.I), PermissionDenied),
    (re.compile(r"manifest unknown|name unknown|blob unknown|not found|status 404", re.I), NotFound),
    (re.compile(r"digest did not match|does not match digest|Digest did not match|unsupported .*media ?type|"
                r"unsupported docker v2s2|invalid manifest|manifest schema", re.I), InvalidArgument),
    (re.compile(r"connection refused|no such host|i/o timeout|timeout|network is unreachable|"
                r"connection reset|TLS|x509|server gave HTTP response|EOF|dial tcp|pinging container registry",
                re.I), InfrastructureError),
)  # fmt: skip


def classify(stderr: str) -> type[VmSandboxError]:
    """The error kind a skopeo failure message stands for (first match wins; unknown -> UNAVAILABLE)."""
    for pattern, kind in _PATTERNS:
        if pattern.search(stderr):
            return kind
    return InfrastructureError


def _cause(stderr: str) -> str:
    """skopeo's last message line, without logrus' prefix, bounded."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else "no message"
    m = re.search(r'msg="(.*)"\s*\Z', text)
    if m:
        text = m.group(1).replace('\\"', '"')
    text = re.sub(r'^Error parsing image name "[^"]*": ', "", text)  # skopeo's wrapper adds nothing
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "…"


_PROXY_VARIABLES = frozenset({"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"})


class Skopeo:
    """One skopeo binary with a private, empty registries.conf and an accept-all signature policy."""

    def __init__(self, work_dir: Path, binary: str = "skopeo", auth_file: str = "", timeout_s: float = 3600) -> None:
        self.binary = binary
        self.work_dir = work_dir
        self.auth_file = auth_file
        self.timeout_s = timeout_s
        work_dir.mkdir(parents=True, exist_ok=True)
        self._registries_conf = work_dir / "registries.conf"
        self._policy = work_dir / "policy.json"
        self._registries_conf.write_text("# the shim decides mirrors and insecure registries\n")
        self._policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))

    @contextmanager
    def _auth_args(self, endpoint: Endpoint, creds: Credentials | None, flag: str, anon: str) -> Iterator[list[str]]:
        if creds is not None and creds.auth_entry():
            path = self.work_dir / f"auth-{os.getpid()}-{os.urandom(8).hex()}.json"
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                with os.fdopen(handle, "w") as f:
                    json.dump({"auths": {endpoint.host: creds.auth_entry()}}, f)
                yield [flag, str(path)]
            finally:
                path.unlink(missing_ok=True)
        elif self.auth_file:
            yield [flag, self.auth_file]
        else:
            yield [anon]

    def _run(self, argv: list[str], what: str) -> bytes:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.work_dir),
            "TMPDIR": str(self.work_dir),
            "CONTAINERS_REGISTRIES_CONF": str(self._registries_conf),
            # a node behind a proxy reaches its registries through it, as containerd does
            **{k: v for k, v in os.environ.items() if k in _PROXY_VARIABLES},
        }
        try:
            done = subprocess.run(
                [self.binary, "--policy", str(self._policy), *argv],
                capture_output=True,
                timeout=self.timeout_s,
                env=env,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except FileNotFoundError:
            raise InfrastructureError(
                f"{what}: {self.binary} is not installed (scripts/setup-host.sh installs it)"
            ) from None
        except subprocess.TimeoutExpired:
            raise InfrastructureError(f"{what}: no answer within {self.timeout_s:.0f} s") from None
        if done.returncode != 0:
            stderr = done.stderr.decode(errors="replace")
            kind = classify(stderr)
            raise kind(f"{what}: {_cause(stderr)}")
        return done.stdout

    def fetch_manifest(self, endpoint: Endpoint, tag_or_digest: str, creds: Credentials | None, what: str) -> bytes:
        """The manifest or index ``endpoint.repository`` serves for the tag or digest, byte for byte."""
        sep = "@" if tag_or_digest.startswith("sha256:") else ":"
        tls = ["--tls-verify=false"] if endpoint.insecure else []
        with self._auth_args(endpoint, creds, "--authfile", "--no-creds") as auth:
            return self._run(
                ["inspect", "--raw", *tls, *auth, f"docker://{endpoint.repository}{sep}{tag_or_digest}"], what
            )

    def copy(
        self, endpoint: Endpoint, digest: str, creds: Credentials | None, layout: Path, blob_dir: Path, what: str
    ) -> None:
        """Copy ``repository@digest`` into the OCI layout ``layout``, blobs into ``blob_dir``."""
        self._copy(endpoint, digest, creds, ["--dest-shared-blob-dir", str(blob_dir)], f"oci:{layout}:image", what)

    def copy_dir(self, endpoint: Endpoint, digest: str, creds: Credentials | None, directory: Path, what: str) -> None:
        """Copy ``repository@digest`` into ``directory`` (the ``dir:`` transport: one file per blob,
        named by its hex digest), non-distributable layers included."""
        self._copy(endpoint, digest, creds, [], f"dir:{directory}", what)

    def _copy(
        self, endpoint: Endpoint, digest: str, creds: Credentials | None, dest_args: list[str], dest: str, what: str
    ) -> None:
        """``skopeo copy --preserve-digests`` of ``repository@digest`` to ``dest``: no conversion."""
        tls = ["--src-tls-verify=false"] if endpoint.insecure else []
        with self._auth_args(endpoint, creds, "--src-authfile", "--src-no-creds") as auth:
            argv = ["copy", "--quiet", "--preserve-digests", *tls, *auth, *dest_args]
            self._run([*argv, f"docker://{endpoint.repository}@{digest}", dest], what)
