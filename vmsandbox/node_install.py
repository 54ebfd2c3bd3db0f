"""What a node install of shim mode changes on a host, and how it is undone (``vmsandbox node
install|uninstall``, run by the DaemonSet of ``deploy/install/``; docs/containerd-shim.md): where
the installed files go under the install prefix, containerd's main configuration made to import
the drop-in (``config_with_import``), the default profiles pointed at the installed guest image,
the record of what the install made (``InstallRecord``) that the uninstall reads back, and the
node label's patch. Pure: the files are read and written by ``vmsandbox/adapters/node_host.py``."""

from __future__ import annotations

import fnmatch
import json
import posixpath
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vmsandbox import validation
from vmsandbox.containerd_config import LAUNCHER, SHIM_DIR_FILE, handler_of_launcher, launcher_name
from vmsandbox.errors import InvalidArgument

RUNTIME_LABEL = "vmsandbox.dev/runtime"
"""The label the RuntimeClasses of deploy/runtimeclass.yaml schedule their pods by."""
DEFAULT_IMAGE_DIR = "/var/lib/vmsandbox/images/default"
"""The guest image a profile boots when it names none (``vmsandbox/profile.py``)."""
RECORD_LIMIT = 1 << 20
"""The largest install record read back (bytes)."""


@dataclass(frozen=True)
class NodeLayout:
    """Where an install puts its files: everything of its own under ``prefix``; on the host,
    containerd's main configuration, the drop-in, and each handler's launcher link in a directory
    on containerd's ``PATH``, with the shim directory's file beside them."""

    prefix: str = "/opt/vmsandbox"
    containerd_config: str = "/etc/containerd/config.toml"
    drop_in: str = "/etc/containerd/conf.d/vmsandbox.toml"
    launcher_dir: str = "/usr/local/bin"

    def __post_init__(self) -> None:
        for field, value in (
            ("prefix", self.prefix),
            ("containerd config", self.containerd_config),
            ("drop-in", self.drop_in),
            ("launcher directory", self.launcher_dir),
        ):
            validation.absolute_path(value, field)
            if posixpath.normpath(value) in ("/", "//"):
                raise InvalidArgument(f"{field}: not the root directory")
        if not self.drop_in.endswith(".toml"):
            raise InvalidArgument(f"drop-in {self.drop_in!r}: not a .toml file")

    @property
    def venv(self) -> str:
        return posixpath.join(self.prefix, "venv")

    @property
    def etc(self) -> str:
        return posixpath.join(self.prefix, "etc")

    @property
    def config(self) -> str:
        """The daemon's configuration (the ConfigMap's ``config.yaml``, copied)."""
        return posixpath.join(self.etc, "config.yaml")

    @property
    def profiles(self) -> str:
        """The installed profiles (``profiles_on_image`` of the image's)."""
        return posixpath.join(self.etc, "profiles.yaml")

    @property
    def payload(self) -> str:
        """What the installer's image brought: wheels, guest image, default profiles."""
        return posixpath.join(self.prefix, "payload")

    @property
    def image_dir(self) -> str:
        return posixpath.join(self.prefix, "images", "default")

    @property
    def launcher(self) -> str:
        return posixpath.join(self.venv, "bin", LAUNCHER)

    def launcher_link(self, name: str) -> str:
        """Where the launcher called ``name`` (``containerd_config.launcher_name``) is linked."""
        return posixpath.join(self.launcher_dir, name)

    @property
    def shim_dir_file(self) -> str:
        """The file beside the launchers' links naming the daemon's shim directory."""
        return posixpath.join(self.launcher_dir, SHIM_DIR_FILE)

    @property
    def record(self) -> str:
        return posixpath.join(self.prefix, "install-record.json")

    @property
    def config_backup(self) -> str:
        """containerd's main configuration as it was before the install, byte for byte."""
        return posixpath.join(self.prefix, "backup", "containerd-config.toml")


@dataclass(frozen=True)
class InstallRecord:
    """What an install made or changed, written before it changes anything and read back by the
    uninstall: the directories it made (removed with what is in them), whether containerd's main
    configuration existed and was changed (then its backup and mode are kept), the drop-in, the
    launchers' links (by name: one per handler) and whether the shim directory's file was written.
    A record without ``launchers`` (an install from before the launchers were per handler) names
    the one link ``containerd-shim-vmsandbox-v1``, and no shim directory's file."""

    layout: NodeLayout
    made_dirs: tuple[str, ...] = ()
    config_existed: bool = True
    config_changed: bool = False
    config_mode: int = 0o644
    launchers: tuple[str, ...] = (LAUNCHER,)
    shim_dir_file: bool = False

    def __post_init__(self) -> None:
        for name in self.launchers:
            handler_of_launcher(name)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": 1,
                "prefix": self.layout.prefix,
                "containerd_config": self.layout.containerd_config,
                "drop_in": self.layout.drop_in,
                "launcher_dir": self.layout.launcher_dir,
                "made_dirs": list(self.made_dirs),
                "config_existed": self.config_existed,
                "config_changed": self.config_changed,
                "config_mode": self.config_mode,
                "launchers": list(self.launchers),
                "shim_dir_file": self.shim_dir_file,
            },
            indent=1,
        )


def record_from_json(text: str) -> InstallRecord:
    """The record an install wrote; every field checked (it names what the uninstall removes)."""
    if len(text) > RECORD_LIMIT:
        raise InvalidArgument(f"install record: more than {RECORD_LIMIT} bytes")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"install record: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("version") != 1:
        raise InvalidArgument("install record: not a version 1 record")

    def string(key: str) -> str:
        value = data.get(key)
        if not isinstance(value, str):
            raise InvalidArgument(f"install record: {key} is not a string")
        return value

    def flag(key: str) -> bool:
        value = data.get(key)
        if not isinstance(value, bool):
            raise InvalidArgument(f"install record: {key} is not true or false")
        return value

    layout = NodeLayout(string("prefix"), string("containerd_config"), string("drop_in"), string("launcher_dir"))
    dirs = data.get("made_dirs")
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise InvalidArgument("install record: made_dirs is not a list of paths")
    for d in dirs:
        validation.absolute_path(d, "install record: made_dirs")
        if posixpath.normpath(d).count("/") < 2:
            raise InvalidArgument(f"install record: made_dirs: {d!r} is a top-level directory")
    mode = data.get("config_mode")
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
        raise InvalidArgument("install record: config_mode is not a file mode")
    launchers = data.get("launchers", [LAUNCHER])
    if not isinstance(launchers, list) or not all(isinstance(n, str) for n in launchers):
        raise InvalidArgument("install record: launchers is not a list of names")
    shim_dir_file = data.get("shim_dir_file", False)
    if not isinstance(shim_dir_file, bool):
        raise InvalidArgument("install record: shim_dir_file is not true or false")
    return InstallRecord(
        layout,
        tuple(dirs),
        flag("config_existed"),
        flag("config_changed"),
        mode,
        tuple(launchers),
        shim_dir_file,
    )


def launchers_for(handlers: Iterable[str]) -> tuple[str, ...]:
    """The launchers' names an install links for ``handlers`` (one each)."""
    return tuple(launcher_name(h) for h in handlers)


def first_missing(path: str, exists: Iterable[str]) -> str | None:
    """The topmost directory of ``path`` (itself included) not among ``exists`` (the directories
    that are there, from ``/`` down): what making ``path`` would make first, removed with
    everything below it at the uninstall; None when ``path`` is there."""
    there = set(exists)
    parts = posixpath.normpath(path).strip("/").split("/")
    for n in range(1, len(parts) + 1):
        candidate = "/" + "/".join(parts[:n])
        if candidate not in there:
            return candidate
    return None


def config_with_import(text: str | None, drop_in: str) -> str | None:
    """containerd's main configuration (``text``; None when the file does not exist, and containerd
    then reads no configuration at all) made to import ``drop_in``; None when an ``imports`` entry
    (a glob, relative ones against the file's directory) already matches it. A one-line top-level
    ``imports`` array gets the drop-in appended; a file without ``imports`` gets the line before
    its first table; a file that is not TOML, or an ``imports`` written over several lines, is
    refused (the admin adds the drop-in's directory there)."""
    line = f"imports = ['{drop_in}']"
    if text is None:
        return f"version = 3\n{line}\n"
    try:
        parsed = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"containerd's configuration is not TOML: {e}") from None
    imports = parsed.get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise InvalidArgument("containerd's configuration: imports is not a list of paths")
    if any(fnmatch.fnmatchcase(drop_in, i) for i in imports if i.startswith("/")):
        return None
    if isinstance(parsed.get("version"), int) and parsed["version"] < 2:
        raise InvalidArgument("containerd's configuration is version 1: shim mode needs containerd 2 (version 3)")
    lines = text.splitlines(keepends=True)
    first_table = next((n for n, ln in enumerate(lines) if ln.lstrip().startswith("[")), len(lines))
    for n, ln in enumerate(lines[:first_table]):
        m = re.fullmatch(r"(\s*imports\s*=\s*\[)(.*)\](\s*(#.*)?)", ln.rstrip("\n"))
        if m:
            inner = m.group(2).strip().rstrip(",").strip()
            entries = f"{inner}, '{drop_in}'" if inner else f"'{drop_in}'"
            lines[n] = f"{m.group(1)}{entries}]{m.group(3)}" + ("\n" if ln.endswith("\n") else "")
            return "".join(lines)
        if re.match(r"^\s*imports\s*=", ln):
            raise InvalidArgument(
                "containerd's configuration: its imports array spans several lines; "
                f"add {drop_in!r} (or its directory's *.toml) to it"
            )
    head = "".join(lines[:first_table])
    if head and not head.endswith("\n"):
        head += "\n"
    return head + line + "\n" + "".join(lines[first_table:])


PROFILES_HEADER = (
    "# Installed by the vmsandbox installer (deploy/install/): the default profiles, on its guest image.\n"
)


def profiles_on_image(docs: Sequence[object], image_dir: str) -> list[dict[str, Any]]:
    """The default profiles (one document each, as parsed) with the guest image the install
    brought: a profile that names the default image, or none, boots ``image_dir``; one that names
    another keeps it."""
    validation.absolute_path(image_dir, "guest image directory")
    out: list[dict[str, Any]] = []
    for doc in docs:
        if doc is None:
            continue
        if not isinstance(doc, Mapping):
            raise InvalidArgument("profiles: a document is not a mapping")
        profile = dict(doc)
        guest = profile.get("guest") or {}
        if not isinstance(guest, Mapping):
            raise InvalidArgument(f"profile {profile.get('name')!r}: guest is not a mapping")
        guest = dict(guest)
        if guest.get("image_dir", DEFAULT_IMAGE_DIR).rstrip("/") == DEFAULT_IMAGE_DIR:
            guest["image_dir"] = image_dir
        profile["guest"] = guest
        out.append(profile)
    return out


def label_patch(present: bool) -> bytes:
    """The JSON merge patch of a Node that sets (or removes) ``RUNTIME_LABEL``."""
    return json.dumps({"metadata": {"labels": {RUNTIME_LABEL: "true" if present else None}}}).encode()
