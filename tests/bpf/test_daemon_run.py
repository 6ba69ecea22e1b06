"""`llmobs-agent run` as a real daemon (subprocess, tmp config/store/run dir) over real PyTorch workloads.

Each test selects only its own workloads (a command regex on a unique token in their --session), binds
its own NOTIFY_SOCKET, and synchronises on the daemon's stderr lines and sd_notify datagrams, the
workloads' ready/done pipes, and bpftool's view of the kernel: no sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import duckdb
import pytest
from test_cpu_priority import enter_together, policies

from bench.held_workload import HeldWorkload

pytest.importorskip("bcc")
from bench.rotel_harness import Rotel

LINE_TIMEOUT_S = 40.0
REQUESTS, TOKENS = 2, 8


def bpftool_json(*args: str) -> list[dict]:
    out = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout or "[]")


def uprobes_of(agent_pid: int) -> list[dict]:
    """The perf-event uprobes the agent process holds open on targets (bcc 0.26 attaches through the
    uprobe PMU). The agent's calibration probes on its own file are not a target's: left out."""
    return [
        e
        for e in bpftool_json("perf")
        if e.get("pid") == agent_pid and e.get("fd_type") == "uprobe" and target_of(e)
    ]


def perf_fds(pid: int) -> int:
    """The perf-event descriptors a process holds (one per attached uprobe / tracepoint)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == "anon_inode:[perf_event]"
    return count


def wait_calibration_released(agent_pid: int, timeout: float = 30.0) -> None:
    """The calibration's own uprobes are released in a background thread after start (each waits for an
    RCU grace period; seconds on a loaded host): until they are, they hold perf-event fds too."""
    deadline = time.monotonic() + timeout
    while any(
        "llmobs-calibrate" in e.get("filename", "") for e in bpftool_json("perf") if e.get("pid") == agent_pid
    ):
        assert time.monotonic() < deadline, "the calibration's uprobes were not released"
        time.sleep(0.1)  # polling a kernel listing, bounded by the deadline


def target_of(entry: dict) -> int:
    """bcc names a per-pid uprobe's file through /proc/<target pid>/root/..."""
    match = re.match(r"/proc/(\d+)/root/", entry.get("filename", ""))
    return int(match.group(1)) if match else 0


class Daemon:
    """`llmobs-agent run --config FILE` with its stderr lines and a notify socket read by the test."""

    def __init__(self, tmp_path: Path, config: str, env: dict | None = None):
        self.config = tmp_path / "agent.toml"
        self.config.write_text(config)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp_path / "notify.sock"))
        # read like systemd does, all along: an unread socket's queue fills and later datagrams are lost
        self.datagrams: list[list[str]] = []
        self._arrived = threading.Condition()
        self._reader = threading.Thread(target=self._read_notify, daemon=True)
        self._reader.start()
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
            "LLMOBS_CONFIG": "",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmobs.cli", "run", "--config", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.lines: list[str] = []
        self._buffer = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_line(self, pattern: str, timeout: float = LINE_TIMEOUT_S) -> re.Match:
        """The next stderr line matching `pattern` (earlier lines are kept in self.lines)."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            while b"\n" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\n", 1)
                line = raw.decode(errors="replace")
                self.lines.append(line)
                match = regex.search(line)
                if match:
                    return match
            left = deadline - time.monotonic()
            readable, _, _ = select.select([self.proc.stderr], [], [], max(left, 0))
            assert readable, f"no line matching {pattern!r} within {timeout} s; got:\n" + "\n".join(
                self.lines
            )
            chunk = os.read(self.proc.stderr.fileno(), 65536)
            assert chunk, f"the daemon exited ({self.proc.wait()}) before {pattern!r}:\n" + "\n".join(
                self.lines
            )
            self._buffer += chunk

    def _read_notify(self) -> None:
        while True:
            try:
                data = self.notify.recv(4096)
            except OSError:  # closed by the test
                return
            with self._arrived:
                self.datagrams.append(data.decode().split("\n"))
                self._arrived.notify_all()

    def wait_notify(self, key: str, timeout: float = LINE_TIMEOUT_S) -> list[str]:
        """The first datagram (since the daemon started) holding `key`."""

        def found():
            return next((fields for fields in self.datagrams if key in fields), None)

        with self._arrived:
            fields = self._arrived.wait_for(found, timeout)
        assert fields, f"no {key} on NOTIFY_SOCKET within {timeout} s: {self.datagrams}"
        return fields

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        _, rest = self.proc.communicate(timeout=60)
        self.lines += (self._buffer + rest).decode(errors="replace").splitlines()
        self._buffer = b""
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)  # its stacks, for the failure's report
            with contextlib.suppress(AssertionError):
                self.wait_line(r"^Current thread", timeout=5)
                self.wait_line(r"_run_module_as_main", timeout=2)  # the bottom of the main thread's stack
            print("\n".join(self.lines), file=sys.stderr)  # shown by pytest with the failure
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.notify.shutdown(socket.SHUT_RDWR)
        self.notify.close()
        self._reader.join(timeout=10)


def config_text(tmp_path: Path, token: str, extra: str = "") -> str:
    return (
        f'[store]\npath = "{tmp_path / "store.duckdb"}"\n'
        f'[daemon]\nrun_dir = "{tmp_path / "run"}"\n'
        f'[select]\ncommand = "{token}"\n'
        "[discovery]\ninterval_s = 0.2\n"
        # the whole budget: the governor must not shed a probe these tests count
        "[overhead]\nbudget = 1.0\n"
        f'[probes]\nprofiles = ["cpu", "host"]\n{extra}'
    )


class Workload(HeldWorkload):
    """HeldWorkload that, when the test fails before `generate()`, kills the process instead of waiting for
    a generation nobody started."""

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is not None and self.process.poll() is None:
            self.process.kill()
        super().__exit__(exc_type, *rest)


def workload(token: str) -> Workload:
    return Workload(
        "--model", "tiny", "--requests", str(REQUESTS), "--max-new-tokens", str(TOKENS), "--session", token
    )


def token_steps_by_pid(db: Path) -> dict[int, int]:
    with duckdb.connect(str(db), read_only=True) as conn:
        return dict(conn.execute("SELECT pid, count(*) FROM token_steps GROUP BY pid").fetchall())


def test_two_workloads_on_one_program_detach_on_exit_and_drain_on_sigterm(tmp_path):
    token = f"llmobs-daemon-{uuid.uuid4().hex[:10]}"
    first, second = workload(f"{token}-a"), workload(f"{token}-b")
    enter_together(first, second)
    first_running = True
    try:
        daemon = Daemon(tmp_path, config_text(tmp_path, token))
        try:
            ready = daemon.wait_notify("READY=1")
            assert f"MAINPID={daemon.pid}" in ready
            attached = {int(daemon.wait_line(r"attach pid (\d+) ").group(1)) for _ in range(2)}
            assert attached == {first.pid, second.pid}
            # its loop runs under SCHED_IDLE (overhead.cpu_priority's default), every thread of it
            assert set(policies(daemon.pid).values()) == {os.SCHED_IDLE}

            # ONE program: every uprobe of both targets runs the same BPF program id, which is the
            # daemon's own uprobe__linear (its status file says which id it loaded)
            probes = uprobes_of(daemon.pid)
            assert sorted(target_of(e) for e in probes) == sorted([first.pid, second.pid])
            assert len({e["prog_id"] for e in probes}) == 1
            status = json.loads((tmp_path / "run" / "daemon.json").read_text())
            assert status["program"]["ids"]["uprobe__linear"] == probes[0]["prog_id"]
            loaded = [p for p in bpftool_json("prog", "show") if p.get("name") == "uprobe__linear"]
            assert probes[0]["prog_id"] in {p["id"] for p in loaded}

            first.generate()
            second.generate()
            wait_calibration_released(daemon.pid)  # its fds would leave during the count below
            fds_with_both = perf_fds(daemon.pid)
            first.__exit__(None, None, None)  # the first workload exits: detached, its probes gone
            first_running = False
            daemon.wait_line(rf"detach pid {first.pid} .*: exited; ")
            left = uprobes_of(daemon.pid)
            assert [target_of(e) for e in left] == [second.pid], left
            # its perf-event fds were closed too: exactly as many fewer as it had uprobes
            assert perf_fds(daemon.pid) == fds_with_both - (len(probes) - len(left))
            assert not (tmp_path / "run" / f"attach.{first.pid}.json").exists()

            assert daemon.stop(signal.SIGTERM) == 0, "\n".join(daemon.lines)
            assert daemon.wait_notify("STOPPING=1")
        finally:
            daemon.close()
            second.__exit__(*sys.exc_info())
    finally:
        if first_running:
            first.__exit__(*sys.exc_info())
    assert any(re.search(rf"detach pid {second.pid} .*agent stopping \(SIGTERM\)", x) for x in daemon.lines)
    assert uprobes_of(daemon.pid) == []
    # every token step of both workloads is in the store, committed before the daemon exited
    assert token_steps_by_pid(tmp_path / "store.duckdb") == {
        first.pid: REQUESTS * TOKENS,
        second.pid: REQUESTS * TOKENS,
    }
    with duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True) as conn:
        tagged = conn.execute(
            "SELECT pid, sum(count) FROM probe_aggregates"
            " WHERE probe = 'linear' AND step_seq <> 0 GROUP BY pid"
        ).fetchall()
    assert {pid for pid, count in tagged if count > 0} == {first.pid, second.pid}


def test_sighup_with_changed_selector_detaches_and_a_bad_config_is_kept_out(tmp_path):
    token = f"llmobs-daemon-{uuid.uuid4().hex[:10]}"
    with workload(token) as target:
        daemon = Daemon(tmp_path, config_text(tmp_path, token), env={"WATCHDOG_USEC": "400000"})
        try:
            daemon.wait_notify("READY=1")
            daemon.wait_notify("WATCHDOG=1")  # every WATCHDOG_USEC / 2 from the main loop
            daemon.wait_line(rf"attach pid {target.pid} ")
            assert [target_of(e) for e in uprobes_of(daemon.pid)] == [target.pid]

            # a bad new config: logged, the running one kept (still attached)
            daemon.config.write_text(config_text(tmp_path, token, "sample_n = 0\n"))
            daemon.proc.send_signal(signal.SIGHUP)
            line = daemon.wait_line(r"reload failed, keeping the running config: (.*)").group(1)
            assert line.startswith("probes.sample_n = 0 (from file ")
            assert [target_of(e) for e in uprobes_of(daemon.pid)] == [target.pid]

            # a selector that no longer matches: detached, no probe left
            daemon.config.write_text(config_text(tmp_path, f"{token}-nothing-matches"))
            daemon.proc.send_signal(signal.SIGHUP)
            daemon.wait_line(r"reload: select\.command$")
            daemon.wait_line(rf"detach pid {target.pid} .*: no longer selected; ")
            assert uprobes_of(daemon.pid) == []

            # and back: attached again on the next scan
            daemon.config.write_text(config_text(tmp_path, token))
            daemon.proc.send_signal(signal.SIGHUP)
            daemon.wait_line(rf"attach pid {target.pid} ")
            reloads = sum("RELOADING=1" in fields for fields in daemon.datagrams)
            assert reloads == 3  # one per SIGHUP, each followed by READY=1
            target.generate()  # (HeldWorkload's exit expects the generation done)
            assert daemon.stop(signal.SIGINT) == 0
        finally:
            daemon.close()
    assert uprobes_of(daemon.pid) == []


def test_otlp_export_runs_while_attached_and_finishes_on_sigterm(tmp_path):
    token = f"llmobs-daemon-{uuid.uuid4().hex[:10]}"
    with Rotel(tmp_path / "rotel") as collector:
        with workload(token) as target:
            otlp = f'[otlp]\nendpoint = "{collector.grpc_endpoint}"\n'
            daemon = Daemon(tmp_path, config_text(tmp_path, token) + otlp)
            try:
                daemon.wait_line(rf"running: .*, otlp {re.escape(collector.grpc_endpoint)}$")
                daemon.wait_line(rf"attach pid {target.pid} ")
                target.generate()
                assert daemon.stop(signal.SIGTERM) == 0, "\n".join(daemon.lines)
            finally:
                daemon.close()
        collector.stop()  # SIGTERM: rotel writes out everything it accepted
        steps = [span for span in collector.spans() if span.name == "gen_ai.token_step"]
    sent = next(line for line in daemon.lines if "otlp: " in line and "spans sent" in line)
    # a span per token step and one per request, all acknowledged
    assert f"otlp: {REQUESTS * TOKENS + REQUESTS:,} spans sent, 0 failed attempts" in sent, daemon.lines
    assert len(steps) == REQUESTS * TOKENS
    assert {span.attributes["llmobs.tenant"] for span in steps} == {"demo"}
