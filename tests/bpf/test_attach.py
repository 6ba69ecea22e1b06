"""`llmobs-agent attach` as a user runs it: real agent and target processes, signals, the files it
writes, the errors it prints, and that nothing stays in the kernel however the agent ends."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from llmobs.bpf.records import DEFAULT_THIN, THINNED_PROBES
from test_probes_target import GEMM_FLOPS, LINEAR_OUTPUT_BYTES, leftovers

AGENT = [sys.executable, "-m", "llmobs.cli", "attach"]


class Agent:
    """`llmobs-agent attach` in a child process; waits on its stderr lines, never on sleeps."""

    def __init__(self, *args: str):
        # The overhead governor (on by default, 1%) may detach costly probes mid-test; these tests count
        # exactly, so it is off unless a test sets a budget (tests/bpf/test_governor_live.py does).
        if "--overhead-budget" not in args:
            args = (*args, "--overhead-budget", "0")
        self.proc = subprocess.Popen([*AGENT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.pid = self.proc.pid
        self.lines: list[str] = []
        self._buffer = b""

    def wait_for(self, text: str, timeout: float = 30.0) -> str:
        fd = self.proc.stderr.fileno()
        while True:
            for line in self.lines:
                if text in line:
                    return line
            readable, _, _ = select.select([fd], [], [], timeout)
            assert readable, f"agent printed no {text!r} within {timeout} s: {self.lines}"
            chunk = os.read(fd, 65536)
            assert chunk, f"agent exited before printing {text!r}: {self.lines}"
            self._buffer += chunk
            *complete, self._buffer = self._buffer.split(b"\n")
            self.lines += [line.decode() for line in complete]

    def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        text = "\n".join(self.lines) + "\n" + (self._buffer + err).decode()
        return self.proc.returncode, text


def _assert_clean(agent_pid: int, target_pid: int, before: dict, timeout: float = 5.0) -> None:
    """Nothing of the agent's is left in the kernel. Programs are freed after an RCU grace period,
    so an orphan may be listed for a moment after the agent exits: poll until clean or timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = leftovers(agent_pid=agent_pid, target_pid=target_pid)
        clean = not left["perf"] and not left["programs"] and left["uprobe_events"] == before["uprobe_events"]
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left["perf"] == [], left["perf"]
    assert left["uprobe_events"] == before["uprobe_events"]
    assert left["programs"] == [], left["programs"]


def _read(out: Path):
    events = pq.read_table(out).to_pylist()
    aggregates = pq.read_table(out.with_suffix(".aggregates.parquet")).to_pylist()
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    return events, {(row["probe"], row["step_seq"]): row for row in aggregates}, summary


def test_attach_counts_tags_and_detaches_on_sigint(tmp_path, targets):
    out = tmp_path / "events.parquet"
    before = leftovers()
    with targets.take() as target:
        agent = Agent(
            "--pid",
            str(target.pid),
            "--profile",
            "cpu,gemm,mem,host",
            "--ioctl-paths",
            "/dev/null",
            "--out",
            str(out),
        )
        agent.wait_for("attached in")
        for step in (1, 2, 3):
            target.step(step, f"{step:032x}", allocs=4 * step, nbytes=1000, gemms=step, ioctls=step)
        agent.proc.send_signal(signal.SIGINT)
        code, text = agent.finish()
        assert code == 0, text
        assert "(SIGINT)" in text and "Traceback" not in text
        _assert_clean(agent.pid, target.pid, before)
    events, aggregates, summary = _read(out)
    for step in (1, 2, 3):
        allocs = 4 * step + step
        assert aggregates[("alloc_cpu", step)]["count"] == allocs
        assert aggregates[("alloc_cpu", step)]["sum_value"] == 4 * step * 1000 + step * LINEAR_OUTPUT_BYTES
        assert aggregates[("free_cpu", step)]["count"] == allocs
        assert aggregates[("sgemm", step)]["count"] == step
        assert aggregates[("sgemm", step)]["sum_value"] == step * GEMM_FLOPS
        assert aggregates[("sgemm", step)]["sum_duration_ns"] == 0  # GEMM durations are opt-in
        assert aggregates[("ioctl", step)]["count"] == step
        assert aggregates[("linear", step)]["count"] == step
    tagged = [e for e in events if e["pid"] == target.pid and e["step_seq"]]
    assert tagged and all(e["trace_id"] == f"{e['step_seq']:032x}" for e in tagged)
    # --sample 1: every event stands for itself, but a thinned probe's tagged ones, shipped 1 in 64
    thinned = [e["probe"] in THINNED_PROBES and e["step_seq"] != 0 for e in events]
    assert {e["sample_ratio"] for e, thin in zip(events, thinned, strict=True) if not thin} == {1}
    assert {e["sample_ratio"] for e, thin in zip(events, thinned, strict=True) if thin} <= {DEFAULT_THIN}
    exact = [e for e in tagged if e["probe"] in ("alloc_cpu", "free_cpu", "sgemm", "ioctl")]
    assert len(exact) == sum(
        row["count"]
        for (probe, step), row in aggregates.items()
        if step and probe in ("alloc_cpu", "free_cpu", "sgemm", "ioctl")
    )
    assert summary["per_step"]["3"]["sgemm"] == 3 and summary["counters"]["ring_drops"] == 0
    assert summary["first_event_after_s"] is not None and summary["first_event_after_s"] < 10


def test_sigterm_detaches_cleanly(targets):
    before = leftovers()
    with targets.take() as target:
        agent = Agent("--pid", str(target.pid))
        agent.wait_for("attached in")
        target.step(1, f"{1:032x}", gemms=2)
        agent.proc.send_signal(signal.SIGTERM)
        code, text = agent.finish()
        assert code == 0, text
        assert "(SIGTERM)" in text and "linear" in text
        _assert_clean(agent.pid, target.pid, before)


def test_target_killed_mid_attach(targets):
    before = leftovers()
    with targets.take() as target:
        agent = Agent("--pid", str(target.pid), "--profile", "cpu,mem,host")
        agent.wait_for("attached in")
        target.step(1, f"{1:032x}", allocs=3)
        target.proc.kill()
        target.proc.wait()
        code, text = agent.finish()
    assert code == 0, text
    assert "(target exited)" in text and "Traceback" not in text
    _assert_clean(agent.pid, target.pid, before)


def test_sigkill_of_the_agent_leaves_no_probe(targets):
    before = leftovers()
    with targets.take() as target:
        agent = Agent("--pid", str(target.pid), "--profile", "cpu,mem,host")
        agent.wait_for("attached in")
        assert leftovers(agent_pid=agent.pid)["perf"]  # attached: its perf-event probes are listed
        agent.proc.kill()
        agent.proc.wait()
        # the kernel removes perf-event uprobes when their fds close: no tracefs entry was ever made
        _assert_clean(agent.pid, target.pid, before)
        target.step(1, f"{1:032x}", allocs=3, gemms=1)  # and the target runs on unharmed


def test_duration_ends_the_attach(tmp_path, targets):
    with targets.take() as target:
        agent = Agent("--pid", str(target.pid), "--duration", "0.5", "--out", str(tmp_path / "e.parquet"))
        code, text = agent.finish()
    assert code == 0, text
    assert "(duration reached)" in text
    assert json.loads((tmp_path / "e.summary.json").read_text())["reason"] == "duration reached"


def test_attach_removes_maps_left_by_dead_processes(tmp_path, targets):
    # a pid above any pid_max the kernel allows: no process has it, so its map is stale for sure
    stale = Path("/dev/shm/llmobs.4194399")
    stale.write_bytes(b"\0" * 4096)
    try:
        with targets.take() as target:
            live_map = Path(f"/dev/shm/llmobs.{target.pid}")
            agent = Agent("--pid", str(target.pid), "--duration", "0.5", "--out", str(tmp_path / "e.parquet"))
            code, text = agent.finish()
            assert live_map.exists()  # a live process's map is never touched
        assert code == 0, text
        assert not stale.exists()
        assert "stale map(s) left by dead processes" in text
    finally:
        stale.unlink(missing_ok=True)


def _one_line_error(args: list[str], code: int, *, user: str | None = None) -> str:
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user else []
    result = subprocess.run([*prefix, *AGENT, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("hint: "))
    return lines[0]


def test_no_such_pid():
    assert "no process with pid" in _one_line_error(["--pid", "999999999"], 3)


def test_not_a_pytorch_process():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert "not a PyTorch process" in _one_line_error(["--pid", str(sleeper.pid)], 7)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_not_root():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert "needs root" in _one_line_error(["--pid", str(sleeper.pid)], 4, user="65534")
    finally:
        sleeper.kill()
        sleeper.wait()


def test_bad_profile_is_a_usage_error():
    assert "unknown profile" in _one_line_error(["--pid", "1", "--profile", "cpu,gpu"], 2)


@pytest.mark.parametrize("with_pid", [False, True])
def test_ebpf_prints_the_program(with_pid, targets):
    if with_pid:
        with targets.take() as target:
            result = subprocess.run(
                [*AGENT, "--pid", str(target.pid), "--profile", "cpu,cuda", "--ebpf"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        assert "/* skipped cuLaunchKernel: no library matching" in result.stdout
        assert "LLMOBS_CALL_POINT(cuLaunchKernel" not in result.stdout  # nothing to attach it to here
    else:
        result = subprocess.run(
            [*AGENT, "--profile", "cpu,cuda", "--ebpf"], capture_output=True, text=True, timeout=60
        )
        assert "LLMOBS_CALL_POINT(cuLaunchKernel, LLMOBS_PROBE_cuLaunchKernel" in result.stdout
    assert result.returncode == 0, result.stderr
    assert "int uprobe__linear(struct pt_regs *ctx)" in result.stdout
    assert "BPF_RINGBUF_OUTPUT(llmobs_events" in result.stdout
