"""Every command answers ``--help`` with examples, through the real entry point; ``version`` works."""

from __future__ import annotations

import json
import shlex

import pytest

from cli.main import build_parser
from tests.cli.vmsandbox_cmd import vmsandbox

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


def _examples(help_text: str) -> list[list[str]]:
    """The command lines under "examples:", without trailing comments and pipes."""
    out = []
    for line in help_text.split("examples:", 1)[1].splitlines():
        line = line.strip()
        if not line.startswith("vmsandbox "):
            continue
        line = line.split("|")[0].split("  (")[0].split("  #")[0]
        out.append(shlex.split(line)[1:])
    return out


@pytest.mark.parametrize("words", COMMANDS.values(), ids=list(COMMANDS))
def test_every_example_parses(words: tuple[str, ...]) -> None:
    """Each example in --help is a command line the parser accepts (``serve ... --log-format json``
    included: the logging options work before and after the command)."""
    examples = _examples(vmsandbox(*words, "--help").stdout)
    assert examples
    for argv in examples:
        args = build_parser().parse_args(argv)
        assert args.command == argv[0]


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--log-format", "json", "--log-level", "DEBUG", "serve"], id="before"),
        pytest.param(["serve", "--log-format", "json", "--log-level", "DEBUG"], id="after"),
        pytest.param(["--log-level", "DEBUG", "serve", "--log-format", "json"], id="both"),
        pytest.param(["profile", "validate", "x.yaml", "--log-format", "json", "--log-level", "DEBUG"], id="nested"),
    ],
)
def test_logging_options_before_or_after_the_command(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_format, args.log_level) == ("json", "DEBUG")


def test_logging_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.log_format, args.log_level) == (None, "INFO")


def test_plan_help_documents_the_exit_status() -> None:
    out = " ".join(vmsandbox("plan", "--help").stdout.split())
    assert "exit status: 0 the pod fits, 1 the shim would refuse it" in out
    assert "2 no plan could be made: bad input" in out
    assert "no state database at --state-dir" in out
