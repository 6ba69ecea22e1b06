"""Soak benchmark (issue 8): the agent attached for a long stretch to a target producing ~N probe
events/s; every interval it samples the agent's RSS and CPU (from /proc), the events/s it ingested
and the drops; writes a CSV, a PNG plot and a JSON summary, and prints a table.

    .venv/bin/python -m bench.soak --minutes 30 --rate 50000 --out /work/notes/s2/soak
    .venv/bin/python -m bench.soak --minutes 2 --out /tmp/soak-check      # a quick validation

A soak is one configuration over time (a time series, not interleaved arms), so it does not use
bench/harness.py; it reads the agent's CPU and RSS from /proc with bench/procstat.py.

The target is a small C program built on the fly with gcc: it dlopen()s the torch wheel's libc10.so
(so the agent sees a PyTorch process and resolves its probes in it) and calls the real
`c10::alloc_cpu` / `c10::free_cpu` at a paced rate, one tick per millisecond. With the `mem` profile
each alloc_cpu is one event (timed: entry + return probe) and each free_cpu one, so --rate R events/s
means R/2 alloc/free pairs per second. It counts its own calls, so what the agent ingested is checked
against what really happened.

The agent (--agent) is `llmobs-agent attach --pid TARGET --profile mem --db PATH --overhead-budget 0` by
default: the real ring-buffer drain, decode, correlation and DuckDB ingest, every event stored (no
sampling), with the overhead governor off. The governor must be off: this target does nothing but call
the probed functions, so any budget is exceeded at once and the probes under test would be shed (the
soak measures the agent at this rate, not the governor). `--agent run` soaks the daemon instead
(`run --profile mem --command <target path> --overhead-budget 0`, the governor off likewise). The store
goes to a temporary directory, removed at the end unless --keep-db.

Columns: elapsed_s, agent_rss_mb (and its parts anon_mb, file_mb: the agent's own memory and the
resident pages of the files it maps), agent_cpu_pct (of one core, over the interval), events_per_s (ring
events the agent decoded over the interval: run's status file RUN_DIR/daemon.json, rewritten each
second; attach's status line, printed every 10 s, so its figures lag by up to 10 s), target_calls_per_s
(alloc/free pairs the target made), kernel_drops and user_drops (cumulative), store_mb (file + WAL).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procstat import cpu_seconds, rss_bytes, rss_parts

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"

# The paced target. argv: libc10 path, pairs/s, seconds. Prints "ready", waits for a stdin line, then
# calls alloc_cpu/free_cpu pairs so that `pairs` = rate * elapsed at every 1 ms tick; prints the running
# total once a second ("calls N") and at the end ("total N"); SIGTERM ends it early.
TARGET_C = r"""
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile sig_atomic_t stop = 0;
static void on_term(int sig) { (void)sig; stop = 1; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s LIBC10 PAIRS_PER_S SECONDS\n", argv[0]); return 2; }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
    void *(*alloc_cpu)(size_t) = (void *(*)(size_t))dlsym(lib, "_ZN3c109alloc_cpuEm");
    void (*free_cpu)(void *) = (void (*)(void *))dlsym(lib, "_ZN3c108free_cpuEPv");
    if (!alloc_cpu || !free_cpu) { fprintf(stderr, "c10 symbols not found\n"); return 1; }
    double rate = atof(argv[2]), seconds = atof(argv[3]);
    signal(SIGTERM, on_term);
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    double start = now_s(), next_report = start + 1.0;
    uint64_t pairs = 0;
    struct timespec tick = {0, 1000000};
    while (!stop) {
        double t = now_s();
        if (t - start >= seconds) break;
        uint64_t due = (uint64_t)(rate * (t - start));
        while (pairs < due) { free_cpu(alloc_cpu(256)); pairs++; }
        if (t >= next_report) {
            printf("calls %llu\n", (unsigned long long)pairs);
            fflush(stdout);
            next_report += 1.0;
        }
        nanosleep(&tick, NULL);
    }
    printf("total %llu\n", (unsigned long long)pairs);
    fflush(stdout);
    return 0;
}
"""

STATUS = re.compile(r"\| ([\d,]+) events/s \| sampled ([\d,]+) \| drops kernel ([\d,]+) user ([\d,]+)")


def libc10_path() -> Path:
    out = subprocess.run(
        [str(PYTHON), "-c", "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip()) / "libc10.so"


def build_target(workdir: Path) -> Path:
    source, binary = workdir / "soak_target.c", workdir / "soak_target"
    source.write_text(TARGET_C)
    subprocess.run(["gcc", "-O2", "-o", str(binary), str(source), "-ldl"], check=True)
    return binary


class LineReader:
    """Non-blocking line reader over a child's pipe (the sampler never blocks on a quiet child)."""

    def __init__(self, stream):
        self.fd = stream.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = b""
        self.closed = False

    def lines(self, timeout: float = 0.0) -> list[str]:
        readable, _, _ = select.select([self.fd], [], [], timeout)
        if not readable:
            return []
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            self.closed = True
            return []
        self.buffer += chunk
        *complete, self.buffer = self.buffer.split(b"\n")
        return [line.decode(errors="replace") for line in complete]

    def wait_for(self, text: str, timeout: float, seen: list[str]) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.closed:
            for line in self.lines(0.2):
                seen.append(line)
                if text in line:
                    return line
        raise SystemExit(f"error: no {text!r} within {timeout} s; last output: {seen[-5:]}")


def store_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())


def agent_command(args, target_pid: int, db: Path, binary: Path, run_dir: Path) -> list[str]:
    if args.agent == "run":
        return [
            str(PYTHON), "-m", "llmobs.cli", "run", "--db", str(db), "--profile", "mem",
            "--command", re.escape(str(binary)), "--interval", "0.5", "--run-dir", str(run_dir),
            "--overhead-budget", "0",
        ]  # fmt: skip
    return [
        str(PYTHON), "-m", "llmobs.cli", "attach", "--pid", str(target_pid), "--profile", "mem",
        "--db", str(db), "--overhead-budget", "0",
    ]  # fmt: skip


def daemon_status(path: Path, pid: int) -> tuple[int, int, int, int] | None:
    """(0, events, kernel drops, user drops) of the target from run's status file (None: unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # replaced by rename once a second: absent for an instant at most
        return None
    target = next((t for t in data.get("targets", []) if t.get("pid") == pid), None)
    if target is None:
        return None
    drops = target.get("drops", {})
    user = sum(v for k, v in drops.items() if k not in ("ring_drops", "agg_overflow"))
    return 0, int(target.get("events", 0)), int(data.get("counters", {}).get("ring_drops", 0)), int(user)


def write_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [row["elapsed_s"] / 60 for row in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True, constrained_layout=True)
    axes[0].plot(minutes, [row["agent_rss_mb"] for row in rows], marker="o")
    axes[0].set_ylabel("agent RSS (MB)")
    axes[0].set_ylim(bottom=0)
    axes[1].plot(minutes, [row["agent_cpu_pct"] for row in rows], marker="o", color="tab:red")
    axes[1].set_ylabel("agent CPU (% of a core)")
    axes[1].set_ylim(bottom=0)
    axes[2].plot(
        minutes, [row["events_per_s"] for row in rows], marker="o", color="tab:green", label="ingested"
    )
    axes[2].plot(minutes, [2 * row["target_calls_per_s"] for row in rows], ls="--", color="grey",
                 label="produced (2 x pairs)")  # fmt: skip
    axes[2].set_ylabel("events/s")
    axes[2].set_ylim(bottom=0)
    axes[2].set_xlabel("minutes")
    axes[2].legend(loc="lower right")
    fig.suptitle(title)
    fig.savefig(path, dpi=90)
    plt.close(fig)


HEADER = (
    f"{'min':>5} {'RSS MB':>8} {'anon/file':>11} {'CPU %':>7} {'events/s':>10} {'produced/s':>11} "
    f"{'drops k/u':>12} {'store MB':>9}"
)


def print_table(rows: list[dict], header: bool = True) -> None:
    if header:
        print(HEADER)
    for row in rows:
        print(
            f"{row['elapsed_s'] / 60:>5.1f} {row['agent_rss_mb']:>8.1f} "
            f"{row['anon_mb']:>5.0f}/{row['file_mb']:<5.0f} {row['agent_cpu_pct']:>7.1f} "
            f"{row['events_per_s']:>10,.0f} {2 * row['target_calls_per_s']:>11,.0f} "
            f"{row['kernel_drops']:>5,}/{row['user_drops']:<6,} {row['store_mb']:>9.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=50_000, help="probe events/s the target produces")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=Path("soak-out"), help="directory for CSV, PNG, JSON")
    parser.add_argument("--agent", choices=("attach", "run"), default="attach")
    parser.add_argument("--keep-db", action="store_true", help="keep the DuckDB store (it grows ~GBs)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("error: the soak attaches eBPF probes: run it as root", file=sys.stderr)
        return 4
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="llmobs-soak-"))
    db = workdir / "soak.duckdb"
    seconds = args.minutes * 60
    binary = build_target(workdir)
    target = subprocess.Popen(
        [str(binary), str(libc10_path()), str(args.rate / 2), str(seconds + 30)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    target_out = LineReader(target.stdout)
    target_lines: list[str] = []
    target_out.wait_for("ready", 30, target_lines)
    run_dir = workdir / "run"
    env = dict(os.environ, LLMOBS_RUN_DIR=str(run_dir), LLMOBS_CONFIG="")
    env.pop("NOTIFY_SOCKET", None)
    agent = subprocess.Popen(
        agent_command(args, target.pid, db, binary, run_dir),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    agent_err = LineReader(agent.stderr)
    agent_lines: list[str] = []
    ready = f"attach pid {target.pid} " if args.agent == "run" else "attached in"
    agent_out_ok = agent_err.wait_for(ready, 60, agent_lines)
    print(
        f"soak: target pid {target.pid} ({args.rate:,} events/s asked), agent pid {agent.pid}: {agent_out_ok}"
    )
    target.stdin.write(b"go\n")
    target.stdin.flush()

    rows: list[dict] = []
    started = time.monotonic()
    last_time, last_cpu = started, cpu_seconds(agent.pid)
    last_sampled, last_pairs, pairs = 0, 0, 0
    status = (0, 0, 0, 0)  # rate, sampled, kernel drops, user drops (the agent's latest status line)
    next_sample = started + args.interval
    try:
        while time.monotonic() - started < seconds:
            for line in agent_err.lines(0.5):
                agent_lines.append(line)
                if match := STATUS.search(line):
                    status = tuple(int(g.replace(",", "")) for g in match.groups())
            for line in target_out.lines(0.0):
                if line.startswith("calls "):
                    pairs = int(line.split()[1])
            if args.agent == "run":
                status = daemon_status(run_dir / "daemon.json", target.pid) or status
            if agent.poll() is not None:
                raise SystemExit(f"error: the agent exited early ({agent.returncode}): {agent_lines[-5:]}")
            now = time.monotonic()
            if now < next_sample:
                continue
            next_sample += args.interval
            rss, cpu, parts = rss_bytes(agent.pid), cpu_seconds(agent.pid), rss_parts(agent.pid)
            span = now - last_time
            row = {
                "elapsed_s": round(now - started, 1),
                "agent_rss_mb": round(rss / 2**20, 1),
                "anon_mb": round(parts["RssAnon"] / 2**20, 1),
                "file_mb": round(parts["RssFile"] / 2**20, 1),
                "agent_cpu_pct": round(100 * (cpu - last_cpu) / span, 1),
                "events_per_s": round((status[1] - last_sampled) / span),
                "target_calls_per_s": round((pairs - last_pairs) / span),
                "kernel_drops": status[2],
                "user_drops": status[3],
                "store_mb": round(store_bytes(db) / 2**20, 1),
            }
            rows.append(row)
            print_table(rows[-1:], header=len(rows) == 1)
            sys.stdout.flush()
            last_time, last_cpu, last_sampled, last_pairs = now, cpu, status[1], pairs
    finally:
        target.send_signal(signal.SIGTERM)
        agent.send_signal(signal.SIGTERM if args.agent == "run" else signal.SIGINT)  # run drains on SIGTERM
        try:
            _, rest = agent.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            agent.kill()
            _, rest = agent.communicate()
        target_rest, _ = target.communicate(timeout=30)
    agent_lines += (agent_err.buffer + rest).decode(errors="replace").splitlines()
    total_pairs = next(
        (int(line.split()[1]) for line in target_rest.decode().splitlines() if line.startswith("total ")),
        pairs,
    )
    stored = stored_events(db)
    summary = {
        "minutes": args.minutes, "rate_asked": args.rate, "agent": args.agent, "agent_exit": agent.returncode,
        "target_pairs": total_pairs, "events_produced": 2 * total_pairs, "events_stored": stored,
        "rss_mb_first": rows[0]["agent_rss_mb"] if rows else None,
        "rss_mb_last": rows[-1]["agent_rss_mb"] if rows else None,
        "rss_mb_max": max((r["agent_rss_mb"] for r in rows), default=None),
        "cpu_pct_mean": round(sum(r["agent_cpu_pct"] for r in rows) / len(rows), 1) if rows else None,
        "events_per_s_mean": round(sum(r["events_per_s"] for r in rows) / len(rows)) if rows else None,
        "store_mb": round(store_bytes(db) / 2**20, 1),
        "agent_tail": agent_lines[-14:],
    }  # fmt: skip
    with open(args.out / "soak.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["elapsed_s"])
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    if rows:
        title = f"llmobs-agent {args.agent} soak: {args.rate:,} events/s asked, {args.minutes:g} min"
        write_plot(rows, args.out / "soak.png", title)
    print()
    print_table(rows)
    print(
        f"\nevents produced {2 * total_pairs:,}, stored {stored:,} "
        f"({100 * stored / max(2 * total_pairs, 1):.2f}%); agent exit {agent.returncode}; "
        f"store {summary['store_mb']} MB; RSS first/last/max {summary['rss_mb_first']}/"
        f"{summary['rss_mb_last']}/{summary['rss_mb_max']} MB; CPU mean {summary['cpu_pct_mean']}% of a core"
    )
    print("agent's closing summary:\n  " + "\n  ".join(summary["agent_tail"]))
    print(f"wrote {args.out / 'soak.csv'}, {args.out / 'soak.png'}, {args.out / 'soak.json'}")
    if not args.keep_db:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def stored_events(db: Path) -> int:
    """mem_events rows in the store once the agent closed it (-1 if it cannot be read)."""
    try:
        import duckdb

        with duckdb.connect(str(db), read_only=True) as con:
            return int(con.execute("SELECT count(*) FROM mem_events").fetchone()[0])
    except Exception as exc:  # the summary says why instead of failing the whole soak at the end
        print(f"note: could not count stored events: {exc}", file=sys.stderr)
        return -1


if __name__ == "__main__":
    sys.exit(main())
