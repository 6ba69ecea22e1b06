"""The `llmobs-agent` dispatcher: usage errors exit 2 with a usage line, and every registered
command answers `--help`."""

from __future__ import annotations

import re
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


# ---- usage errors: one `error:` line and one `hint:` line, exit 2 (argparse's own errors included) -----
def _two_lines(err: str) -> tuple[str, str]:
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    return lines[0], lines[1]


@pytest.mark.parametrize(
    ("argv", "error", "command"),
    [
        (["attach", "--pid", "abc"], "error: argument --pid: invalid int value: 'abc'", "attach"),
        (["doctor", "--no-such-option"], "error: unrecognized arguments: --no-such-option", "doctor"),
        (["inspect"], "error: the following arguments are required: --pid", "inspect"),
        (["query", "--db"], "error: argument --db: expected one argument", "query"),
    ],
)
def test_argparse_errors_are_one_error_and_one_hint_line(argv, error, command, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == ExitCode.USAGE
    err = capsys.readouterr().err
    first, hint = _two_lines(err)
    assert first == error
    assert hint.startswith(f"hint: see `llmobs-agent {command} --help`")
    assert "usage:" not in first and "Traceback" not in err


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmobs.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(("percent", "fraction"), [("1", "0.01"), ("0", "0"), ("2.5", "0.025")])
def test_attach_budget_in_percent_still_works_with_one_deprecation_line(percent, fraction) -> None:
    done = _cli("attach", "--budget", percent, "--ebpf")  # --ebpf: validated, printed, nothing attached
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"warning: --budget is deprecated; use --overhead-budget {fraction} (a fraction)"
    ]


def test_attach_budget_settings_share_runs_parsers_and_units() -> None:
    """--overhead-budget is the fraction of `run --overhead-budget` and overhead.budget, validated by the
    same parser; the attach loop reads the fraction."""
    import argparse

    from llmobs.commands import attach

    args = cli.build_parser().parse_args(["attach", "--overhead-budget", "0.05", "--sample", "3"])
    assert attach._validate(args) == ("cpu", "host")
    assert (args.overhead_budget, args.sample, args.thin) == (0.05, 3, 64)  # probes.thin's default
    thin = cli.build_parser().parse_args(["attach", "--thin", "1"])
    attach._validate(thin)
    assert thin.thin == 1
    bad = _cli("attach", "--thin", "0", "--ebpf")
    error, hint = _two_lines(bad.stderr)
    assert bad.returncode == 2 and error.startswith("error: probes.thin = '0' (from flag --thin)")
    assert hint.startswith("hint:")
    assert (args.sample_mode, args.ioctl_paths, args.profile) == ("trace", "/dev/nvidia*", "cpu,host")
    assert isinstance(args, argparse.Namespace)
    error, hint = _two_lines(_cli("attach", "--overhead-budget", "5", "--ebpf").stderr)
    assert error.startswith("error: overhead.budget = '5' (from flag --overhead-budget): out of range")
    both = _cli("attach", "--budget", "1", "--overhead-budget", "0.01", "--ebpf")
    assert (
        both.returncode == 2
        and _two_lines(both.stderr)[0] == "error: --budget and --overhead-budget both given"
    )


def test_run_flags_are_generated_from_the_settings_table(capsys) -> None:
    from llmobs.commands.run import FLAGS, flags_of
    from llmobs.settings import SETTINGS

    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    shown = re.findall(r"\[(--[a-z-]+)", help_text.split(" options: ")[0])
    assert shown == [
        "--config",
        "--check-config",
        "--db",
        "--retention-age",
        "--profile",
        "--sample",
        "--sample-mode",
        "--thin",
        "--user",
        "--cgroup",
        "--command",
        "--interval",
        "--overhead-budget",
        "--cost-scale",
        "--cpu-priority",
        "--run-dir",
        "--detector",
        "--alarm-rate",
        "--detector-window",
        "--alpha",
        "--mad-threshold",
        "--aftermath",
        "--replay-on-anomaly",
        "--replay-max-per-minute",
        "--otlp",
        "--otlp-protocol",
    ]  # fmt: skip  (the flags `run` had before they were generated, the detector.*, replay.* keys', --thin)
    for setting in SETTINGS:
        if setting.flag:  # a boolean's value is optional: `--replay-on-anomaly [BOOL]`
            value = f"[{setting.metavar}]" if setting.metavar == "BOOL" else setting.metavar
            assert f"{setting.flag} {value}" in help_text and f"({setting.key})" in help_text
    args = cli.build_parser().parse_args(["run", "--command", "serve", "--interval", "3", "--otlp", "x:1"])
    flags = flags_of(args)
    assert set(flags) == {flag.key for flag in FLAGS}
    assert (flags["select.command"], flags["discovery.interval_s"], flags["otlp.endpoint"]) == (
        "serve",
        "3",
        "x:1",
    )
    assert flags["probes.sample_n"] is None  # not given: the environment, file or default decides


def test_export_to_an_unwritable_output_hints_at_the_output_not_the_store(tmp_path, capsys) -> None:
    from llmobs.store import DuckDBStore

    db = tmp_path / "s.duckdb"
    with DuckDBStore(db):
        pass
    assert (
        cli.main(["export", "--db", str(db), "--parquet", "/proc/llmobs-no-such/dir"]) == ExitCode.STORE_ERROR
    )
    error, hint = _two_lines(capsys.readouterr().err)
    assert error.startswith("error: cannot create /proc/llmobs-no-such/dir")
    assert "--parquet" in hint and "--db" not in hint
    assert cli.main(["export", "--db", str(db), "--perfetto", "/proc/llmobs-no-such/t.json"]) != 0
    _, hint = _two_lines(capsys.readouterr().err)
    assert "--perfetto" in hint and "--db" not in hint


def test_export_since_without_perfetto_is_a_usage_error_from_the_console_script(tmp_path) -> None:
    """The window applies to the Perfetto trace only: without --perfetto the real entry point says so
    with exit 2 (it once exited 11, as if the store were at fault), whatever the store."""
    result = subprocess.run(
        [sys.executable, "-m", "llmobs.cli", "export", "--db", str(tmp_path / "none.duckdb"),
         "--parquet", str(tmp_path / "p"), "--since", "1200000000000"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (ExitCode.USAGE, "")
    assert result.stderr.splitlines() == [
        "error: --since/--until apply to --perfetto only",
        "hint: add --perfetto FILE, or drop --since/--until",
    ]
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    "args, error, hint",
    [
        (
            ["--requests", "0"],
            "error: --requests and --max-new-tokens must be at least 1",
            "hint: e.g. --requests 2",
        ),
        (
            ["--profile", "nosuch"],
            "error: unknown profile(s) nosuch; choose from cpu, gemm, mem, host, cuda, threadctx or all",
            "hint: see `llmobs-agent demo --help`",
        ),
    ],
)
def test_demo_argument_mistakes_are_usage_errors_said_before_anything_runs(
    tmp_path, capsys, args, error, hint
):
    """demo's bad arguments are the project's UsageError (exit 2, an error and a hint line), refused
    before the privilege check, the bcc import or the output directory."""
    out = tmp_path / "demo"
    assert cli.main(["demo", *args, "--out", str(out)]) == ExitCode.USAGE
    assert _two_lines(capsys.readouterr().err) == (error, hint)
    assert not out.exists()


def test_a_map_of_random_bytes_is_not_an_llmobs_map_and_a_version_mismatch_is(tmp_path) -> None:
    import os
    import struct

    from llmobs.shm import layout

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / f"llmobs.{sleeper.pid}"
        path.write_bytes(os.urandom(8192))
        os.chmod(path, 0o600)
        done = _cli("inspect", "--pid", str(sleeper.pid), "--shm-dir", str(tmp_path))
        assert done.returncode == ExitCode.MALFORMED_MAP, done.stderr
        error, hint = _two_lines(done.stderr)
        assert "bad magic" in error and "not an llmobs map" in error
        assert "llmobs header" in hint and "ABI" not in hint
        path.write_bytes(struct.pack("<QI", layout.MAGIC, layout.ABI_VERSION + 1).ljust(8192, b"\0"))
        done = _cli("inspect", "--pid", str(sleeper.pid), "--shm-dir", str(tmp_path))
        error, hint = _two_lines(done.stderr)
        assert f"ABI version {layout.ABI_VERSION + 1}" in error and "ABI version" in hint
    finally:
        sleeper.kill()
        sleeper.wait()
