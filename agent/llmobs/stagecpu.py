"""Where the agent's own CPU goes, by stage: what a token step costs the agent, and in which part.

The drain loop's stages (map read, ring drain, store submit, live stats, detectors, aggregates,
snapshot, governor, telemetry, NVML) are timed on the main thread with CLOCK_THREAD_CPUTIME_ID
(time.thread_time_ns) around each stage of a batch, never per step: one clock read per stage per
poll, chained (`t = STAGES.charge("map_read", t)`). The correlate thread charges correlate and
evidence the same way. Every other agent thread (the store writer, the OTLP follower, the anomaly
writer, NVML, Parquet) is charged whole, by its name, from its own CPU clock
(pthread_getcpuclockid), read when a snapshot is taken; a thread's last reading is kept after it
ends, so a snapshot after close still counts it. `other` is the process's CPU not in any stage
(the interpreter's own threads, the loop itself, imports and attach before the window).

`STAGES` is the process's one account (an agent process is one runtime; a daemon's pipelines share
it, and per token step means per token step of all of them). `snapshot()` is cumulative since
`mark()`; a benchmark diffs two snapshots (attach publishes it in the self-telemetry: the `top`
snapshot file's agent.stage_cpu).
"""

from __future__ import annotations

import os
import threading
import time

# whole-thread stages: thread name -> stage (threads not named here count as `other`)
THREAD_STAGES = {
    "llmobs-store-writer": "store_writer",
    "llmobs-otlp": "otlp",
    "llmobs-anomalies": "anomaly_writer",
    "llmobs-nvml": "nvml",
    "llmobs-parquet": "parquet",
    "llmobs-train-heatmap": "training",
}  # fmt: skip
# threads whose work charges explicit stages (their CPU is not charged whole a second time)
EXPLICIT_THREADS = ("llmobs-correlate",)
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_ns() -> int:
    """User + system CPU of this process (all threads), in ns."""
    return time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID)


class StageCpu:
    """Cumulative CPU by stage; charge() is called with the thread CPU clock read before the stage."""

    def __init__(self):
        self._lock = threading.Lock()
        self.mark()

    def mark(self) -> None:
        """Starts the account afresh (the Agent calls it once the targets are attached)."""
        with self._lock:
            self.ns: dict[str, int] = {}
            self.counts: dict[str, int] = {}  # work counted beside the CPU (steps, skipped runs...)
            self._threads: dict[int, tuple[str, int, int]] = {}  # ident -> (stage, ns at mark, last ns)
            self._native: dict[int, tuple[int, int]] = {}  # tid -> (ticks at mark, last ticks)
            self._process0 = process_cpu_ns()
            self._wall0 = time.monotonic()
            self._threads_now(at_mark=True)
            self._native_now(at_mark=True)

    @staticmethod
    def now() -> int:
        return time.thread_time_ns()

    def charge(self, stage: str, began_ns: int) -> int:
        """Adds this thread's CPU since `began_ns` to `stage`; returns the clock now (the next start)."""
        now = time.thread_time_ns()
        ns = self.ns
        ns[stage] = ns.get(stage, 0) + now - began_ns  # GIL-atomic enough: a lost race costs one sample
        return now

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _threads_now(self, at_mark: bool = False) -> None:
        for thread in threading.enumerate():
            stage = THREAD_STAGES.get(thread.name)
            if stage is None or thread.ident is None:
                continue
            try:
                ns = time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
            except (OSError, ValueError, OverflowError):  # the thread ended just now
                continue
            known = self._threads.get(thread.ident)
            if known is not None and (known[0] != stage or ns < known[2]):  # a new thread, same ident
                self.ns[known[0]] = self.ns.get(known[0], 0) + known[2] - known[1]
                known = None
            if known is None:  # running at the mark: charged from the mark on
                self._threads[thread.ident] = (stage, ns if at_mark else 0, ns)
            else:
                self._threads[thread.ident] = (stage, known[1], ns)

    def _native_now(self, at_mark: bool = False) -> None:
        """Threads Python does not know (DuckDB's workers, bcc's): charged to `native_threads` from
        /proc/self/task (clock ticks: fine at a reading a second)."""
        python = {t.native_id for t in threading.enumerate()}
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return
        for tid in tids:
            if tid in python:
                continue
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            ticks = int(fields[11]) + int(fields[12])
            known = self._native.get(tid)
            self._native[tid] = (known[0] if known else ticks if at_mark else 0, ticks)

    def snapshot(self) -> dict:
        """{"cpu_s": process CPU since mark, "wall_s", "stages": {stage: CPU s}, "counts": {...}}."""
        with self._lock:
            self._threads_now()
            self._native_now()
            stages = {k: v / 1e9 for k, v in self.ns.items()}
            native = sum(last - first for first, last in self._native.values()) / _CLK_TCK
            if native:
                stages["native_threads"] = native
            for stage, first, last in self._threads.values():
                stages[stage] = stages.get(stage, 0.0) + (last - first) / 1e9
            cpu_s = (process_cpu_ns() - self._process0) / 1e9
            stages["other"] = max(cpu_s - sum(stages.values()), 0.0)
            return {"cpu_s": cpu_s, "wall_s": time.monotonic() - self._wall0, "stages": stages,
                    "counts": dict(self.counts)}  # fmt: skip


STAGES = StageCpu()


def per_step_table(snapshot: dict, steps: int) -> list[str]:
    """The summary's table: each stage's CPU in us per token step and in % of a core."""
    wall = max(snapshot["wall_s"], 1e-9)
    cpu = snapshot["cpu_s"]
    per = (lambda s: f"{s * 1e6 / steps:9.1f}") if steps else (lambda _s: "        -")
    lines = [
        f"agent CPU: {cpu:.2f} s in {wall:.1f} s ({100 * cpu / wall:.1f}% of a core), {steps:,} token steps"
        + (f", {cpu * 1e6 / steps:.1f} us per token step" if steps else ""),
        f"  {'stage':<16} {'CPU s':>8} {'us/step':>9} {'% core':>7}",
    ]
    for stage, seconds in sorted(snapshot["stages"].items(), key=lambda kv: -kv[1]):
        if seconds >= 0.0005:
            lines.append(f"  {stage:<16} {seconds:8.3f} {per(seconds)} {100 * seconds / wall:7.2f}")
    counts = {k: v for k, v in snapshot.get("counts", {}).items() if v}
    if counts:
        lines.append("  " + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())))
    return lines
