"""One event, one line: a target's command line (or comm) with newlines, ESC or Unicode separators cannot
split or forge the daemon's log lines, nor an `error:` line of the CLI (issue 8, log forging)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from llmobs.daemon import config as cfg
from llmobs.daemon.discovery import ProcWatcher, Selectors
from llmobs.daemon.service import Service
from llmobs.logtext import one_line

MARK = "llmobs-forge-test"
FORGED = "\nllmobs-agent: detach pid 1 (forged): target exited\x1b[2K\u2028"


def test_one_line_escapes_what_breaks_or_disguises_a_line():
    assert one_line("a\nb\r\tc\x1b[31md\x00e\x7f\x85") == "a\\nb\\r\\tc\\x1b[31md\\x00e\\x7f\\x85"
    assert one_line("x\u2028y\u2029z\u202eq") == "x\\u2028y\\u2029z\\u202eq"
    plain = "python serve.py --model /m/ü.bin C:\\path"  # printable text, backslashes included, stays as is
    assert one_line(plain) == plain


@pytest.fixture
def forger():
    """A real process that maps libtorch and whose command line carries a forged log line."""
    program = f"import sys, torch  # {MARK}\nprint('ready', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", program, FORGED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"  # torch is mapped once this line arrives
        yield child
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_the_daemon_logs_a_forging_command_line_as_one_line(forger, monkeypatch):
    monkeypatch.setattr(cfg, "DEFAULT_CONFIG_PATH", Path("/nonexistent/llmobs.toml"))
    lines: list[str] = []
    service = Service(cfg.load(None, env={}), log=lines.append)
    service.watcher = ProcWatcher(Selectors((), "", MARK), young_s=0.0)
    appeared, _ = service.watcher.scan()
    proc = next(p for p in appeared if p.pid == forger.pid)
    assert "\n" in proc.command  # the real command line does hold the newlines
    service._refuse(proc, f"refused for the test; comm was {FORGED!s}")
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(f"skip pid {forger.pid} (") and "refused for the test" in line
    assert not any(char in line for char in "\n\r\x1b\u2028"), line
    assert "\\nllmobs-agent: detach pid 1 (forged)" in line and "\\x1b[2K\\u2028" in line


def test_a_cli_error_quoting_a_comm_stays_one_line():
    """`attach` to a process that is not PyTorch names its comm in the error: here a comm with a newline
    and an ESC (a process may name itself anything, prctl PR_SET_NAME)."""
    # as a Python literal in the child's source (a newline and an ESC there), and as the log must show it
    comm = "x\\nerror: \\x1b[31m"
    program = (
        f"import sys\nopen('/proc/self/comm', 'w').write('{comm}')\n"
        "print('ready', flush=True)\nsys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert "\n" in Path(f"/proc/{child.pid}/comm").read_text().rstrip("\n")
        result = subprocess.run(
            [sys.executable, "-m", "llmobs.cli", "attach", "--pid", str(child.pid), "--overhead-budget", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    first = result.stderr.splitlines()[0]
    expected = (
        f"error: pid {child.pid} ({comm}) is not a PyTorch process: no libc10 in /proc/{child.pid}/maps"
    )
    assert first == expected
    assert "\x1b" not in result.stderr and [
        line for line in result.stderr.splitlines() if "error" in line
    ] == [first]
