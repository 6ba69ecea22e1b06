"""Issue 8, security: a map file with the wrong owner or mode is refused end to end.

A real instrumented workload creates its map (/dev/shm/llmobs.<pid>, mode 0600, owned by its user); the
test then loosens the mode (anyone could have written into it) or hands the file to another user (that
user could have planted it). `inspect` must refuse it with one line and exit code 5, and `attach --db`
must keep working for the probes while storing nothing from that map, saying why in its summary.
The control case (the untouched map) is read normally, so a refusal cannot come from something else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from test_attach import Agent
from test_cpu_priority import CaseWorkload, enter_together, exit_together

INSPECT = [sys.executable, "-m", "llmobs.cli", "inspect"]
NOBODY = 65534


def _map_of(pid: int) -> Path:
    path = Path(f"/dev/shm/llmobs.{pid}")
    assert path.exists(), f"the workload made no map at {path}"
    return path


def _inspect(pid: int) -> subprocess.CompletedProcess:
    return subprocess.run([*INSPECT, "--pid", str(pid)], capture_output=True, text=True, timeout=60)


def _tamper(path: Path, how: str) -> str:
    """Applies the change; returns the text the refusal must contain."""
    if how == "mode":
        os.chmod(path, 0o644)
        return "has mode 0644, a map must be 0600"
    os.chown(path, NOBODY, NOBODY)
    return f"owned by uid {NOBODY} but process"


ARGS = ("--model", "tiny", "--requests", "2", "--max-new-tokens", "4", "--threads", "1")


ATTACHED = ("mode", "owner", None)  # the attach cases: how each one's map is tampered (None: untouched)


@pytest.fixture(scope="module")
def workloads():
    """Every workload of the module, started at once (each loads torch and its model: ~7 s, spent side by
    side instead of one after the other): "inspect", read by inspect's cases, and one per attach case,
    which generates under its agent. All are held alive until the module's tests are done."""
    started = {key: CaseWorkload(*ARGS) for key in ("inspect", *ATTACHED)}
    enter_together(*started.values())
    try:
        yield started
    finally:
        exit_together(*started.values())


@pytest.fixture(scope="module")
def workload(workloads):
    held = workloads["inspect"]
    held.generate()  # its map now holds steps
    return held


def test_the_untouched_map_is_read(workload):
    result = _inspect(workload.pid)
    assert result.returncode == 0, result.stderr
    assert "tiny-gpt2" in result.stdout


@pytest.mark.parametrize("how", ["mode", "owner"])
def test_inspect_refuses_a_tampered_map_with_one_line(workload, how):
    path = _map_of(workload.pid)
    st = path.stat()
    try:
        expected = _tamper(path, how)
        result = _inspect(workload.pid)
    finally:
        os.chmod(path, 0o600)
        os.chown(path, st.st_uid, st.st_gid)
    assert result.returncode == 5, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert len(lines) <= 2 and all(line.startswith("hint: ") for line in lines[1:])
    assert "Traceback" not in result.stderr and result.stdout == ""


def _attach_while_generating(db: Path, how: str | None, workload: CaseWorkload) -> tuple[str, str]:
    """attach --db to a workload whose map was tampered `how` (None: untouched) while it generates;
    returns (the refusal text expected, the agent's output)."""
    path = _map_of(workload.pid)
    expected = _tamper(path, how) if how else ""
    agent = Agent("--pid", str(workload.pid), "--profile", "cpu", "--db", str(db))
    agent.wait_for("attached in")
    workload.generate()
    agent.proc.send_signal(signal.SIGINT)
    code, text = agent.finish()
    assert code == 0, text
    assert "Traceback" not in text
    return expected, text


def _tagged_probe_hits(db: Path) -> tuple[int, int]:
    """(probe hits counted, of them tagged with a token step from the map's context cell)."""
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(
            "SELECT sum(count), coalesce(sum(count) FILTER (WHERE step_seq <> 0), 0) FROM probe_aggregates"
        ).fetchone()


@pytest.mark.parametrize("how", ["mode", "owner"])
def test_attach_stores_nothing_from_a_tampered_map(tmp_path, how, workloads):
    db = tmp_path / "store.duckdb"
    expected, text = _attach_while_generating(db, how, workloads[how])
    map_line = next(line for line in text.splitlines() if "token steps from the map" in line)
    assert "0 read" in map_line and expected in map_line, map_line
    # its context cell is not trusted either: no event is tagged from it, and attach says why, once
    notes = [line for line in text.splitlines() if "the llmobs map does not tag events" in line]
    assert len(notes) == 1 and expected in notes[0], text
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM token_steps").fetchone()[0] == 0
    hits, tagged = _tagged_probe_hits(db)
    assert hits > 0 and tagged == 0, (hits, tagged)  # the probes worked; nothing carries the map's tags


def test_attach_tags_events_from_the_untouched_map(tmp_path, workloads):
    """The control case: the same run on an untouched map tags the probe hits with its token steps."""
    db = tmp_path / "store.duckdb"
    _, text = _attach_while_generating(db, None, workloads[None])
    assert "the llmobs map does not tag events" not in text
    hits, tagged = _tagged_probe_hits(db)
    assert tagged > 0, (hits, tagged)
