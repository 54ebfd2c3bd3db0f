"""registries.conf-style configuration: validation, endpoint order, loopback; skopeo error kinds; credentials."""

from __future__ import annotations

import base64

import pytest

from vmsandbox.adapters.skopeo import _cause, classify
from vmsandbox.errors import (
    CannotFit,
    InfrastructureError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from vmsandbox.image_ref import parse_reference
from vmsandbox.registries import Credentials, Endpoint, is_loopback, parse_registries

CONF = parse_registries(
    [
        {"prefix": "docker.io", "mirrors": [{"location": "mirror.local:5000"}, {"location": "m2.local/dockerhub"}]},
        {"prefix": "docker.io/library", "mirrors": [{"location": "lib-mirror.local", "insecure": True}]},
        {"prefix": "quay.io/org", "location": "internal.example.com/quay-org", "insecure": True},
        {"prefix": "evil.io", "blocked": True},
    ]
)


@pytest.mark.parametrize(
    ("ref", "want"),
    [
        (
            "busybox",
            [Endpoint("lib-mirror.local/busybox", True, True), Endpoint("docker.io/library/busybox", False, False)],
        ),
        (
            "user/app",
            [
                Endpoint("mirror.local:5000/user/app", False, True),
                Endpoint("m2.local/dockerhub/user/app", False, True),
                Endpoint("docker.io/user/app", False, False),
            ],
        ),
        ("quay.io/org/x", [Endpoint("internal.example.com/quay-org/x", True, False)]),
        ("quay.io/orgx/y", [Endpoint("quay.io/orgx/y", False, False)]),
        ("127.0.0.1:5000/a", [Endpoint("127.0.0.1:5000/a", True, False)]),
        ("localhost/a", [Endpoint("localhost/a", True, False)]),
        ("example.com/a", [Endpoint("example.com/a", False, False)]),
    ],
)
def test_endpoints(ref: str, want: list[Endpoint]) -> None:
    from vmsandbox.registries import endpoints

    assert list(endpoints(parse_reference(ref), CONF)) == want


def test_blocked_prefix_is_permission_denied() -> None:
    from vmsandbox.registries import endpoints

    with pytest.raises(PermissionDenied, match="blocked"):
        endpoints(parse_reference("evil.io/x"), CONF)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ("x", "must be a list"),
        ([1], "must be a mapping"),
        ([{"prefix": "a.io", "color": "red"}], "unknown key"),
        ([{"prefix": "a.io/"}], "not host"),
        ([{"prefix": "a.io"}, {"prefix": "a.io"}], "twice"),
        ([{"prefix": "a.io", "insecure": "yes"}], "true or false"),
        ([{"prefix": "a.io", "mirrors": "m"}], "must be a list"),
        ([{"prefix": "a.io", "mirrors": [{"location": "m", "x": 1}]}], "mapping of location"),
        ([{"prefix": "a b"}], "not host"),
    ],
)
def test_bad_configuration(data: object, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        parse_registries(data)


@pytest.mark.parametrize(
    ("host", "want"),
    [
        ("localhost", True),
        ("localhost:5000", True),
        ("127.0.0.1:5000", True),
        ("127.1.2.3", True),
        ("[::1]:5000", True),
        ("128.0.0.1", False),
        ("docker.io", False),
        ("localhost.example.com", False),
    ],
)
def test_loopback(host: str, want: bool) -> None:
    assert is_loopback(host) is want


@pytest.mark.parametrize(
    ("stderr", "kind"),
    [
        ('level=fatal msg="reading manifest x: manifest unknown: manifest unknown"', NotFound),
        ("unauthorized: authentication required", Unauthenticated),
        ("reading manifest: unauthorized: incorrect username or password", Unauthenticated),
        ("denied: requested access to the resource is denied", PermissionDenied),
        (
            'pinging container registry h: Get "http://h/v2/": dial tcp 127.0.0.1:1: connect: connection refused',
            InfrastructureError,
        ),
        ("writing blob: write /x: no space left on device", CannotFit),
        ("something never seen", InfrastructureError),
    ],
)
def test_classify(stderr: str, kind: type) -> None:
    assert classify(stderr) is kind


def test_cause_is_the_last_message_bounded() -> None:
    assert _cause('time="t" level=fatal msg="reading \\"x\\": manifest unknown"\n') == 'reading "x": manifest unknown'
    assert len(_cause("x" * 5000)) <= 301
    wrapped = (
        'level=fatal msg="Error parsing image name \\"docker://h/x:1\\": reading manifest 1 in h/x: manifest unknown"'
    )
    assert _cause(wrapped) == "reading manifest 1 in h/x: manifest unknown"


def test_credentials_never_show_secrets() -> None:
    c = Credentials(username="u", password="hunter2", identity_token="tok")
    assert "hunter2" not in repr(c) and "tok" not in repr(c) and "hunter2" not in str(c)
    assert base64.b64decode(c.auth_entry()["auth"]) == b"u:hunter2"
    assert c.auth_entry()["identitytoken"] == "tok"
    assert Credentials(auth="dTpw").auth_entry() == {"auth": "dTpw"}
    assert Credentials().auth_entry() == {}


def test_a_pulls_credentials_go_to_the_images_registry_only() -> None:
    from shim.image_fetch import creds_for as _creds_for
    from vmsandbox.registries import endpoints

    creds = Credentials(username="u", password="p")
    places = endpoints(parse_reference("busybox"), CONF)
    assert [_creds_for(parse_reference("busybox"), e, creds) for e in places] == [None, creds]
    rewritten = endpoints(parse_reference("quay.io/org/x"), CONF)
    assert _creds_for(parse_reference("quay.io/org/x"), rewritten[0], creds) is None


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"registries": "x"}, "must be a list"),
        ({"registries": [{"prefix": "a.io", "bogus": 1}]}, "unknown key"),
        ({"registry_auth_file": "auth.json"}, "absolute path"),
        ({"image_store_dir": "rel/dir"}, "absolute path"),
        ({"image_max_bytes": 0}, "positive integer"),
        ({"image_max_entries": True}, "positive integer"),
    ],
)
def test_shim_config_image_keys_are_checked(data: dict[str, object], says: str) -> None:
    from shim.config import config_from_mapping

    with pytest.raises(InvalidArgument, match=says):
        config_from_mapping(data, "config.yaml")


def test_shim_config_image_keys() -> None:
    from shim.config import config_from_mapping

    config = config_from_mapping(
        {
            "registries": [{"prefix": "docker.io", "mirrors": [{"location": "m.local:5000", "insecure": True}]}],
            "registry_auth_file": "/etc/vmsandbox/auth.json",
            "image_max_bytes": 1 << 30,
            "image_max_entries": 1000,
        },
        "config.yaml",
    )
    assert config.registries.entries[0].mirrors[0].location == "m.local:5000"
    assert (config.registry_auth_file, config.image_max_bytes, config.image_max_entries) == (
        "/etc/vmsandbox/auth.json",
        1 << 30,
        1000,
    )
