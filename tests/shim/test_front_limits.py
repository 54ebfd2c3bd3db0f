"""The front's bounds in the shim's configuration (``front_max_conns``, ``front_max_buffered_mib``,
``front_window_timeout_s``, ``front_idle_timeout_s``): validated, defaulting to the front's own
flags' defaults, and passed to it as those flags."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from shim.config import ShimConfig, config_from_mapping
from shim.front import Front, FrontLimits
from vmsandbox.errors import InvalidArgument

REPO = Path(__file__).resolve().parents[2]
SOURCE = "/etc/vmsandbox/config.yaml"


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"front_max_conns": 1}, None),
        ({"front_max_conns": 65536}, None),
        ({"front_max_conns": 0}, "front_max_conns: must be an integer from 1 to 65536"),
        ({"front_max_conns": 65537}, "front_max_conns: must be an integer from 1 to 65536"),
        ({"front_max_conns": True}, "front_max_conns: must be an integer"),
        ({"front_max_conns": 2.5}, "front_max_conns: must be an integer"),
        ({"front_max_conns": "256"}, "front_max_conns: must be an integer"),
        ({"front_max_buffered_mib": 64}, None),
        ({"front_max_buffered_mib": 0}, "front_max_buffered_mib: must be an integer from 1 to 65536"),
        ({"front_max_buffered_mib": -1}, "front_max_buffered_mib: must be an integer"),
        ({"front_window_timeout_s": 2.5}, None),
        ({"front_window_timeout_s": 3600}, None),
        ({"front_window_timeout_s": 0}, "front_window_timeout_s: must be a number of seconds from 0 to 3600"),
        ({"front_window_timeout_s": 3601}, "front_window_timeout_s: must be a number of seconds"),
        ({"front_window_timeout_s": False}, "front_window_timeout_s: must be a number of seconds"),
        ({"front_window_timeout_s": "10"}, "front_window_timeout_s: must be a number of seconds"),
        ({"front_idle_timeout_s": 30}, None),
        ({"front_idle_timeout_s": 86400}, None),
        ({"front_idle_timeout_s": -5}, "front_idle_timeout_s: must be a number of seconds from 0 to 86400"),
        ({"front_idle_timeout_s": 86401}, "front_idle_timeout_s: must be a number of seconds"),
    ],
)
def test_front_limits_configuration(data: dict[str, object], error: str | None) -> None:
    if error is not None:
        with pytest.raises(InvalidArgument, match=error):
            config_from_mapping(data, SOURCE)
        return
    config = config_from_mapping(data, SOURCE)
    ((key, value),) = data.items()
    assert getattr(config, key) == value


def _go_defaults() -> dict[str, float]:
    """The front's flag defaults as front/limits.go writes them."""
    text = (REPO / "front" / "limits.go").read_text()
    units = {"time.Second": 1, "time.Minute": 60}

    def value(name: str) -> float:
        match = re.search(rf"^\s*{name}\s*=\s*(\d+)\s*(?:<<\s*(\d+)|\*\s*(time\.\w+))?\s*$", text, re.MULTILINE)
        assert match is not None, f"{name} not found in front/limits.go"
        number = int(match[1]) << int(match[2] or 0)
        return number * units[match[3]] if match[3] else number

    return {
        "max_conns": value("defaultMaxConns"),
        "max_buffered_mib": value("defaultMaxBuffered") / (1 << 20),
        "window_timeout_s": value("defaultWindowTimeout"),
        "idle_timeout_s": value("defaultIdleTimeout"),
    }


def test_the_defaults_are_the_fronts_own() -> None:
    config = ShimConfig()
    assert FrontLimits.of(config) == FrontLimits()
    limits = FrontLimits()
    assert {key: getattr(limits, key) for key in _go_defaults()} == _go_defaults()


def test_the_limits_go_to_the_front_as_its_flags() -> None:
    config = config_from_mapping(
        {
            "front_max_conns": 32,
            "front_max_buffered_mib": 48,
            "front_window_timeout_s": 2.5,
            "front_idle_timeout_s": 60,
        },
        SOURCE,
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        front = Front(
            "/usr/local/libexec/vmsandbox/vmsandbox-front",
            listener,
            Path("/var/lib/vmsandbox/state/shim.sock"),
            "unix:///run/containerd/containerd.sock",
            10.0,
            lambda name, data, context: (b"", None),
            lambda: 0,
            FrontLimits.of(config),
        )
        flags = dict(zip(front.argv[1::2], front.argv[2::2], strict=True))
        assert flags["-max-conns"] == "32"
        assert flags["-max-buffered-mib"] == "48"
        assert float(flags["-window-timeout"]) == 2.5
        assert float(flags["-idle-timeout"]) == 60.0
        # without limits of its own, the front gets the defaults, said explicitly
        bare = Front("/bin/front", listener, Path("/s.sock"), "unix:///d.sock", 10.0, lambda *a: (b"", None), lambda: 0)
        flags = dict(zip(bare.argv[1::2], bare.argv[2::2], strict=True))
        assert (flags["-max-conns"], flags["-max-buffered-mib"]) == ("256", "256")
        assert (float(flags["-window-timeout"]), float(flags["-idle-timeout"])) == (10.0, 300.0)
