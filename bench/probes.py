"""Benchmarks of the eBPF probe layer, each printed as ratios measured side by side in one run.

  cost      per-hit cost of each llmobs probe where it sits, as a ratio against an empty probe of the
            same kind (uprobe, uprobe+uretprobe, tracepoint) on the same function in the same run,
            the target mid-step (tagged hits); the thinned probes also with --thin 1; plus sgemm_ at
            +0 (endbr64, single-stepped) vs +4 (push, emulated) to show why placement matters.
            Rounds are interleaved: none / empty / llmobs, repeated, medians compared.
  ingest    ring-buffer decode rate on one core (ring -> numpy, and -> Arrow columns as stored) from a
            tracepoint flood (a C loop of ioctl(2) on /dev/null), and whether drops appear at the
            flood's rate with the agent's 20 ms drain.
  workload  tokens/s of SmolLM2-135M (scripts/workload.py's model, instrumented) with and without
            `llmobs-agent attach` (default profiles), generate and teacher-forced forward, 1 and 2
            torch threads, interleaved; the ratio with/without.
  probes-only  the same workload with the default probes attached by this script (no agent process):
            none / sgemm uprobe / host tracepoints / all, interleaved; the probes' own cost.
  latency   `llmobs-agent attach --pid` to its first event, from the agent's process start.

Run as root: `.venv/bin/python -m bench.probes [--only cost,ingest,workload,probes-only,latency]
[--json PATH]`.
Tables, ratios and their 95% intervals are bench/harness.py's. Machines here are shared and noisy: read
the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes as ct
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Arm, Report, Stopwatch, add_json_option

ROOT = Path(__file__).resolve().parents[1]
AGENT = [sys.executable, "-m", "llmobs.cli", "attach"]


# ---------------------------------------------------------------------------------------------------------
# the target processes (this script re-run with --target / --workload-target)
# ---------------------------------------------------------------------------------------------------------
def run_target() -> int:
    """Loops of known calls, timed inside the target: `KIND N` -> ns per iteration. The target is mid-step
    (its map's context cell holds a step), so every hit is tagged and reads the cell, as a workload's
    hits inside a forward pass do (before session 18 the cost rows were of untagged hits: no cell)."""
    import fcntl
    import mmap
    import termios

    import torch
    import torch.nn.functional as F
    from llmobs.shm.writer import ShmWriter

    writer = ShmWriter()  # /dev/shm/llmobs.<pid>: the cell the program reads
    writer.begin_step(0x1234, 0x5678, 0, 0)

    torch.set_num_threads(1)
    w = torch.randn(8, 8)
    x = torch.randn(1, 8)
    null_fd = os.open("/dev/null", os.O_RDONLY)
    arg = bytearray(4)

    def alloc():
        torch.empty(64, dtype=torch.uint8)  # one alloc_cpu + one free_cpu

    def gemm():
        F.linear(x, w)  # one sgemm_ (+ one alloc/free of the output)

    def fault():
        m = mmap.mmap(-1, 16 * 4096)
        for page in range(16):  # 16 first-touch page faults
            m[page * 4096] = 1
        m.close()

    def ioctl():
        with contextlib.suppress(OSError):
            fcntl.ioctl(null_fd, termios.FIONREAD, arg)

    loops = {"alloc": alloc, "gemm": gemm, "fault": fault, "ioctl": ioctl}
    with torch.no_grad():
        for fn in loops.values():
            fn()
        print("ready", flush=True)
        for line in sys.stdin:
            kind, n = line.split()
            fn = loops[kind]
            began = time.perf_counter_ns()
            for _ in range(int(n)):
                fn()
            print((time.perf_counter_ns() - began) / int(n), flush=True)
    writer.close()
    return 0


def run_workload_target() -> int:
    """SmolLM2, instrumented like llmobs.workloads: `gen TOKENS THREADS` / `fwd TOKENS THREADS`."""
    import llmobs
    import torch
    from llmobs.workloads import generate as workload  # PROMPTS, encode, generate_once, load_model

    model, tokenizer, model_id = workload.load_model("smollm2")
    llmobs.instrument(model, tokenizer, model_id=model_id)
    prompt = workload.PROMPTS[1]
    text = " ".join(workload.PROMPTS) * 4
    with torch.no_grad():
        workload.generate_once(model, tokenizer, [prompt], 2)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        mode, tokens, threads = line.split()
        torch.set_num_threads(int(threads))
        with llmobs.context(tenant="bench", session="bench"):
            began, cpu_began = time.perf_counter(), time.process_time()
            if mode == "gen":
                workload.generate_once(model, tokenizer, [prompt], int(tokens))
                done = int(tokens)
            else:  # teacher-forced: one forward over the sequence, with labels (every position a step)
                ids, mask = workload.encode(tokenizer, [text])
                ids, mask = ids[:, : int(tokens)], mask[:, : int(tokens)]
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask, labels=ids)
                done = ids.shape[1]
            wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
            print(f"{done / wall} {done / cpu}", flush=True)
    return 0


class Child:
    """A target process driven line by line with bounded waits."""

    def __init__(self, flag: str, timeout: float = 180.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.probes", flag], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=ROOT,
        )  # fmt: skip
        self.pid = self.proc.pid
        assert self.readline(timeout) == "ready"

    def readline(self, timeout: float = 300.0) -> str:
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not readable:
            raise TimeoutError("target did not answer")
        return self.proc.stdout.readline().strip()

    def ask(self, line: str) -> float:
        return self.ask_all(line)[0]

    def ask_all(self, line: str) -> list[float]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return [float(v) for v in self.readline().split()]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------------------------
# cost per hit
# ---------------------------------------------------------------------------------------------------------
class EmptyProbes:
    """bpf/c/bench_empty.bpf.c: the empty uprobe / uretprobe / tracepoint baselines."""

    def __init__(self):
        from bcc import BPF
        from llmobs.bpf.program import bpf_dir

        text = (bpf_dir() / "bench_empty.bpf.c").read_text()
        text += "\n/* an empty tracepoint program */\nint tracepoint_empty(void *args)\n{\n    return 0;\n}\n"
        self.bpf = BPF(text=text.encode())

    def attach(self, path: str, addr: int, pid: int, timed: bool) -> list[bytes]:
        before = set(self.bpf.uprobe_fds)
        self.bpf.attach_uprobe(name=path.encode(), addr=addr, fn_name=b"uprobe__empty", pid=pid)
        if timed:
            self.bpf.attach_uretprobe(name=path.encode(), addr=addr, fn_name=b"uretprobe__empty", pid=pid)
        return list(set(self.bpf.uprobe_fds) - before)

    def detach(self, events: list[bytes]) -> None:
        for ev in events:
            self.bpf.detach_uprobe_event(ev)


def prog_stats(fds: list[int]) -> tuple[int, int]:
    """(run_time_ns, run_cnt) summed over BPF program fds, from /proc/self/fdinfo (bpf_stats_enabled)."""
    total_ns = total_cnt = 0
    for fd in fds:
        for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "run_time_ns":
                total_ns += int(value)
            elif key == "run_cnt":
                total_cnt += int(value)
    return total_ns, total_cnt


class BpfStats:
    """kernel.bpf_stats_enabled=1 for the benchmark's duration (restored after)."""

    path = Path("/proc/sys/kernel/bpf_stats_enabled")

    def __enter__(self):
        self.previous = self.path.read_text().strip()
        self.path.write_text("1")
        return self

    def __exit__(self, *exc):
        self.path.write_text(self.previous)


def bench_cost(rounds: int, report: Report) -> None:
    with BpfStats():
        _bench_cost(rounds, report)


def _bench_cost(rounds: int, report: Report) -> None:
    from llmobs.bpf.libraries import ResolvedProbe, mapped_libraries, resolve
    from llmobs.bpf.profiles import PROBES, probes_of
    from llmobs.bpf.program import Attached, ProbeProgram, ctx_offset
    from llmobs.bpf.records import DEFAULT_THIN
    from llmobs.bpf.ringbuf import RingConsumer
    from llmobs.bpf.session import find_context_cell
    from llmobs.procfs import ProcFS

    target = Child("--target")
    procfs = ProcFS()
    entries = procfs.maps(target.pid)
    paths = mapped_libraries(entries)
    by_name = {probe.name: probe for probe in PROBES}
    program = ProbeProgram(probes_of(("cpu", "gemm", "mem", "host")))
    program.set_target(target.pid, find_context_cell(target.pid, entries, ctx_offset()))
    program.set_watched_fds(target.pid, {fd for fd, p in procfs.fds(target.pid).items() if p == "/dev/null"})
    empty = EmptyProbes()
    ring = RingConsumer(program.map_fd("llmobs_events"), program.ring_bytes)

    def fds(bpf, names):
        return [
            bpf.load_func(n.encode(), bpf.TRACEPOINT if n.startswith("tracepoint") else bpf.KPROBE).fd
            for n in names
        ]  # noqa: E731

    def uprobe_case(name: str, loop: str, durations: bool = False):
        resolved = resolve(by_name[name], target.pid, paths, procfs)
        assert isinstance(resolved, ResolvedProbe), resolved
        optional = durations and resolved.probe.optional_duration
        timed = resolved.probe.timed or optional
        attached = Attached()
        entry = f"uprobe__{name}_timed" if optional else f"uprobe__{name}"
        ours_names = [entry] + ([f"uretprobe__{name}"] if timed else [])
        empty_names = ["uprobe__empty"] + (["uretprobe__empty"] if timed else [])
        return {
            "label": name,
            "where": resolved.placement.describe().split(" (")[0] + (" entry+return" if timed else " entry"),
            "loop": loop,
            "hits": 1,
            "attach_empty": lambda: empty.attach(resolved.path, resolved.address, target.pid, timed),
            "detach_empty": empty.detach,
            "attach_ours": lambda: (
                program.attach_uprobe(resolved, target.pid, attached, durations) or attached
            ),
            "detach_ours": program.detach,
            "fds_empty": fds(empty.bpf, empty_names),
            "fds_ours": [program.prog_fd(n) for n in ours_names],
        }

    def tracepoint_case(name: str, loop: str, hits: int):
        probe = by_name[name]
        tps = [tp.encode() for tp, _ in probe.tracepoints]
        attached = Attached()

        def attach_empty():
            for tp in tps:
                empty.bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint_empty")
            return tps

        def detach_empty(handle):
            for tp in handle:
                empty.bpf.detach_tracepoint(tp)

        return {
            "label": name,
            "where": "+".join(tp.decode().split(":")[1] for tp in tps),
            "loop": loop,
            "hits": hits,
            "attach_empty": attach_empty,
            "detach_empty": detach_empty,
            "attach_ours": lambda: program.attach_tracepoints(probe, attached) or attached,
            "detach_ours": program.detach,
            "fds_empty": fds(empty.bpf, ["tracepoint_empty"]),
            "fds_ours": [program.prog_fd(fn) for _, fn in probe.tracepoints],
        }

    cases = [
        uprobe_case("linear", "gemm"),
        uprobe_case("sgemm", "gemm"),
        uprobe_case("sgemm", "gemm", durations=True),
        uprobe_case("alloc_cpu", "alloc"),
        uprobe_case("free_cpu", "alloc"),
        tracepoint_case("page_fault_user", "fault", 16),
        tracepoint_case("ioctl", "ioctl", 1),
    ]

    def switched_off(case: dict, name: str) -> dict:
        """The same probe attached with its switch word off (the governor's shed of a tracepoint): what
        a disabled hit costs - the dispatch and the word's lookup."""
        attach, detach = case["attach_ours"], case["detach_ours"]

        def attach_off():
            handle = attach()
            program.set_probe_enabled(name, False)
            return handle

        def detach_off(handle):
            detach(handle)
            program.set_probe_enabled(name, True)

        label = f"{case['label']} (off)"
        return {**case, "label": label, "attach_ours": attach_off, "detach_ours": detach_off}

    rows = []
    for sample_n in (1, 16):
        program.set_sampling(sample_n, "cpu", DEFAULT_THIN)
        for case in cases:
            rows.append((sample_n, _measure(case, target, rounds, ring, report)))
    program.set_sampling(1, "cpu", 1)  # the thinned probes shipping every event, as before --thin
    for case in (cases[0], cases[-2]):
        unthinned = {**case, "label": f"{case['label']} (thin 1)"}
        rows.append((1, _measure(unthinned, target, rounds, ring, report)))
    program.set_sampling(1, "cpu", DEFAULT_THIN)
    for case, name in ((cases[0], "linear"), (cases[-2], "page_fault_user"), (cases[-1], "ioctl")):
        rows.append((1, _measure(switched_off(case, name), target, rounds, ring, report)))
    report.note("per hit = (median ns/it of the arm - median of none) / hits; wall = llmobs / empty per hit;")
    report.note("by parts = (empty per hit + bpf ours - bpf empty) / empty per hit: the trap costs the same")
    report.note(f"{'sample':>6} {'probe':<16} {'where':<22} {'empty':>7} {'llmobs':>7} {'wall':>6} "
                f"{'bpf empty':>9} {'bpf ours':>9} {'by parts':>8}   (ns/hit, ratios)")  # fmt: skip
    for sample_n, row in rows:
        report.note(f"{sample_n:>6} {row}")
    # placement: sgemm_ at its entry (endbr64: single-stepped) vs +4 (push: emulated), empty uprobes
    sgemm = resolve(by_name["sgemm"], target.pid, paths, procfs)

    def placement(offset: int | None) -> Arm:
        def once(ctx) -> dict[str, float]:
            events = (
                empty.attach(sgemm.path, sgemm.symbol.vaddr + offset, target.pid, False)
                if offset is not None
                else []
            )
            took = target.ask("gemm 5000")
            empty.detach(events)
            return {"ns/it": took}

        return Arm("none" if offset is None else f"+{offset}", once)

    arms = [placement(None), placement(0), placement(4)]
    made = report.compare("placement: an empty uprobe on sgemm_", arms,
                          rounds, metrics=["ns/it"])  # fmt: skip
    none = made.median("none", "ns/it")
    at0, at4 = (made.median(k, "ns/it") - none for k in ("+0", "+4"))
    report.note(f"placement: an empty uprobe on sgemm_ costs {at0:.0f} ns/hit at +0 (endbr64, single-stepped)"
                f" and {at4:.0f} ns/hit at +4 (push, emulated): {at0 / max(at4, 1):.0f}x")  # fmt: skip
    target.close()
    ring.close()
    program.close()


def _measure(case: dict, target: Child, rounds: int, ring, report: Report) -> str:
    """Interleaved rounds none / empty / llmobs on the same loop: the target's ns per iteration and the
    programs' in-kernel run time per hit; returns the per-hit summary row."""
    iters = 2000 if case["loop"] == "fault" else 30000
    hits = case["hits"]

    def arm(name: str) -> Arm:
        def once(ctx) -> dict[str, float]:
            if name == "none":
                return {"ns/it": target.ask(f"{case['loop']} {iters}")}
            handle = case[f"attach_{name}"]()
            before = prog_stats(case[f"fds_{name}"])
            took = target.ask(f"{case['loop']} {iters}")
            after = prog_stats(case[f"fds_{name}"])
            case[f"detach_{name}"](handle)
            ring.drain()
            return {"ns/it": took, "bpf ns/hit": (after[0] - before[0]) / (iters * hits)}

        return Arm("llmobs" if name == "ours" else name, once)

    arms = [arm("none"), arm("empty"), arm("ours")]
    made = report.compare(f"{case['label']} ({case['where']})", arms, rounds,
                          baseline="empty", metrics=["ns/it", "bpf ns/hit"])  # fmt: skip
    none = made.median("none", "ns/it")
    empty = (made.median("empty", "ns/it") - none) / hits
    ours = (made.median("llmobs", "ns/it") - none) / hits
    bpf_empty, bpf_ours = made.median("empty", "bpf ns/hit"), made.median("llmobs", "bpf ns/hit")
    # the noise-robust estimate: the trap costs the same for both; only the program's run time differs
    by_parts = (empty + bpf_ours - bpf_empty) / empty if empty > 0 else float("nan")
    wall = ours / empty if empty > 0 else float("nan")
    return (f"{case['label']:<16} {case['where']:<22} {empty:>7.0f} {ours:>7.0f} {wall:>6.2f} "
            f"{bpf_empty:>9.0f} {bpf_ours:>9.0f} {by_parts:>8.2f}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# ingest
# ---------------------------------------------------------------------------------------------------------
FLOOD_C = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <unistd.h>
int main(int argc, char **argv) {
    long n = atol(argv[1]); int fd = open("/dev/null", O_RDONLY); int v;
    char go; if (read(0, &go, 1) != 1) return 1;   /* start when told: the agent is attached */
    for (long i = 0; i < n; i++) ioctl(fd, FIONREAD, &v);
    return 0;
}
"""


def bench_ingest(report: Report) -> None:
    import numpy as np
    from llmobs.bpf.output import events_table
    from llmobs.bpf.profiles import PROBES
    from llmobs.bpf.program import Attached, ProbeProgram
    from llmobs.bpf.ringbuf import RingConsumer
    from llmobs.procfs import ProcFS

    gcc = shutil.which("gcc") or shutil.which("cc")
    if not gcc:
        report.note("ingest: no C compiler (gcc) here; skipped")
        return
    work = Path(tempfile.mkdtemp(prefix="llmobs-flood-"))
    (work / "flood.c").write_text(FLOOD_C)
    subprocess.run([gcc, "-O2", "-o", str(work / "flood"), str(work / "flood.c")], check=True)
    ioctl_probe = next(p for p in PROBES if p.name == "ioctl")
    program = ProbeProgram([ioctl_probe], ring_bytes=64 << 20)
    ring = RingConsumer(program.map_fd("llmobs_events"), program.ring_bytes)

    def flood(n: int, drain_period: float | None):
        proc = subprocess.Popen([str(work / "flood"), str(n)], stdin=subprocess.PIPE)
        program.reset_maps()
        program.set_target(proc.pid, 0)
        fds = {fd for fd, path in ProcFS().fds(proc.pid).items() if path == "/dev/null"}
        while not fds:  # the flood opens /dev/null before it waits on stdin
            fds = {fd for fd, path in ProcFS().fds(proc.pid).items() if path == "/dev/null"}
        program.set_watched_fds(proc.pid, fds)
        attached = Attached()
        program.attach_tracepoints(ioctl_probe, attached)
        began = time.perf_counter()
        proc.stdin.write(b"g")
        proc.stdin.close()
        drained = 0
        if drain_period is not None:
            while proc.poll() is None:
                drained += len(ring.drain())
                time.sleep(drain_period)
        proc.wait()
        seconds = time.perf_counter() - began
        drained += len(ring.drain()) if drain_period is not None else 0
        program.detach(attached)
        return seconds, drained, program.counters()

    # decode rate: a full ring of records, drained and decoded in batches as the agent does
    n = 800_000  # 57.6 MB of records: fits the 64 MiB ring without a drain
    seconds, _, counters = flood(n, None)
    produced = counters[5]
    batches = []
    with Stopwatch() as drained:
        while True:
            batch = ring.drain(max_records=250_000)
            if not len(batch):
                break
            batches.append(batch)
    t_drain = drained.wall
    events = np.concatenate(batches)
    with Stopwatch() as decoded:
        for start in range(0, len(events), 250_000):
            events_table(events[start : start + 250_000], 1)
    t_arrow = decoded.wall
    numpy_rate, arrow_rate = len(events) / t_drain / 1e6, len(events) / (t_drain + t_arrow) / 1e6
    report.note(f"ring -> numpy records:  {numpy_rate:6.2f} M events/s  ({len(events):,} events,"
                f" {t_drain * 1e3:.0f} ms, one core)")  # fmt: skip
    report.note(f"ring -> Arrow columns:  {arrow_rate:6.2f} M events/s  (records.md"
                f" columns incl. probe/kind strings and trace hex)")  # fmt: skip
    report.note(f"flood rate (kernel side, C ioctl loop): {produced / seconds / 1e6:.2f} M events/s")
    # drops under a live 20 ms drain while the flood runs on the other core
    seconds, drained, counters = flood(3_000_000, 0.02)
    report.note(f"live: {counters[5] + counters[0]:,} events in {seconds:.2f} s "
          f"({(counters[5] + counters[0]) / seconds / 1e6:.2f} M/s), drained {drained:,}, "
          f"kernel drops {counters[0]:,}")  # fmt: skip
    ring.close()
    program.close()
    shutil.rmtree(work)


# ---------------------------------------------------------------------------------------------------------
# workload slowdown and attach latency
# ---------------------------------------------------------------------------------------------------------
class RunningAgent:
    def __init__(self, pid: int, *args: str):
        self.out = tempfile.mkdtemp(prefix="llmobs-bench-")
        self.proc = subprocess.Popen(
            [*AGENT, "--pid", str(pid), "--out", f"{self.out}/e.parquet", *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        while True:
            readable, _, _ = select.select([self.proc.stderr], [], [], 60)
            line = self.proc.stderr.readline() if readable else ""
            if not line:
                raise RuntimeError("agent did not attach")
            if "attached in" in line:
                break

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=60)
        summary = json.loads(Path(self.out, "e.summary.json").read_text())
        shutil.rmtree(self.out)
        return summary


def bench_workload(rounds: int, tokens: int, profile: str, modes: tuple[str, ...], threads_list,
                   report: Report) -> None:  # fmt: skip
    """Wall tokens/s is what users see; tokens per CPU-second of the workload (all its threads) is
    steadier on a shared machine, and includes the probes' traps, which run on the workload's CPU."""
    target = Child("--workload-target", timeout=600)
    for mode, n_tokens in (("gen", tokens), ("fwd", 256)):
        if mode not in modes:
            continue
        for threads in threads_list:
            target.ask(f"{mode} {min(n_tokens, 8)} {threads}")  # settle the thread pool
            _with_and_without_agent(target, f"{mode} {n_tokens} {threads}", n_tokens, profile, rounds, report)
    target.close()


def _with_and_without_agent(target: Child, ask: str, n_tokens: int, profile: str, rounds: int,
                            report: Report) -> None:  # fmt: skip
    hits: dict[str, list[float]] = {}

    def once(with_agent: bool) -> dict[str, float]:
        running = RunningAgent(target.pid, "--profile", profile) if with_agent else None
        wall_rate, cpu_rate = target.ask_all(ask)
        if running:
            for probe, slot in running.stop()["per_probe"].items():
                hits.setdefault(probe, []).append(slot["count"] / n_tokens)
        return {"tok/s": wall_rate, "tok/CPU-s": cpu_rate}

    arms = [Arm("none", lambda ctx: once(False)), Arm("agent", lambda ctx: once(True))]
    mode, _, threads = ask.split()
    report.compare(f"{mode}, {threads} torch thread(s): `attach --profile {profile}` vs none", arms, rounds,
                   better={"tok/s": "higher", "tok/CPU-s": "higher"},
                   metrics=["tok/s", "tok/CPU-s"])  # fmt: skip
    per_token = ", ".join(f"{p} {statistics.median(h):,.0f}" for p, h in sorted(hits.items()))
    report.note(f"  probe hits per token (the agent's exact counts): {per_token}")


def bench_probes_only(rounds: int, tokens: int, threads_list, report: Report) -> None:
    """The default probes' own cost, without the agent process: this script attaches them to the
    workload (rounds interleave none / uprobe only / host tracepoints only / all) and drains the
    ring between rounds. Separates the probes' cost from the agent's CPU use on a 2-core host."""
    from llmobs.bpf.libraries import mapped_libraries, resolve
    from llmobs.bpf.profiles import DEFAULT_PROFILES, PROBES, probes_of
    from llmobs.bpf.program import Attached, ProbeProgram, ctx_offset
    from llmobs.bpf.ringbuf import RingConsumer
    from llmobs.bpf.session import find_context_cell
    from llmobs.procfs import ProcFS

    target = Child("--workload-target", timeout=600)
    procfs = ProcFS()
    entries = procfs.maps(target.pid)
    program = ProbeProgram(probes_of(DEFAULT_PROFILES))
    program.set_target(target.pid, find_context_cell(target.pid, entries, ctx_offset()))
    ring = RingConsumer(program.map_fd("llmobs_events"), program.ring_bytes)
    by_name = {probe.name: probe for probe in PROBES}
    program.close()
    program = ProbeProgram(probes_of((*DEFAULT_PROFILES, "gemm")))
    program.set_target(target.pid, find_context_cell(target.pid, entries, ctx_offset()))
    ring.close()
    ring = RingConsumer(program.map_fd("llmobs_events"), program.ring_bytes)
    linear = resolve(by_name["linear"], target.pid, mapped_libraries(entries), procfs)
    sgemm = resolve(by_name["sgemm"], target.pid, mapped_libraries(entries), procfs)
    names = ("none", "linear uprobe", "host tracepoints", "all default", "sgemm uprobe (gemm)")
    for threads in threads_list:
        target.ask(f"gen 8 {threads}")  # settle the thread pool

        def once(ctx, arm: str, threads=threads) -> dict[str, float]:
            attached = Attached()
            if arm in ("linear uprobe", "all default"):
                program.attach_uprobe(linear, target.pid, attached)
            if arm == "sgemm uprobe (gemm)":
                program.attach_uprobe(sgemm, target.pid, attached)
            if arm in ("host tracepoints", "all default"):
                for name in ("sched_switch", "page_fault_user", "ioctl"):
                    program.attach_tracepoints(by_name[name], attached)
            rate = target.ask(f"gen {tokens} {threads}")
            program.detach(attached)
            ring.drain()
            return {"tok/s": rate}

        arms = [Arm(name, lambda ctx, name=name: once(ctx, name)) for name in names]
        report.compare(f"gen, {threads} thread(s), probes attached by this script", arms, rounds,
                       better={"tok/s": "higher"}, metrics=["tok/s"])  # fmt: skip
    ring.close()
    program.close()
    target.close()


def bench_latency(rounds: int, report: Report) -> None:
    target = Child("--target")

    def once(ctx) -> dict[str, float]:
        loop = subprocess.Popen(  # keep the target busy so a first event exists to be seen
            ["sh", "-c", "while :; do echo 'gemm 2000'; done"], stdout=target.proc.stdin
        )
        running = RunningAgent(target.pid, "--profile", "cpu,host")
        summary = running.stop()
        loop.kill()
        loop.wait()
        return {"from the agent's process start s": summary["first_event_after_process_start_s"],
                "from attach start s": summary["first_event_after_s"]}  # fmt: skip

    report.compare("attach latency to the first event", [Arm("attach --profile cpu,host", once)], rounds,
                   metrics=["from the agent's process start s", "from attach start s"])  # fmt: skip
    target.proc.kill()
    target.proc.wait()


def main() -> int:
    if "--target" in sys.argv:
        return run_target()
    if "--workload-target" in sys.argv:
        return run_workload_target()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="cost,ingest,workload,probes-only,latency")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per workload round")
    parser.add_argument("--profile", default="cpu,host", help="profiles attached in the workload benchmark")
    parser.add_argument(
        "--modes", default="gen,fwd", help="workload modes: gen (generate), fwd (teacher-forced)"
    )
    parser.add_argument("--threads", default="1,2", help="torch thread counts for the workload benchmark")
    add_json_option(parser)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("error: run as root (the benchmarks attach eBPF probes)"
              "\nhint: sudo .venv/bin/python -m bench.probes",
              file=sys.stderr)  # fmt: skip
        return 4
    only = set(args.only.split(","))
    report = Report("probes", args)
    if "cost" in only:
        report.note("== cost per probe hit (ratio = llmobs / empty probe, same function, same run) ==")
        bench_cost(args.rounds, report)
    if "ingest" in only:
        report.note("== ingest ==")
        bench_ingest(report)
    if "workload" in only:
        report.note(f"== workload: SmolLM2-135M tokens/s, `attach --profile {args.profile}` vs no agent ==")
        threads = tuple(int(t) for t in args.threads.split(","))
        bench_workload(args.rounds, args.tokens, args.profile, tuple(args.modes.split(",")), threads, report)
    if "probes-only" in only:
        report.note(
            "== workload: SmolLM2-135M tokens/s with the default probes attached by this script (no agent) =="
        )
        bench_probes_only(args.rounds, args.tokens, tuple(int(t) for t in args.threads.split(",")), report)
    if "latency" in only:
        report.note("== attach latency ==")
        bench_latency(args.rounds, report)
    report.finish()
    return 0


if __name__ == "__main__":
    ct.set_errno(0)
    sys.exit(main())
