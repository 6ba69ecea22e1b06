"""The `llmobs-agent` dispatcher: usage errors exit 2 with a usage line, and every registered
command answers `--help`."""

from __future__ import annotations

import subprocess
import sys

import pytest
from llmobs import cli
from llmobs.errors import ExitCode


def test_no_arguments_prints_usage_and_exits_2(capsys) -> None:
    assert cli.main([]) == ExitCode.USAGE == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: llmobs-agent")
    for name in cli.COMMANDS:
        assert name in out


def test_console_script_without_arguments_exits_2() -> None:
    """The real entry point, as a user runs it."""
    result = subprocess.run(
        [sys.executable, "-m", "llmobs.cli"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert "usage: llmobs-agent" in result.stdout
    assert "Traceback" not in result.stderr


def test_unknown_command_exits_2_with_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["no-such-command"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: llmobs-agent" in err
    assert "invalid choice: 'no-such-command'" in err


def test_unknown_option_of_a_command_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["doctor", "--no-such-option"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_of_each_registered_command(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: llmobs-agent {name}")
    assert cli.COMMANDS[name][1] in " ".join(out.split())  # the one-line help, however argparse wraps it


def test_doctor_help_documents_json(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--help"])
    assert "--json" in capsys.readouterr().out
