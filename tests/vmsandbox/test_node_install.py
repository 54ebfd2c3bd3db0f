"""vmsandbox/node_install.py: containerd's main configuration made to import the drop-in, the
profiles on the installed guest image, the install record read back, the layout's checks."""

from __future__ import annotations

import json
import tomllib

import pytest
import yaml

from vmsandbox.adapters.node_host import profiles_for_node
from vmsandbox.errors import InvalidArgument
from vmsandbox.node_install import (
    DEFAULT_IMAGE_DIR,
    RUNTIME_LABEL,
    InstallRecord,
    NodeLayout,
    config_with_import,
    first_missing,
    label_patch,
    launchers_for,
    record_from_json,
)

DROP_IN = "/etc/containerd/conf.d/vmsandbox.toml"


@pytest.mark.parametrize(
    ("before", "imports"),
    [
        (None, [DROP_IN]),  # no file: containerd reads no configuration at all
        ("version = 3\n[grpc]\n  address = '/run/c.sock'\n", [DROP_IN]),
        ("version = 3\nimports = ['/etc/other/*.toml']\n[grpc]\n", ["/etc/other/*.toml", DROP_IN]),
        ("version = 3\nimports = []  # none\n", [DROP_IN]),
        ("# comment only", [DROP_IN]),
        ("", [DROP_IN]),
    ],
)
def test_the_configuration_imports_the_drop_in(before: str | None, imports: list[str]) -> None:
    after = config_with_import(before, DROP_IN)
    assert after is not None
    parsed = tomllib.loads(after)
    assert parsed["imports"] == imports
    if before:
        # everything else kept as it was, the tables in place
        assert tomllib.loads(before) | {"imports": imports} == parsed


@pytest.mark.parametrize(
    "before",
    [
        "version = 3\nimports = ['/etc/containerd/conf.d/*.toml']\n",
        f"version = 3\nimports = ['/x/*.toml', '{DROP_IN}']\n",
        "version = 3\nimports = ['/etc/containerd/*/*.toml']\n",
    ],
)
def test_a_configuration_that_imports_it_already_is_left_alone(before: str) -> None:
    assert config_with_import(before, DROP_IN) is None


@pytest.mark.parametrize(
    ("before", "message"),
    [
        ("version = 3\n[grpc\n", "not TOML"),
        ("version = 3\nimports = [\n  '/a/*.toml',\n]\n", "spans several lines"),
        ("version = 3\nimports = 'x'\n", "not a list"),
        ("version = 1\n", "version 1"),
    ],
)
def test_a_configuration_it_cannot_change_safely_is_refused(before: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        config_with_import(before, DROP_IN)


def test_profiles_boot_the_installed_image_unless_they_name_another() -> None:
    text = yaml.safe_dump_all(
        [
            {"name": "a", "handler": "a", "guest": {"image_dir": DEFAULT_IMAGE_DIR + "/"}},
            {"name": "b", "handler": "b"},
            {"name": "c", "handler": "c", "guest": {"image_dir": "/srv/other", "boot_timeout_s": 9}},
        ]
    )
    docs = list(yaml.safe_load_all(profiles_for_node(text, "/opt/vmsandbox/images/default")))
    assert [d["guest"]["image_dir"] for d in docs] == [
        "/opt/vmsandbox/images/default",
        "/opt/vmsandbox/images/default",
        "/srv/other",
    ]
    assert docs[2]["guest"]["boot_timeout_s"] == 9


def test_the_default_profiles_all_boot_the_installed_image() -> None:
    from tests.cli.vmsandbox_cmd import DEPLOY

    docs = list(yaml.safe_load_all(profiles_for_node((DEPLOY / "profiles.yaml").read_text(), "/p/images/default")))
    assert docs and {d["guest"]["image_dir"] for d in docs} == {"/p/images/default"}


@pytest.mark.parametrize(
    ("path", "there", "made"),
    [
        ("/var/lib/vmsandbox/state", ["/", "/var", "/var/lib"], "/var/lib/vmsandbox"),
        ("/var/lib/vmsandbox/state", ["/", "/var", "/var/lib", "/var/lib/vmsandbox"], "/var/lib/vmsandbox/state"),
        ("/run/x", ["/", "/run", "/run/x"], None),
    ],
)
def test_first_missing(path: str, there: list[str], made: str | None) -> None:
    assert first_missing(path, there) == made


def test_the_record_reads_back() -> None:
    record = InstallRecord(
        NodeLayout(prefix="/opt/v"),
        ("/var/lib/vmsandbox", "/run/vmsandbox"),
        True,
        True,
        0o640,
        launchers_for(["vmsandbox", "fast"]),
        True,
    )
    assert record.launchers == ("containerd-shim-vmsandbox-v1", "containerd-shim-vmsandbox-fast-v1")
    assert record_from_json(record.to_json()) == record


def test_a_record_from_before_the_launchers_per_handler_names_the_one_link() -> None:
    data = json.loads(InstallRecord(NodeLayout()).to_json())
    del data["launchers"], data["shim_dir_file"]
    record = record_from_json(json.dumps(data))
    assert (record.launchers, record.shim_dir_file) == (("containerd-shim-vmsandbox-v1",), False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "version 1"),
        ({"made_dirs": ["relative"]}, "absolute"),
        ({"made_dirs": ["/var"]}, "top-level"),
        ({"config_mode": True}, "file mode"),
        ({"config_changed": "yes"}, "true or false"),
        ({"prefix": "/"}, "root"),
        ({"drop_in": "/etc/containerd/conf.d/x.conf"}, ".toml"),
        ({"launchers": ["../../etc/passwd"]}, "no runtime handler is named"),
        ({"launchers": "containerd-shim-vmsandbox-v1"}, "list of names"),
        ({"shim_dir_file": 1}, "true or false"),
    ],
)
def test_a_bad_record_is_refused(change: dict[str, object], message: str) -> None:
    data = json.loads(InstallRecord(NodeLayout()).to_json()) | change
    with pytest.raises(InvalidArgument, match=message):
        record_from_json(json.dumps(data))


def test_label_patch() -> None:
    assert json.loads(label_patch(True)) == {"metadata": {"labels": {RUNTIME_LABEL: "true"}}}
    assert json.loads(label_patch(False)) == {"metadata": {"labels": {RUNTIME_LABEL: None}}}
