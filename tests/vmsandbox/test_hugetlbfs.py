"""vmsandbox.hugetlbfs: hugetlbfs mounts found in mountinfo, and where declared pages are mounted."""

from __future__ import annotations

import pytest

from vmsandbox.hugetlbfs import default_mountpoint, mount_pagesize, pagesize_option
from vmsandbox.oci_spec import ContainerRequest, ImageConfig, Mount, UserIds, build_spec

MOUNTINFO = """\
22 1 0:21 / / rw,relatime - ext4 /dev/vda1 rw
30 22 0:25 / /dev/hugepages rw,relatime shared:12 - hugetlbfs hugetlbfs rw,pagesize=2M
31 22 0:26 / /mnt/huge\\0401g rw,relatime - hugetlbfs nodev rw,pagesize=1024M
32 22 0:27 / /var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/hp rw - hugetlbfs nodev rw,pagesize=2M
33 32 0:28 / /var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/hp/inner rw - tmpfs tmpfs rw
34 22 0:29 / /mnt/noopt rw - hugetlbfs nodev rw
"""


@pytest.mark.parametrize(
    ("path", "pagesize"),
    [
        ("/dev/hugepages", "2M"),
        ("/dev/hugepages/file", "2M"),
        ("/dev/hugepagesX", None),
        ("/mnt/huge 1g/x", "1G"),
        ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/hp", "2M"),
        ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/hp/inner/f", None),  # the deeper mount wins
        ("/mnt/noopt", "2M"),  # the kernel's default page size
        ("/etc/hosts", None),
    ],
)
def test_mount_pagesize(path: str, pagesize: str | None) -> None:
    assert mount_pagesize(MOUNTINFO, path) == pagesize


@pytest.mark.parametrize(("size", "text"), [(2 << 20, "2M"), (1 << 30, "1G"), (32 << 20, "32M"), (2 << 30, "2G")])
def test_pagesize_option(size: int, text: str) -> None:
    assert pagesize_option(size) == text


@pytest.mark.parametrize(
    ("sizes", "where"),
    [
        ([], {}),
        ([2 << 20], {2 << 20: "/dev/hugepages"}),
        ([1 << 30, 2 << 20], {2 << 20: "/dev/hugepages-2M", 1 << 30: "/dev/hugepages-1G"}),
    ],
)
def test_default_mountpoint(sizes: list[int], where: dict[int, str]) -> None:
    assert default_mountpoint(sizes) == where


def test_a_hugepage_mount_becomes_hugetlbfs_in_the_spec() -> None:
    request = ContainerRequest(
        command=("true",), mounts=(Mount("/hp", "nodev", hugepage_size="2M"), Mount("/data", "/run/x", True))
    )
    mounts = {m["destination"]: m for m in build_spec(request, ImageConfig(), UserIds(0, 0))["mounts"]}  # type: ignore[attr-defined]
    assert mounts["/hp"] == {
        "destination": "/hp",
        "type": "hugetlbfs",
        "source": "nodev",
        "options": ["nosuid", "nodev", "pagesize=2M", "rw"],
    }
    assert mounts["/data"]["type"] == "bind"
