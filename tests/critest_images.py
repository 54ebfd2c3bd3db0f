"""Push look-alikes of critest's test images to a local registry, so its image specs run offline.

critest (cri-tools) asks for ``gcr.io/k8s-staging-cri-tools/test-image-*``,
``registry.k8s.io/e2e-test-images/busybox:1.29-2``, ``registry.k8s.io/pause:3.9`` and
``k8s.gcr.io/pause:3.9``; with ``--registry-prefix HOST:PORT`` it pulls ``HOST:PORT/<path>``
instead. This builds images with the properties its specs check — distinct images for
``test-image-1..3``, one image under three ``test-image-tags`` tags, ``User`` set to a uid, a
username, ``uid:group`` and ``name:group``; every busybox applet; web servers (nginx, httpd) and a
setuid-root ``nnp`` from ``tests/lookalike`` (built with the host's Go) — and pushes each under
its path, its tag and ``latest`` (critest versions that take a prefix keep only the repository
path). The printed ``registries`` entry points those upstream registries at the local one in the
shim's configuration, which keeps the names critest checks in ImageStatus: the way to run its image
specs offline. What cannot be imitated: a spec that pins a digest of an upstream image.

    .venv/bin/python -m tests.critest_images --registry 127.0.0.1:5000
    .venv/bin/python -m tests.critest_images --start-registry /tmp/critest-registry   # prints host, pid, config
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests import interrupts
from tests.registry_kit import (
    BUSYBOX,
    Entry,
    Layout,
    Registry,
    busybox_entries,
    directory,
    file,
    hardlink,
    push,
    symlink,
)

STAGING = "k8s-staging-cri-tools"
E2E = "e2e-test-images"
PASSWD = (
    b"root:x:0:0:root:/root:/bin/sh\n"
    b"www-data:x:33:33:www-data:/var/www:/bin/false\n"
    b"default-user:x:1000:1000:Linux User,,,:/home/default-user:/bin/sh\n"
    b"nobody:x:65534:65534:nobody:/:/bin/false\n"
)
# as test-image-predefined-group's Dockerfile makes them: default-user (1000, its own group 1000)
# is also a member of group-defined-in-image (50000), which the SupplementalGroupsPolicy specs check
GROUP = (
    b"root:x:0:\nwww-data:x:33:\ndefault-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\nnogroup:x:65534:\n"
)

# repository -> (tags, User, salt that makes otherwise equal images distinct)
IMAGES: dict[str, tuple[tuple[str, ...], str, str]] = {
    f"{STAGING}/test-image-latest": (("latest",), "", "latest"),
    f"{STAGING}/test-image-tag": (("test", "all"), "", "tag"),
    f"{STAGING}/test-image-digest": (("latest",), "", "digest"),
    f"{STAGING}/test-image-1": (("latest",), "", "1"),
    f"{STAGING}/test-image-2": (("latest",), "", "2"),
    f"{STAGING}/test-image-3": (("latest",), "", "3"),
    f"{STAGING}/test-image-tags": (("1", "2", "3"), "", "tags"),
    f"{STAGING}/test-image-user-uid": (("latest",), "1002", "uid"),
    f"{STAGING}/test-image-user-username": (("latest",), "www-data", "username"),
    f"{STAGING}/test-image-user-uid-group": (("latest",), "1003:1003", "uid-group"),
    f"{STAGING}/test-image-user-username-group": (("latest",), "www-data:www-data", "username-group"),
    f"{STAGING}/test-image-predefined-group": (("latest",), "1000", "predefined-group"),
    f"{E2E}/busybox": (("1.29-2", "1.29-4", "latest"), "", "e2e-busybox"),
    f"{E2E}/nginx": (("1.14-2", "latest"), "", "e2e-nginx"),
    f"{E2E}/httpd": (("2.4.39-4", "latest"), "", "e2e-httpd"),
    f"{E2E}/nonewprivs": (("1.3", "latest"), "", "e2e-nonewprivs"),
    f"{STAGING}/hostnet-nginx-amd64": (("latest",), "", "hostnet-nginx"),
    "pause": (("3.9", "3.10", "latest"), "", "pause"),
}
UPSTREAM = ("gcr.io", "registry.k8s.io", "k8s.gcr.io")
LOOKALIKE = Path(__file__).with_name("lookalike") / "main.go"
# the process title real nginx gives its master process, which critest's PID namespace specs grep for
NGINX_CMD = ("/bin/sh", "-c", "exec -a 'nginx: master process nginx -g daemon off;' /usr/sbin/nginx")
# the host-network image's nginx serves on 12003, the port critest's host-network specs declare
HOSTNET_NGINX_CMD = ("/bin/sh", "-c", f"export LOOKALIKE_PORT=12003; {NGINX_CMD[2]}")
# repository -> (where its program is installed, the file's mode, the image's command)
PROGRAMS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    f"{E2E}/nginx": ("usr/sbin/nginx", 0o755, NGINX_CMD),
    f"{STAGING}/hostnet-nginx-amd64": ("usr/sbin/nginx", 0o755, HOSTNET_NGINX_CMD),
    f"{E2E}/httpd": ("usr/local/apache2/bin/httpd", 0o755, ("/usr/local/apache2/bin/httpd",)),
    f"{E2E}/nonewprivs": ("usr/local/bin/nnp", 0o4755, ("/usr/local/bin/nnp",)),
}


def applets() -> tuple[str, ...]:
    """Every applet of the host's busybox (critest's specs run grep, ipcs, pidof, mount, wget, ...)."""
    out = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout
    return tuple(a for a in out.split() if a and "/" not in a)


def build_lookalike(work: Path) -> bytes:
    """The static ``tests/lookalike`` program, built with the host's Go toolchain."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "lookalike"
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "", "GO111MODULE": "off"}
    subprocess.run(["go", "build", "-o", str(out), str(LOOKALIKE)], env=env, check=True, capture_output=True)
    return out.read_bytes()


# busybox-static has neither pgrep nor ipcs; the look-alike program stands in for both
TOOLS = ("bin/pgrep", "bin/ipcs")


def program_entries(path: str, mode: int, binary: bytes) -> list[Entry]:
    """``binary`` at ``path`` (root-owned), with its parent directories and /var/run."""
    parts = path.split("/")[:-1]
    dirs = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return [directory("var"), directory("var/run"), *(directory(d) for d in dirs), file(path, binary, mode)]


def registries_config(host: str) -> list[dict[str, object]]:
    """The shim's ``registries`` entries that serve critest's upstream names from ``host``."""
    return [{"prefix": upstream, "location": host} for upstream in UPSTREAM]


def push_all(registry: str, work: Path) -> list[str]:
    """Build and push every look-alike to ``registry`` (host:port); returns the references pushed."""
    layout = Layout(work / "layout")
    binary = build_lookalike(work)
    tools = [file("bin/lookalike", binary, 0o755), *(symlink(t, "lookalike") for t in TOOLS)]
    # applets as hard links, as in the upstream busybox image: a masked path (MaskedPaths: /bin/ls)
    # must hide that applet only, not the busybox binary a symlink would resolve to; each header
    # carries busybox's mode, as tar writes it (containerd applies a hard link's mode to the file)
    applet_links = [hardlink(f"bin/{a}", "bin/busybox", 0o755) for a in applets() if a != "busybox"]
    base = layout.layer(busybox_entries(()) + applet_links + tools)
    users = layout.layer([file("etc/passwd", PASSWD), file("etc/group", GROUP)])
    pushed = []
    for repo, (tags, user, salt) in IMAGES.items():
        layers = [base, users, layout.layer([file("etc/image-name", f"{repo}\n".encode())])]
        cmd: tuple[str, ...] = ("/bin/sh",)
        if repo == "pause":  # a sandbox image runs for the pod's life (containerd's sandbox_image)
            cmd = ("/bin/sleep", "2147483647")
        if repo in PROGRAMS:
            path, mode, cmd = PROGRAMS[repo]
            layers.append(layout.layer(program_entries(path, mode, binary)))
        desc = layout.image(layers, user=user, cmd=cmd, salt=salt)
        for tag in dict.fromkeys((*tags, "latest")):
            name = f"{salt}-{tag}"
            layout.tag(name, desc)
            ref = f"{registry}/{repo}:{tag}"
            push(layout, name, ref)
            pushed.append(ref)
    return pushed


def main() -> None:
    parser = argparse.ArgumentParser(description="Push critest look-alike images to a local registry.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--registry", help="host:port of a registry that accepts plain-HTTP pushes")
    where.add_argument("--start-registry", metavar="DIR", help="start docker-registry with storage in DIR, leave it up")
    args = parser.parse_args()
    registry: Registry | None = None
    host = args.registry
    if args.start_registry:
        registry = Registry(Path(args.start_registry)).start()
        host = registry.host
    try:
        with tempfile.TemporaryDirectory(prefix="critest-images-") as tmp:
            refs = push_all(host, Path(tmp))
    except BaseException:  # failed or interrupted: the registry is left up only for a caller told of it
        if registry is not None:
            registry.stop()
        raise
    out: dict[str, object] = {"registry": host, "pushed": len(refs), "registries": registries_config(host)}
    if registry is not None and registry.process is not None:
        out["registry_pid"] = registry.process.pid
        out["registry_log"] = str(registry.log_path)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(interrupts.run_main(main))
