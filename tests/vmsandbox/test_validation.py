"""Kubernetes' name rules, our id rules, and how messages and log lines echo client strings."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim import logs, metrics, server
from shim.config import ShimConfig
from vmsandbox import validation as v
from vmsandbox.devices import vfio_group
from vmsandbox.errors import InvalidArgument, NotFound, VmSandboxError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs" / "one-node-2cpu"


def ok(check: object, value: str) -> None:
    check(value, "f")  # type: ignore[operator]


def bad(check: object, value: str) -> str:
    with pytest.raises(InvalidArgument) as err:
        check(value, "the.field")  # type: ignore[operator]
    message = str(err.value)
    assert message.startswith("the.field")
    return message


NAME_TABLE = [
    # (rule, value, valid)
    (v.dns1123_label, "web-1", True),
    (v.dns1123_label, "a" * 63, True),
    (v.dns1123_label, "a" * 64, False),
    (v.dns1123_label, "-web", False),
    (v.dns1123_label, "web-", False),
    (v.dns1123_label, "Web", False),
    (v.dns1123_label, "a.b", False),
    (v.dns1123_label, "web\n", False),
    (v.dns1123_label, "", False),
    (v.dns1123_subdomain, "web.shop-1.example", True),
    (v.dns1123_subdomain, ("a" * 63 + ".") * 3 + "a" * 61, True),
    (v.dns1123_subdomain, ("a" * 63 + ".") * 3 + "a" * 62, False),
    (v.dns1123_subdomain, "a..b", False),
    (v.dns1123_subdomain, ".a", False),
    (v.dns1123_subdomain, "a_b", False),
    (v.dns1123_subdomain, "we\x00b", False),
    (v.pod_name, "PodSandbox-with-attributes-6f1c2d3e", True),  # critest's capitals
    (v.pod_name, "web.shop-1", True),
    (v.pod_name, "web_1", False),
    (v.pod_name, "a..b", False),
    (v.pod_name, "x" * 254, False),
    (v.pod_name, "we\x00b", False),
    (v.container_name, "container-with-RunAsGroup-without-RunAsUser-test-" + "a" * 36, True),
    (v.container_name, "a.b", False),
    (v.container_name, "a_b", False),
    (v.container_name, "-a", False),
    (v.container_name, "a" * 254, False),
    (v.qualified_name, "app", True),
    (v.qualified_name, "app.kubernetes.io/name", True),
    (v.qualified_name, "Example.com/A_b.c-D", False),  # the prefix is a subdomain: lowercase
    (v.qualified_name, "example.com/A_b.c-D", True),
    (v.qualified_name, "a" * 63, True),
    (v.qualified_name, "a" * 64, False),
    (v.qualified_name, "/name", False),
    (v.qualified_name, "example.com/", False),
    (v.qualified_name, "a/b/c", False),
    (v.qualified_name, "_a", False),
    (v.qualified_name, "bad key", False),
    (v.label_value, "", True),
    (v.label_value, "v1.2_3-x", True),
    (v.label_value, "v" * 63, True),
    (v.label_value, "v" * 64, False),
    (v.label_value, "-v", False),
    (v.label_value, "a\nb", False),
    (v.uid, "0d3c8f9e-5b6a-4c1d-9e2f-3a4b5c6d7e8f", True),
    (v.uid, "5f1d2c3b4a59687706a5b4c3d2e1f0a9", True),  # a static pod's hash
    (v.uid, "u" * 129, False),
    (v.uid, "../x", False),
    (v.uid, "u id", False),
    (v.id_prefix, "ab" * 32, True),
    (v.id_prefix, "a", True),
    (v.id_prefix, "ab" * 32 + "a", False),
    (v.id_prefix, "AB", False),
    (v.id_prefix, "../x", False),
    (v.id_prefix, "", False),
    (v.absolute_path, "/var/log/pods/ns_name_uid", True),
    (v.absolute_path, "", True),
    (v.absolute_path, "var/log", False),
    (v.absolute_path, "/var/log/../../etc", False),
    (v.relative_file, "web/0.log", True),
    (v.relative_file, "../x", False),
    (v.relative_file, "a/../../x", False),
    (v.relative_file, "/x", False),
    (v.text, "busybox:1.36", True),
    (v.text, "a\x00b", False),
    (v.text, "a\ufffeb", False),
    (v.text, "x" * 5000, False),
]


@pytest.mark.parametrize(
    ("check", "value", "valid"),
    NAME_TABLE,
    ids=[f"{c.__name__}-{i}-{'ok' if good else 'bad'}" for i, (c, _, good) in enumerate(NAME_TABLE)],
)
def test_name_rules(check: object, value: str, valid: bool) -> None:
    if valid:
        ok(check, value)
    else:
        message = bad(check, value)
        assert len(message) < 600
        assert not any(v.unsafe(ch) for ch in message)


def test_the_kubelets_pod_name_label_carries_a_pod_name() -> None:
    long_static_pod = "kube-apiserver-" + "node-1.rack-7.datacenter-west.example.internal" * 2  # > 63
    v.label_map({"io.kubernetes.pod.name": long_static_pod, "io.kubernetes.pod.namespace": "kube-system"}, "f")
    with pytest.raises(InvalidArgument):
        v.label_map({"app": long_static_pod}, "f")
    with pytest.raises(InvalidArgument):
        v.label_map({"io.kubernetes.pod.name": "Web_1"}, "f")


def test_annotations_total_size() -> None:
    v.annotation_map({"a": "x" * (256 * 1024 - 1)}, "f")
    with pytest.raises(InvalidArgument, match="more than the 262144 allowed"):
        v.annotation_map({"a": "x" * (256 * 1024)}, "f")


@pytest.mark.parametrize(
    ("prefix", "found"),
    [
        ("abcd", "abcd" + "0" * 60),
        ("ab" * 32, "ab" * 32),  # an exact id wins even when it prefixes nothing else
        ("c", "c" * 64),
    ],
)
def test_resolve_prefix(prefix: str, found: str) -> None:
    assert v.resolve_prefix(prefix, ["ab" * 32, "abcd" + "0" * 60, "c" * 64], "pod sandbox") == found


def test_resolve_prefix_ambiguous_and_unknown() -> None:
    known = ["ab" * 32, "abcd" + "0" * 60]
    with pytest.raises(InvalidArgument, match="ambiguous: it matches 2"):
        v.resolve_prefix("ab", known, "pod sandbox")
    with pytest.raises(NotFound):
        v.resolve_prefix("ff", known, "pod sandbox")


def test_join_log_path() -> None:
    assert v.join_log_path("/var/log/pods/x", "web/0.log") == "/var/log/pods/x/web/0.log"
    assert v.join_log_path("/var/log/pods/x", "./web//0.log") == "/var/log/pods/x/web/0.log"
    assert v.join_log_path("", "web.log") == "web.log"
    assert v.join_log_path("/var/log/pods/x", "") == ""
    with pytest.raises(InvalidArgument, match=r"ContainerConfig\.log_path"):
        v.join_log_path("/var/log/pods/x", "web/../../y")


@given(st.text(max_size=300))
def test_escape_leaves_nothing_unsafe_and_is_reversible_in_length(text: str) -> None:
    out = v.escape(text)
    assert not any(v.unsafe(ch) for ch in out)
    assert "\n" not in out and "\r" not in out
    if not any(v.unsafe(ch) or ch == "\\" for ch in text):
        assert out == text


@given(st.text(max_size=20_000), st.integers(1, 200))
def test_quote_and_bound_are_bounded(text: str, limit: int) -> None:
    assert len(v.quote(text, limit)) <= 10 * limit + 40  # an escaped character takes at most 10
    assert len(v.bound(text, limit)) <= limit + 40


def test_vfio_group_takes_ascii_digits_only() -> None:
    assert vfio_group("/dev/vfio/12") == 12
    assert vfio_group("/dev/vfio/\u00b2") is None  # str.isdigit() says yes, int() refuses
    assert vfio_group("/dev/vfio/\u0661") is None


# -- log lines ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_client_string_cannot_forge_a_log_line(fmt: str) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.PodFilter())
    handler.setFormatter(logs.JsonFormatter() if fmt == "json" else logs.TextFormatter())
    log = logging.getLogger("test.vmsandbox.forge")
    log.addHandler(handler)
    log.propagate = False
    try:
        with logs.scope():
            logs.bind(pod="ns/web\n2026-01-01T00:00:00.000Z ERROR forged\u2028x")
            log.warning("name %s", "a\r\nERROR forged\x1b[2J\x85")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    assert not any(ch in text[:-1] for ch in "\r\x1b\x85\u2028")
    if fmt == "json":
        doc = json.loads(text)
        assert doc["msg"] == "name a\r\nERROR forged\x1b[2J\x85"
        assert doc["pod"].endswith("forged\u2028x")


# -- configuration and file modes --------------------------------------------------------------------
def test_metrics_port_alone_binds_loopback() -> None:
    assert metrics.parse_address(":9464") == ("127.0.0.1", 9464)
    assert metrics.parse_address("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert metrics.parse_address("[::1]:9464") == ("::1", 9464)
    with pytest.raises(InvalidArgument):
        metrics.parse_address(":\u0661\u0662")


def _config(tmp: Path, **kwargs: object) -> ShimConfig:
    return ShimConfig(
        socket_path=str(tmp / "run" / "cri.sock"),
        state_dir=str(tmp / "state"),
        console_dir=str(tmp / "console"),
        libvirt_uri="test:///default",
        sys_root=str(FIXTURE / "sys"),
        proc_root=str(FIXTURE / "proc"),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture
def passable_tmp() -> Iterator[Path]:
    """A temporary directory every user can pass through (pytest's own are below a 0700 one, and
    the shim refuses a state directory its QEMUs' uids cannot reach)."""
    d = Path(tempfile.mkdtemp(prefix="vmsandbox-unit-", dir="/var/tmp"))
    d.chmod(0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_state_dir_qemu_cannot_reach_is_refused_before_any_file_is_made(passable_tmp: Path) -> None:
    closed = passable_tmp / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0o700)
    config = _config(closed)
    with pytest.raises(InvalidArgument, match=f"directory {closed} \\(mode 0700\\) cannot be passed") as caught:
        server.start(config)
    assert f"chmod o+x {closed}'" in str(caught.value)
    assert list(closed.iterdir()) == []


@pytest.mark.parametrize(
    "bad_setting",
    [
        pytest.param({"socket_group": "no-such-group-vmsandbox"}, id="socket-group"),
        pytest.param({"metrics_address": "localhost"}, id="metrics-address"),
        pytest.param({"profile_files": ("/nonexistent/profiles.yaml",)}, id="profile-file"),
    ],
)
def test_bad_configuration_touches_no_file(tmp_path: Path, bad_setting: dict[str, str]) -> None:
    config = _config(tmp_path, **bad_setting)
    with pytest.raises(VmSandboxError):
        server.start(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no socket, no state, no console directory


def test_state_is_passable_only_and_console_owner_only(passable_tmp: Path) -> None:
    pytest.importorskip("libvirt")
    tmp_path = passable_tmp
    (tmp_path / "console").mkdir(mode=0o755)  # left by an older build
    os.chmod(tmp_path / "console", 0o755)
    old = os.umask(0o022)
    try:
        running = server.start(_config(tmp_path))
    finally:
        os.umask(old)
    try:
        modes = {
            p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
            for p in [tmp_path / "state", tmp_path / "console", *(tmp_path / "state").glob("state.db*")]
        }
        # state: others (each sandbox's QEMU uid) may pass through to their own directory, not list it
        assert modes["state"] == 0o711 and modes["console"] == 0o700
        assert modes["state/state.db"] == 0o600
        assert all(mode == 0o600 for name, mode in modes.items() if name.startswith("state/state.db")), modes
        assert stat.S_IMODE((tmp_path / "run" / "cri.sock").stat().st_mode) == 0o660
    finally:
        running.stop(grace=0)


@given(st.characters(codec=None) | st.sampled_from(["\ufffe", "\U0010ffff", "\ud800", "\x85", "\u2029", "\\"]))
def test_the_unsafe_class_is_the_unsafe_predicate(ch: str) -> None:
    assert (v.escape(ch) != ch) == (v.unsafe(ch) or ch == "\\")
    try:
        v.text(ch, "f")
        refused = False
    except InvalidArgument:
        refused = True
    assert refused == v.unsafe(ch)


@pytest.mark.parametrize(
    ("name", "full"),
    [
        ("ab" * 32, True),
        ("AB" * 32, False),
        ("ab" * 31, False),
        ("ab" * 32 + "0", False),
        ("g" * 64, False),
        ("", False),
    ],
)
def test_is_full_id(name: str, full: bool) -> None:
    assert v.is_full_id(name) is full
