"""Issue 8, reliability: targets coming and going under the real daemon leave nothing behind.

`llmobs-agent run` (a subprocess, its own config, store and run dir) selects the test's targets by a
token in their command line. Targets are the cheap libc10 processes of test_reliability_cycles (a real
process mapping the wheel's libc10.so and calling the real c10::alloc_cpu/free_cpu), started in waves,
attached by the daemon on its one shared program, made to call the probed functions, then SIGKILLed;
the daemon notices each death and detaches. After every wave: no uprobe of the daemon's is left on a
dead target, no target in its status file, no live snapshot file left in its run dir. Between the first
and the last wave: the daemon's open fds do not grow and its RSS stays within a bound. Each detach line
reports exactly the events the target's calls made, so nothing passes by not attaching.

WAVES x PER_WAVE targets (60) rather than 100: the daemon notices deaths on its 1 s tick and detaching
costs the kernel ~0.1 s per uprobe (an RCU grace period), so 100 targets take more than a minute;
test_reliability_cycles runs 100 cycles of the same per-target work in-process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid

from test_reliability_cycles import CheapTarget
from test_reliability_outage import Daemon

WAVES, PER_WAVE = 6, 10
CALLS = 40  # alloc_cpu/free_cpu pairs per target: 2 events each (alloc timed at its return, free)
RSS_GROWTH_BOUND = 24 << 20  # bytes, after wave 1 -> after the last wave


def _config(tmp_path, token: str):
    path = tmp_path / "agent.toml"
    path.write_text(
        f'[store]\npath = "{tmp_path / "store.duckdb"}"\n'
        f'[daemon]\nrun_dir = "{tmp_path / "run"}"\n'
        f'[select]\ncommand = "{token}"\n'
        "[discovery]\ninterval_s = 0.1\n"
        '[probes]\nprofiles = ["mem"]\n'
    )
    return path


def _uprobes_of(pid: int) -> list[dict]:
    out = subprocess.run(["bpftool", "-j", "perf"], capture_output=True, text=True, timeout=30, check=True)
    return [e for e in json.loads(out.stdout or "[]") if e.get("pid") == pid and e.get("fd_type") == "uprobe"]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_waves_of_targets_started_attached_killed_leave_nothing_in_the_daemon(tmp_path):
    token = f"llmobs-cycles-{uuid.uuid4().hex[:10]}"
    daemon = Daemon(_config(tmp_path, token))
    seen: dict[str, tuple[int, int]] = {}
    try:
        daemon.wait_line("running: store")
        for wave in range(1, WAVES + 1):
            targets = [CheapTarget(token) for _ in range(PER_WAVE)]
            try:
                for target in targets:
                    daemon.wait_line(f"attach pid {target.pid} ")
                for target in targets:
                    target.calls(CALLS)
            finally:
                for target in targets:
                    target.kill()
            for target in targets:
                line = daemon.wait_line(f"detach pid {target.pid} ")
                match = re.search(r"; ([\d,]+) events", line)
                assert match, line
                events = int(match.group(1).replace(",", ""))
                assert events == 2 * CALLS, line
            assert [e for e in _uprobes_of(daemon.proc.pid)] == [], f"wave {wave}: uprobes left"
            status = json.loads((tmp_path / "run" / "daemon.json").read_text())
            assert status["targets"] == [], f"wave {wave}: {status['targets']}"
            assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["daemon.json"]
            if wave in (1, WAVES):
                seen[f"wave {wave}"] = (_fds(daemon.proc.pid), daemon.rss())
        assert daemon.stop() == 0, "\n".join(daemon.lines)
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
    (fds_first, rss_first), (fds_last, rss_last) = seen["wave 1"], seen[f"wave {WAVES}"]
    print(f"\ndaemon after wave 1 / wave {WAVES}: fds {fds_first}/{fds_last}, "
          f"RSS {rss_first >> 10}/{rss_last >> 10} KiB")  # fmt: skip
    assert fds_last <= fds_first, seen
    assert rss_last - rss_first <= RSS_GROWTH_BOUND, seen
    assert f"{WAVES * PER_WAVE} target(s) detached in all" in daemon.lines[-1], daemon.lines[-3:]
