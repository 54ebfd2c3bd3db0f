"""Push look-alikes of critest's test images to a local registry, so its image specs run offline.

critest (cri-tools) asks for ``gcr.io/k8s-staging-cri-tools/test-image-*``,
``registry.k8s.io/e2e-test-images/busybox:1.29-2``, ``registry.k8s.io/pause:3.9`` and
``k8s.gcr.io/pause:3.9``; with ``--registry-prefix HOST:PORT`` it pulls ``HOST:PORT/<path>``
instead. This builds images with the properties its specs check — distinct images for
``test-image-1..3``, one image under three ``test-image-tags`` tags, ``User`` set to a uid, a
username, ``uid:group`` and ``name:group`` — from the host's busybox-static, and pushes each under
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
import tempfile
from pathlib import Path

from tests.registry_kit import Layout, Registry, busybox_entries, file, push

STAGING = "k8s-staging-cri-tools"
E2E = "e2e-test-images"
PASSWD = (
    b"root:x:0:0:root:/root:/bin/sh\n"
    b"www-data:x:33:33:www-data:/var/www:/bin/false\n"
    b"user:x:1000:50000:user:/home/user:/bin/sh\n"
    b"nobody:x:65534:65534:nobody:/:/bin/false\n"
)
GROUP = b"root:x:0:\nwww-data:x:33:\ngroup1:x:50000:\nnogroup:x:65534:\n"

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
    f"{STAGING}/hostnet-nginx-amd64": (("latest",), "", "hostnet-nginx"),
    "pause": (("3.9", "3.10", "latest"), "", "pause"),
}
UPSTREAM = ("gcr.io", "registry.k8s.io", "k8s.gcr.io")


def registries_config(host: str) -> list[dict[str, object]]:
    """The shim's ``registries`` entries that serve critest's upstream names from ``host``."""
    return [{"prefix": upstream, "location": host} for upstream in UPSTREAM]


def push_all(registry: str, work: Path) -> list[str]:
    """Build and push every look-alike to ``registry`` (host:port); returns the references pushed."""
    layout = Layout(work / "layout")
    base = layout.layer(busybox_entries(("sh", "ls", "cat", "echo", "sleep", "id", "top", "pgrep", "hostname")))
    users = layout.layer([file("etc/passwd", PASSWD), file("etc/group", GROUP)])
    pushed = []
    for repo, (tags, user, salt) in IMAGES.items():
        marker = layout.layer([file("etc/image-name", f"{repo}\n".encode())])
        desc = layout.image([base, users, marker], user=user, cmd=("/bin/sh",), salt=salt)
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
    with tempfile.TemporaryDirectory(prefix="critest-images-") as tmp:
        refs = push_all(host, Path(tmp))
    out: dict[str, object] = {"registry": host, "pushed": len(refs), "registries": registries_config(host)}
    if registry is not None and registry.process is not None:
        out["registry_pid"] = registry.process.pid
        out["registry_log"] = str(registry.log_path)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
