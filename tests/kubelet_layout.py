"""Volumes laid out on the host as the kubelet lays them out, for tests.

``write_volume`` follows the kubelet's atomic writer step for step: the payload goes into a new
``..<timestamp>.<random>`` directory (mode and owners as the kubelet sets them: ``mode`` per
file, the group ``fs_group`` with group-read and a setgid directory when one is given), a
``..data_tmp`` symlink to it is renamed over ``..data``, every user-visible name is a symlink
``<name> -> ..data/<name>``, names the new payload lacks are unlinked, and the old version goes.
Calling it again with new content is what the kubelet does on a ConfigMap update or a token
rotation.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

PODS = "volumes"


def volume_dir(pods_dir: Path, pod_uid: str, plugin: str, name: str) -> Path:
    """``<pods_dir>/<uid>/volumes/kubernetes.io~<plugin>/<name>``, made if missing."""
    path = pods_dir / pod_uid / PODS / f"kubernetes.io~{plugin}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_volume(volume: Path, files: dict[str, bytes], mode: int = 0o644, fs_group: int | None = None) -> str:
    """Write ``files`` (relative path -> content) as the volume's new version; returns its name."""
    old = os.readlink(volume / "..data") if (volume / "..data").is_symlink() else ""
    version = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + str(secrets.randbelow(10**10))
    top = volume / version
    top.mkdir(mode=0o755)
    for rel, data in files.items():
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        path.write_bytes(data)
        os.chmod(path, mode)
    if fs_group is not None:  # the kubelet's SetVolumeOwnership: group fs_group, g+r, setgid directories
        for dirpath, _, filenames in os.walk(volume):
            os.chown(dirpath, -1, fs_group)
            os.chmod(dirpath, os.stat(dirpath).st_mode | 0o2070)
            for f in filenames:
                p = os.path.join(dirpath, f)
                os.chown(p, -1, fs_group, follow_symlinks=False)
                if not os.path.islink(p):
                    os.chmod(p, os.stat(p).st_mode | 0o040)
    tmp = volume / "..data_tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(version, tmp)
    os.rename(tmp, volume / "..data")
    names = {rel.split("/", 1)[0] for rel in files}
    for name in names:
        link = volume / name
        if not link.is_symlink():
            os.symlink(f"..data/{name}", link)
    for entry in volume.iterdir():
        if entry.is_symlink() and entry.name not in names and os.readlink(entry).startswith("..data/"):
            entry.unlink()
    if old:
        for dirpath, dirnames, filenames in os.walk(volume / old, topdown=False):
            for f in filenames:
                os.unlink(os.path.join(dirpath, f))
            for d in dirnames:
                os.rmdir(os.path.join(dirpath, d))
        os.rmdir(volume / old)
    return version
