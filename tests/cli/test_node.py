"""``vmsandbox node install|uninstall`` on a host made of temporary directories: what the install
writes (the drop-in, containerd's imports, the launchers' links and the shim directory's file, the
daemon's directories), a failed restart undone, and the uninstall putting every file back as it was, byte for byte; the
node's label patched with the service account's token, else the kubeconfig's credentials."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from cli import main as cli_main
from tests.cli.vmsandbox_cmd import DEPLOY
from vmsandbox.adapters import node_host
from vmsandbox.containerd_config import SHIM_DIR_FILE, launcher_name
from vmsandbox.errors import InfrastructureError

CONFIG = """version = 3
root = '/var/lib/containerd'
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'
"""


def tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its mode and content's hash (or link target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            if p.is_symlink():
                out[str(p)] = f"-> {os.readlink(p)}"
            elif p.is_dir():
                out[str(p)] = f"dir {st.st_mode & 0o7777:o}"
            else:
                out[str(p)] = f"{st.st_mode & 0o7777:o} {hashlib.sha256(p.read_bytes()).hexdigest()}"
    return out


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    host = tmp_path / "host"
    prefix = tmp_path / "opt" / "vmsandbox"
    (prefix / "payload").mkdir(parents=True)
    (prefix / "etc").mkdir()
    (prefix / "payload" / "profiles.yaml").write_text((DEPLOY / "profiles.yaml").read_text())
    (host / "containerd").mkdir(parents=True)
    (host / "bin").mkdir()
    (host / "containerd" / "config.toml").write_text(CONFIG)
    (host / "containerd" / "config.toml").chmod(0o640)
    (prefix / "etc" / "config.yaml").write_text(
        f"containerd_address: {host}/containerd/containerd.sock\n"
        f"containerd_shim_dir: {host}/run/vmsandbox/containerd\n"
        f"socket_path: {host}/run/vmsandbox/vmsandbox.sock\n"
        f"state_dir: {host}/lib/vmsandbox/state\n"
        f"console_dir: {host}/log/vmsandbox/console\n"
        "profile_files: [profiles.yaml]\n"
    )
    monkeypatch.setattr(node_host, "wait_cri", lambda address, timeout_s: "v2.4.2")
    return {"host": host, "prefix": prefix, "restarts": tmp_path / "restarts"}


def run(node: dict[str, Path], command: str, restart: str = "") -> int:
    restart = restart or f"echo restarted >> {node['restarts']}"
    argv = ["node", command, "--prefix", str(node["prefix"]), "--restart-command", restart]
    if command == "install":
        host = node["host"]
        argv += [
            "--containerd-config",
            f"{host}/containerd/config.toml",
            "--drop-in",
            f"{host}/containerd/vmsandbox.d/vmsandbox.toml",
            "--launcher-dir",
            f"{host}/bin",
        ]
    return cli_main.main(argv)


def test_install_then_uninstall_puts_the_host_back(node: dict[str, Path]) -> None:
    host = node["host"]
    before = tree(host)
    assert run(node, "install") == 0
    config = (host / "containerd" / "config.toml").read_text()
    assert tomllib.loads(config)["imports"] == [f"{host}/containerd/vmsandbox.d/vmsandbox.toml"]
    assert (host / "containerd" / "config.toml").stat().st_mode & 0o777 == 0o640
    drop_in = tomllib.loads((host / "containerd" / "vmsandbox.d" / "vmsandbox.toml").read_text())
    runtimes = drop_in["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert set(runtimes) == {
        "vmsandbox",
        "vmsandbox-medium",
        "vmsandbox-dedicated",
        "vmsandbox-hugepages",
        "vmsandbox-resizable",
    }
    assert "options" not in runtimes["vmsandbox"]
    # each handler's launcher, linked under the name its runtime type gives, the shim directory beside
    for handler in runtimes:
        link = host / "bin" / launcher_name(handler)
        assert os.readlink(link) == str(node["prefix"] / "venv" / "bin" / "containerd-shim-vmsandbox-v1")
    assert (host / "bin" / "containerd-shim-vmsandbox-v1").is_symlink()
    assert (host / "bin" / SHIM_DIR_FILE).read_text() == f"{host}/run/vmsandbox/containerd\n"
    for d in ("run/vmsandbox/containerd", "lib/vmsandbox/state", "log/vmsandbox/console"):
        assert (host / d).is_dir()
    assert "/images/default" in (node["prefix"] / "etc" / "profiles.yaml").read_text()
    assert node["restarts"].read_text() == "restarted\n"

    assert run(node, "uninstall") == 0
    assert tree(host) == before
    assert (host / "containerd" / "config.toml").read_text() == CONFIG
    assert node["restarts"].read_text() == "restarted\nrestarted\n"
    assert not (node["prefix"] / "install-record.json").exists()


def test_an_install_that_containerd_does_not_come_back_from_is_undone(node: dict[str, Path]) -> None:
    host = node["host"]
    before = tree(host)
    marker = node["restarts"]
    # the first restart fails; the one after the undo succeeds
    restart = f"if [ -e {marker} ]; then exit 0; fi; touch {marker}; echo no >&2; exit 1"
    with pytest.raises(InfrastructureError, match="install failed"):
        cli_main_install_raising(node, restart)
    assert tree(host) == before
    assert not (node["prefix"] / "install-record.json").exists()


def cli_main_install_raising(node: dict[str, Path], restart: str) -> None:
    from cli import node as node_cmd

    args = cli_main.build_parser().parse_args(
        [
            "node",
            "install",
            "--prefix",
            str(node["prefix"]),
            "--restart-command",
            restart,
            "--containerd-config",
            f"{node['host']}/containerd/config.toml",
            "--drop-in",
            f"{node['host']}/containerd/vmsandbox.d/vmsandbox.toml",
            "--launcher-dir",
            f"{node['host']}/bin",
        ]
    )
    node_cmd.install(args)


def test_a_second_install_undoes_the_first_one_first(node: dict[str, Path]) -> None:
    host = node["host"]
    before = tree(host)
    assert run(node, "install") == 0
    assert run(node, "install") == 0  # the installer's pod restarted without its uninstall
    assert tomllib.loads((host / "containerd" / "config.toml").read_text())["imports"] == [
        f"{host}/containerd/vmsandbox.d/vmsandbox.toml"
    ]
    assert run(node, "uninstall") == 0
    assert tree(host) == before


def test_a_drop_in_that_is_not_ours_is_not_replaced(node: dict[str, Path]) -> None:
    host = node["host"]
    (host / "containerd" / "vmsandbox.d").mkdir()
    (host / "containerd" / "vmsandbox.d" / "vmsandbox.toml").write_text("version = 3\n")
    assert run(node, "install") == 2
    assert (host / "containerd" / "config.toml").read_text() == CONFIG
    assert not node["restarts"].exists()


def test_a_shim_directory_file_that_is_not_ours_is_not_replaced(node: dict[str, Path]) -> None:
    host = node["host"]
    (host / "bin" / SHIM_DIR_FILE).write_text("/run/elsewhere\n")
    assert run(node, "install") == 2
    assert (host / "bin" / SHIM_DIR_FILE).read_text() == "/run/elsewhere\n"
    assert (host / "containerd" / "config.toml").read_text() == CONFIG
    assert not node["restarts"].exists()


def test_uninstall_without_an_install_does_nothing(node: dict[str, Path]) -> None:
    assert run(node, "uninstall") == 0
    assert not node["restarts"].exists()


class _ApiServer(http.server.BaseHTTPRequestHandler):
    """Answers PATCH /api/v1/nodes/NAME: 401 to the token ``refused``, else 200; records each."""

    seen: ClassVar[list[tuple[str, str, dict[str, Any]]]] = []

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        auth = self.headers.get("Authorization", "")
        self.seen.append((self.path, auth, body))
        assert self.headers["Content-Type"] == "application/merge-patch+json"
        self.send_response(401 if auth == "Bearer refused" else 200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    _ApiServer.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_label_with_the_service_accounts_token(api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMSANDBOX_API_TOKEN", "sa-token")
    assert cli_main.main(["node", "label", "node-1", "--server", api]) == 0
    assert cli_main.main(["node", "label", "node-1", "--server", api, "--remove"]) == 0
    assert _ApiServer.seen == [
        ("/api/v1/nodes/node-1", "Bearer sa-token", {"metadata": {"labels": {"vmsandbox.dev/runtime": "true"}}}),
        ("/api/v1/nodes/node-1", "Bearer sa-token", {"metadata": {"labels": {"vmsandbox.dev/runtime": None}}}),
    ]


def test_label_falls_back_to_the_kubeconfig_when_the_token_is_refused(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the service account went with the rest of deploy/install/ on `kubectl delete`
    monkeypatch.setenv("VMSANDBOX_API_TOKEN", "refused")
    kubeconfig = tmp_path / "kubelet.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump({"clusters": [{"cluster": {"server": api}}], "users": [{"user": {"token": "node-token"}}]})
    )
    assert cli_main.main(["node", "label", "node-1", "--server", api, "--remove", "--kubeconfig", str(kubeconfig)]) == 0
    assert [auth for _, auth, _ in _ApiServer.seen] == ["Bearer refused", "Bearer node-token"]
    assert cli_main.main(["node", "label", "node-1", "--server", api]) == 1  # no fallback given: refused
