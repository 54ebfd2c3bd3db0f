"""Every command answers ``--help`` with examples, through the real entry point; ``version`` works."""

from __future__ import annotations

import json

import pytest

from tests.cli.conftest import vmsandbox

COMMANDS = {
    "top": (),
    "serve": ("serve",),
    "plan": ("plan",),
    "profile": ("profile",),
    "profile-validate": ("profile", "validate"),
    "profile-runtimeclass": ("profile", "runtimeclass"),
    "ls": ("ls",),
    "inspect": ("inspect",),
    "version": ("version",),
}


@pytest.mark.parametrize("words", COMMANDS.values(), ids=list(COMMANDS))
def test_help_has_examples(words: tuple[str, ...]) -> None:
    done = vmsandbox(*words, "--help")
    assert done.returncode == 0, done.stderr
    assert "examples:" in done.stdout
    assert f"vmsandbox {' '.join(words)}".strip() in done.stdout


@pytest.mark.parametrize(
    "words",
    [("plan",), ("ls",), ("inspect",), ("profile", "validate"), ("version",)],
    ids=["plan", "ls", "inspect", "profile-validate", "version"],
)
def test_json_format_is_offered(words: tuple[str, ...]) -> None:
    assert "--format {text,json" in vmsandbox(*words, "--help").stdout


def test_version() -> None:
    assert vmsandbox("version").stdout.startswith("vmsandbox ")
    doc = json.loads(vmsandbox("version", "--format", "json").stdout)
    assert set(doc) == {"vmsandbox", "python"}


def test_usage_errors_exit_2() -> None:
    done = vmsandbox("plan")
    assert done.returncode == 2 and "the following arguments are required: POD.yaml" in done.stderr
    done = vmsandbox("plan", "x.yaml", "--profile", "a", "--handler", "b")
    assert done.returncode == 2 and "not allowed with argument" in done.stderr
    assert vmsandbox("nonsense").returncode == 2
