"""Issue 8, security: without privileges every entry point that needs them says so in one line and
exits with code 4 (ACCESS_DENIED), with no traceback: `attach`, `run` and `inspect` of another user's map.

The test drops from root to nobody (uid/gid 65534, no groups, no capabilities) with setpriv, as the
attach tests do; the target is a real instrumented workload owned by root.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.held_workload import HeldWorkload

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
CLI = [sys.executable, "-m", "llmobs.cli"]


@pytest.fixture(scope="module")
def workload():
    with HeldWorkload(
        "--model", "tiny", "--requests", "1", "--max-new-tokens", "2", "--threads", "1"
    ) as held:
        held.generate()
        yield held


def _as_nobody(*args: str) -> str:
    result = subprocess.run([*NOBODY, *CLI, *args], capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 4, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[0].startswith("error: "), result.stderr
    assert len(lines) <= 2 and all(line.startswith("hint: ") for line in lines[1:]), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


def test_attach_without_privileges(workload, tmp_path):
    line = _as_nobody("attach", "--pid", str(workload.pid), "--db", str(tmp_path / "s.duckdb"))
    assert "needs root" in line


def test_run_without_privileges(tmp_path):
    line = _as_nobody("run", "--db", str(tmp_path / "s.duckdb"), "--run-dir", str(tmp_path / "run"))
    assert "needs root" in line


def test_inspect_of_another_users_map(workload):
    line = _as_nobody("inspect", "--pid", str(workload.pid))
    assert "permission denied" in line
