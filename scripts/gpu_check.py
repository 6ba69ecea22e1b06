#!/usr/bin/env python3
"""The GPU check's measurements (run by scripts/gpu_check.sh, which prepares the environment).

Parts, each reported as RAN / SKIPPED (with the reason) / FAILED in one results file:
  preflight   GPU, driver, torch CUDA, cupti-python, nvidia-ml-py, bcc, and whether eBPF runs at all
  nvml        NvmlSource (the agent's live NVML source) while an instrumented workload generates: rows
              for its pid each second, stored through the Pipeline in gpu_samples of a real store and
              joined to its token steps (step_gpu) when duckdb is importable
  throughput  tokens/s of the CUDA generation loop: baseline (no llmobs) vs instrumented vs
              instrumented + `attach --profile cuda`, interleaved rounds, ratios of medians
  trace       `trace --steps 8` on a generating process while `attach --profile cuda` runs:
              kernels captured and joined to steps, CUPTI launches vs uprobe launch counts per step,
              the clock-fit residual, drops; stored to DuckDB when duckdb is importable
  gpu-tests   the tests/gpu tier (pytest)

--rehearse runs the same code on the CPU (tiny model, cpu profile) so the script itself is exercised
where there is no GPU; what needs a GPU is then reported SKIPPED with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


class Results:
    """Appends every line to one file (and stdout); keeps the part outcomes for the final table."""

    def __init__(self, path: Path):
        self.path = path
        self.parts: list[tuple[str, str, str]] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = path.open("a")

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.f.write(text + "\n")
        self.f.flush()

    def part(self, name: str, outcome: str, detail: str = "") -> None:
        self.parts.append((name, outcome, detail))
        self.line(f"== {name}: {outcome}" + (f" ({detail})" if detail else ""))

    def table(self) -> None:
        self.line("== summary")
        for name, outcome, detail in self.parts:
            self.line(f"  {name:<11} {outcome:<8} {detail}")


def run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# --- preflight ---------------------------------------------------------------------------------------
def preflight(res: Results, args) -> dict:
    facts: dict = {}
    try:
        out = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], 30)
        facts["gpu"] = out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        facts["gpu"] = f"nvidia-smi: {exc}"
    res.line(f"gpu: {facts['gpu']}")
    res.line(f"kernel: {os.uname().release}; python {sys.version.split()[0]} at {PY}")
    probe = (
        "import json, torch\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda}\n"
        "d['available'] = torch.cuda.is_available()\n"
        "d['device'] = torch.cuda.get_device_name(0) if d['available'] else ''\n"
        "print(json.dumps(d))"
    )
    out = run([PY, "-c", probe], 120)
    facts["torch"] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    res.line(f"torch: {facts['torch'] or out.stderr.strip()[-300:]}")
    modules = (("cupti", "cupti-python"), ("pynvml", "nvidia-ml-py"), ("duckdb", "duckdb"), ("bcc", "bcc"))
    for mod, what in modules:
        out = run([PY, "-c", f"import {mod}; print(getattr({mod}, '__file__', ''))"], 60)
        facts[mod] = out.returncode == 0
        why = (out.stderr.strip().splitlines() or ["?"])[-1]
        res.line(f"{what}: {'importable' if facts[mod] else 'MISSING: ' + why}")
    facts["ebpf"], facts["ebpf_reason"] = ebpf_smoke() if facts["bcc"] else (False, "bcc is not importable")
    res.line(f"ebpf: {'works' if facts['ebpf'] else 'cannot run: ' + facts['ebpf_reason']}")
    for p in ("/sys/kernel/btf/vmlinux", "/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        res.line(f"  {p}: {'present' if os.path.exists(p) else 'absent'}")
    res.line(f"  BCC_KERNEL_SOURCE={os.environ.get('BCC_KERNEL_SOURCE', '')}")
    facts["cuda"] = bool(facts["torch"].get("available"))
    res.part("preflight", "RAN", f"cuda={facts['cuda']} ebpf={facts['ebpf']} cupti={facts['cupti']}")
    return facts


EBPF_SMOKE = r"""
import ctypes, os
from bcc import BPF
b = BPF(text='BPF_ARRAY(hits, u64, 1); int on_getpid(void *ctx) { int k = 0; hits.increment(k); return 0; }')
b.attach_uprobe(name="c", sym="getpid", fn_name="on_getpid")
libc = ctypes.CDLL(None)
for _ in range(100):
    libc.getpid()
print(b["hits"][0].value)
"""


def ebpf_smoke() -> tuple[bool, str]:
    """Can this kernel run eBPF for us: compile with bcc, attach a uprobe, count 100 calls."""
    if os.geteuid() != 0:
        return False, "not root"
    try:
        out = run([PY, "-c", EBPF_SMOKE], 120)
    except subprocess.TimeoutExpired:
        return False, "bcc smoke test timed out"
    if out.returncode != 0:
        return False, (out.stderr.strip().splitlines() or ["failed"])[-1][:300]
    hits = int(out.stdout.strip().splitlines()[-1])
    return (hits >= 100, f"{hits} of 100 uprobe hits counted")


# --- processes -----------------------------------------------------------------------------------------
class Workload:
    """scripts/gpu_workload.py in a child; ready when its JSON line arrives on a pipe."""

    def __init__(self, args, *, instrument: bool, requests: int, wait_stdin: bool = False):
        r, w = os.pipe()
        cmd = [PY, str(REPO / "scripts" / "gpu_workload.py"), "--model", args.model, "--device", args.device,
               "--requests", str(requests), "--max-new-tokens", str(args.tokens), "--batch", str(args.batch),
               "--ready-fd", str(w)]  # fmt: skip
        if not instrument:
            cmd.append("--no-instrument")
        if wait_stdin:
            cmd.append("--wait-stdin")
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(cmd, stdin=pipe, stdout=pipe, stderr=pipe, text=True, pass_fds=(w,))
        os.close(w)
        ready, _, _ = select.select([r], [], [], args.load_timeout)
        line = os.read(r, 4096).decode() if ready else ""
        os.close(r)
        if not line:
            self.proc.kill()
            err = self.proc.stderr.read()[-800:]
            raise RuntimeError(f"workload not ready in {args.load_timeout} s: {err}")
        self.info = json.loads(line.splitlines()[0])
        self.pid = self.info["pid"]

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float) -> dict:
        out, err = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0:
            raise RuntimeError(f"workload failed ({self.proc.returncode}): {err[-800:]}")
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Attach:
    """`llmobs-agent attach` on a pid; ready once it prints 'attached in'."""

    def __init__(self, args, pid: int, out: str | None = None):
        cmd = [PY, "-m", "llmobs.cli", "attach", "--pid", str(pid), "--profile", args.profile]
        if out:
            cmd += ["--out", out]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line.rstrip())
            if "attached in" in line:
                return
        self.proc.kill()
        raise RuntimeError("attach did not attach: " + " | ".join(self.log[-5:]))

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=60)
        return "\n".join(self.log) + "\n" + err


# --- parts ---------------------------------------------------------------------------------------------
NVML_POLL_S = 1.0  # how often the agent's runtime polls NvmlSource


def nvml_part(res: Results, args, facts, tmp: Path, make_source=None) -> None:
    """NvmlSource, the agent's live NVML source, on the device while an instrumented workload generates:
    rows for the workload's pid every second and, where duckdb is importable, those rows through the
    Pipeline into gpu_samples of a real store, joined to the workload's token steps by step_gpu.
    `make_source(say=...)` builds the source (a test stands NVML in; here it is the real one)."""
    from llmobs.gpu.nvml_source import NvmlSource, split_by_pid

    source = (make_source or NvmlSource)(say=res.line)
    source.poll()  # opens NVML; where it cannot, it has said why in one line
    if not source.available:
        res.part("nvml", "SKIPPED", source.status or "NVML did not open")
        return
    # at least ~3 s of generation: NVML's per-process utilisation needs periods of work to say anything
    w = Workload(args, instrument=True, requests=args.requests * (1 if args.rehearse else 3), wait_stdin=True)
    db = tmp / "nvml.duckdb"
    pipeline = summary = None
    polled: list[dict] = []
    try:
        source.track(w.pid)
        if facts["duckdb"]:
            from llmobs.pipeline import Pipeline

            pipeline = Pipeline.open(db, w.pid, snapshot=False)
        w.go()
        next_poll, deadline = time.monotonic(), time.monotonic() + args.run_timeout
        while w.proc.poll() is None and time.monotonic() < deadline:
            if pipeline is not None:
                pipeline.poll()  # the workload's token steps, from its map
            if time.monotonic() >= next_poll:
                next_poll += NVML_POLL_S
                batch = source.poll()
                mine = split_by_pid(batch["gpu_samples"]).get(w.pid) if batch else None
                if mine is not None:
                    polled.append(mine)
                    if pipeline is not None:
                        pipeline.add_gpu_samples(mine)
            time.sleep(0.02)
        w.finish(args.run_timeout)
    finally:
        if pipeline is not None:
            summary = pipeline.close()
        w.stop()
        stats = source.stats()
        source.close()
    rows = [{k: v[i] for k, v in cols.items()} for cols in polled for i in range(len(cols["ts_ns"]))]
    for r in rows:
        res.line(f"  pid {r['pid']} gpu {r['gpu_index']} ({r['gpu_name']}, {r['gpu_uuid']}): "
                 f"sm {r['sm_util']}% mem {r['mem_util']}% used {_mib(r['mem_used'])} MiB; device gpu "
                 f"{r['gpu_util']}% used {_mib(r['device_mem_used'])} of {_mib(r['device_mem_total'])} "
                 "MiB")  # fmt: skip
    res.line(f"  source: {stats}")
    checks = {
        "rows for the workload's pid": bool(rows),
        "its device memory seen": any((r["mem_used"] or 0) > 0 for r in rows),
    }
    res.line(f"  SM utilisation figures in {sum(r['sm_util'] is not None for r in rows)} of {len(rows)} rows "
             "(NVML gives one only after the process ran kernels since its last look)")  # fmt: skip
    if summary is not None:
        checks.update(stored_gpu_samples(res, db, w.pid, len(rows), summary))
    else:
        res.line("  store not checked: duckdb is not importable here (not carried; see docs/gpu-check.md)")
    for name, ok in checks.items():
        res.line(f"  [{'ok' if ok else 'FAIL'}] {name}")
    passed = f"{sum(checks.values())}/{len(checks)} checks"
    res.part("nvml", "RAN" if all(checks.values()) else "FAILED", passed)


def stored_gpu_samples(res: Results, db: Path, pid: int, polled: int, summary) -> dict[str, bool]:
    """What the pipeline stored: every polled row in gpu_samples, and token steps given a sample."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        stored = con.execute("SELECT count(*) FROM gpu_samples WHERE pid = ?", [pid]).fetchall()[0][0]
        steps = con.execute("SELECT count(*) FROM token_steps WHERE pid = ?", [pid]).fetchall()[0][0]
        joined = con.execute(
            "SELECT count(DISTINCT (step_seq, batch_row)) FROM step_gpu WHERE pid = ?", [pid]
        ).fetchall()[0][0]
    finally:
        con.close()
    error = f"; store error: {summary.store_error}" if summary.store_error else ""
    res.line(f"  store {db.name}: {stored} gpu_samples rows, {steps} token steps, {joined} of them given a "
             f"sample by step_gpu{error}")  # fmt: skip
    return {
        "every polled row in gpu_samples": stored == polled > 0,
        "token steps joined to a sample (step_gpu)": joined > 0,
    }


def _mib(value) -> str:
    return "?" if value is None else f"{int(value) >> 20:,}"


def throughput_part(res: Results, args, facts) -> None:
    modes = ["baseline", "instrumented"] + (["with-agent"] if facts["ebpf"] else [])
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in modes:
            w = Workload(args, instrument=mode != "baseline", requests=args.requests, wait_stdin=True)
            agent = None
            try:
                if mode == "with-agent":
                    agent = Attach(args, w.pid)
                w.go()
                summary = w.finish(args.run_timeout)
            finally:
                if agent is not None:
                    agent.stop()
                w.stop()
            rates[mode].append(summary["tokens_per_s"])
            res.line(f"  round {rnd + 1} {mode:<12} {summary['tokens_per_s']:>10.1f} tokens/s")
    base = statistics.median(rates["baseline"])
    parts = []
    for mode in modes[1:]:
        ratio = statistics.median(rates[mode]) / base if base else float("nan")
        parts.append(f"{mode}/baseline {ratio:.3f}")
        median = statistics.median(rates[mode])
        res.line(f"  {mode}: median {median:.1f} tokens/s, ratio to baseline {ratio:.3f}")
    detail = ", ".join(parts) + ("" if facts["ebpf"] else "; with-agent not run: eBPF cannot run here")
    if args.rehearse:
        detail += "; REHEARSAL on the CPU with 8 tokens a run: these ratios are noise, not a measurement"
    res.part("throughput", "RAN", detail)


def launch_counts(aggregates: Path) -> dict[int, dict[str, int]]:
    import pyarrow.parquet as pq

    table = pq.read_table(aggregates).to_pydict()
    out: dict[int, dict[str, int]] = {}
    for seq, probe, count in zip(table["step_seq"], table["probe"], table["count"], strict=True):
        out.setdefault(int(seq), {})
        out[int(seq)][probe] = out[int(seq)].get(probe, 0) + int(count)
    return out


def judge_trace(doc: dict, steps_wanted: int) -> tuple[list[dict], dict[str, bool], list[str]]:
    """The checks on `trace --json` output: (collected steps, {check: ok}, lines to report)."""
    steps = [s for s in doc["steps"] if s["step_seq"]]
    checks = {
        f"{steps_wanted} steps collected": len(steps) == steps_wanted,
        "kernels in every step": bool(steps) and all(s["kernels"] > 0 for s in steps),
        "every step joined to its token step": bool(steps) and all(s["trace_id"] for s in steps),
        "all records joined": doc["unjoined"] == 0 and doc["joined"] > 0,
        "clock residual < 10 us": bool(doc["clock"]) and doc["clock"]["residual_ns"] < 10_000,
        "no CUPTI drops": bool(doc["end"]) and doc["end"]["cupti_dropped"] == 0,
    }
    lines = []
    if doc["clock"]:
        c = doc["clock"]
        lines.append(f"  clock fit: offset {c['offset_ns']} ns, drift {c['drift_ppm']:.3f} ppm, residual "
                     f"{c['residual_ns']:.0f} ns rms, {c['max_residual_ns']:.0f} ns max, "
                     f"{c['samples']} samples")  # fmt: skip
    if doc["end"]:
        e = doc["end"]
        lines.append(f"  drops: CUPTI {e['cupti_dropped']}, collector {e['collector_dropped']}, ring "
                     f"overwritten {doc['lost']}, records without a step {e['unattributed']}")  # fmt: skip
    return steps, checks, lines


def is_launch_probe(probe: str) -> bool:
    """Kernel-launch uprobes of the cuda profile (graph launches are not kernel launches)."""
    return "aunch" in probe and "Graph" not in probe


def compare_launches(steps: list[dict], counts: dict[int, dict[str, int]]) -> tuple[list[str], bool]:
    """Per step: CUPTI kernels and launch-API records beside the uprobe launch counts of that step."""
    lines = [
        f"  {'step_seq':>9} {'cupti_kernels':>13} {'cupti_launch_api':>16} {'uprobe_launches':>15}  probes"
    ]
    agree = []
    for s in steps:
        probes = {k: v for k, v in counts.get(s["step_seq"], {}).items() if is_launch_probe(k)}
        uprobe = sum(probes.values())
        agree.append(uprobe == s["launches"] or uprobe == s["kernels"])
        lines.append(f"  {s['step_seq']:>9} {s['kernels']:>13} {s['launches']:>16} {uprobe:>15}  "
                     + ", ".join(f"{k}={v}" for k, v in sorted(probes.items())))  # fmt: skip
    return lines, bool(agree) and all(agree)


def trace_part(res: Results, args, facts, tmp: Path) -> None:
    if not facts["cuda"]:
        w = Workload(args, instrument=True, requests=0)
        try:
            out = run([PY, "-m", "llmobs.cli", "trace", "--pid", str(w.pid), "--steps", str(args.steps),
                       "--timeout", "30"], 120)  # fmt: skip
        finally:
            w.stop()
        res.line(f"  trace without CUDA: exit {out.returncode}: {out.stderr.strip().splitlines()[0]}")
        res.part("trace", "SKIPPED", f"no CUDA in torch here; trace refused with exit {out.returncode}")
        return
    w = Workload(args, instrument=True, requests=0)
    agent = None
    agent_log = ""
    aggregates = tmp / "attach.aggregates.parquet"
    try:
        if facts["ebpf"]:
            agent = Attach(args, w.pid, str(tmp / "attach.parquet"))
        cmd = [PY, "-m", "llmobs.cli", "trace", "--pid", str(w.pid), "--steps", str(args.steps), "--timeout",
               "120", "--json", str(tmp / "trace.json"), "--quiet"]  # fmt: skip
        if facts["duckdb"]:
            cmd += ["--db", str(tmp / "trace.duckdb")]
        out = run(cmd, 180)
    finally:
        if agent is not None:
            agent_log = agent.stop()
        w.stop()
    for line in out.stdout.splitlines():
        res.line(f"  | {line}")
    if out.returncode != 0:
        res.line(f"  trace stderr: {out.stderr.strip()[-800:]}")
        res.part("trace", "FAILED", f"trace exit {out.returncode}")
        return
    doc = json.loads((tmp / "trace.json").read_text())
    steps, checks, lines = judge_trace(doc, args.steps)
    if agent is not None and aggregates.exists():
        more, agree = compare_launches(steps, launch_counts(aggregates))
        lines += more
        checks["uprobe launches == CUPTI launches or kernels, every step"] = agree
    else:
        why = "eBPF cannot run here" if not facts["ebpf"] else agent_log[-400:]
        lines.append("  uprobe comparison not run: " + why)
    for line in lines:
        res.line(line)
    if facts["duckdb"]:
        import duckdb

        con = duckdb.connect(str(tmp / "trace.duckdb"), read_only=True)
        rows = con.execute("SELECT step_seq, gpu_ns, launches FROM step_rollups WHERE gpu_ns IS NOT NULL "
                           "ORDER BY step_seq").fetchall()  # fmt: skip
        con.close()
        res.line(f"  store: {len(rows)} step rollups with gpu_ns: {rows[:8]}")
        checks["stored and joined (step_rollups.gpu_ns)"] = len(rows) == len(steps)
    else:
        res.line("  store not checked: duckdb is not importable here (not carried; see docs/gpu-check.md)")
    for name, ok in checks.items():
        res.line(f"  [{'ok' if ok else 'FAIL'}] {name}")
    res.part("trace", "RAN" if all(checks.values()) else "FAILED",
             f"{sum(checks.values())}/{len(checks)} checks")  # fmt: skip


def gpu_tests_part(res: Results, args, facts) -> None:
    if not facts["cuda"]:
        res.part("gpu-tests", "SKIPPED", "no CUDA here")
        return
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests" / "gpu")]
    out = run(cmd, 300, cwd=REPO)
    for line in out.stdout.strip().splitlines()[-15:]:
        res.line(f"  | {line}")
    res.part("gpu-tests", "RAN" if out.returncode == 0 else "FAILED", f"pytest exit {out.returncode}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", required=True, help="the one results file (appended)")
    p.add_argument("--rehearse", action="store_true", help="run on the CPU: tiny model, cpu profile")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--parts", default="trace,nvml,throughput,gpu-tests")
    args = p.parse_args(argv)
    where = ("tiny", "cpu", "cpu") if args.rehearse else ("small", "cuda", "cuda")
    args.model, args.device, args.profile = where
    if args.rehearse:
        args.requests, args.tokens, args.batch = min(args.requests, 2), min(args.tokens, 4), 1
    args.load_timeout, args.run_timeout = 180, 240
    res = Results(Path(args.results))
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"llmobs-gpu-check-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    wanted = args.parts.split(",")
    facts = preflight(res, args)
    steps = [  # the most telling first: a run cut short by the time limit still has them
        ("trace", lambda: trace_part(res, args, facts, tmp)),
        ("nvml", lambda: nvml_part(res, args, facts, tmp)),
        ("throughput", lambda: throughput_part(res, args, facts)),
        ("gpu-tests", lambda: gpu_tests_part(res, args, facts)),
    ]
    for name, fn in steps:
        if name not in wanted:
            res.part(name, "SKIPPED", "not asked for (--parts)")
            continue
        started = time.monotonic()
        try:
            fn()
        except Exception as exc:  # one part failing must not hide the others' results
            res.part(name, "FAILED", f"{type(exc).__name__}: {str(exc)[:300]}")
        res.line(f"   ({name} took {time.monotonic() - started:.1f} s)")
    res.table()
    return 1 if any(outcome == "FAILED" for _, outcome, _ in res.parts) else 0


if __name__ == "__main__":
    sys.exit(main())
