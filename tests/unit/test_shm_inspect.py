"""`llmobs-agent inspect` against a real workload process, and its one-line errors with exit codes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENT = [sys.executable, "-m", "llmobs.cli"]


def _inspect(*args, shm_dir):
    cmd = [*AGENT, "inspect", *args, "--shm-dir", str(shm_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def workload(tmp_path):
    """A tiny-model workload that has finished its requests and holds until stdin closes."""
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "workload.py"), "--model", "tiny", "--requests", "2",
         "--max-new-tokens", "4", "--tenant", "acme", "--ready-fd", str(wfd), "--hold"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(wfd,),
        env=dict(os.environ, LLMOBS_SHM_DIR=str(tmp_path)),
    )  # fmt: skip
    os.close(wfd)
    with os.fdopen(rfd) as ready:
        for phase in ("ready", "done"):
            assert select.select([ready], [], [], 60)[0], "workload did not signal"
            assert json.loads(ready.readline())["phase"] == phase
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_inspect_live_process_json_and_text(workload, tmp_path):
    proc = _inspect("--pid", str(workload.pid), "--json", "--last", "3", shm_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["header"]["writer_pid"] == workload.pid and info["state"] == "live"
    assert info["header"]["steps_head"] == 8 and info["model_id"] == "tiny-gpt2"
    assert len(info["steps"]) == 3 and info["steps"][-1]["tenant"] == "acme"
    assert info["context"]["step_seq"] == 0  # idle between requests: untracked
    otel = info["otel_process_context"]
    assert otel["format"] == "otep-4719" and otel["status"] == "ok"
    assert otel["resource"]["llmobs.model_id"] == "tiny-gpt2"
    assert otel["resource"]["process.pid"] == str(workload.pid)
    text = _inspect("--pid", str(workload.pid), shm_dir=tmp_path)
    assert text.returncode == 0 and "steps ring head 8" in text.stdout and "acme/session-1" in text.stdout


def test_inspect_errors_are_one_line_with_distinct_codes(tmp_path):
    missing = _inspect("--pid", str(2**22 + 4321), shm_dir=tmp_path)
    assert missing.returncode == 3 and missing.stderr.startswith("error: no process")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        untracked = _inspect("--pid", str(sleeper.pid), shm_dir=tmp_path)
        assert untracked.returncode == 7 and "publishes no llmobs map" in untracked.stderr
        bad = tmp_path / f"llmobs.{sleeper.pid}"
        bad.write_bytes(b"\0" * 8192)
        os.chmod(bad, 0o600)
        malformed = _inspect("--pid", str(sleeper.pid), shm_dir=tmp_path)
        assert malformed.returncode == 5 and "bad magic" in malformed.stderr
        assert "Traceback" not in malformed.stderr and len(malformed.stderr.splitlines()) == 2  # error + hint
    finally:
        sleeper.kill()
        sleeper.wait()
