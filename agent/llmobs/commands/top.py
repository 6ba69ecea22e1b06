"""`llmobs-agent top`: a live terminal view of attached processes.

Per process: tokens, tokens/s and per-token latency p50/p99 over the last 10 s, mean loss, the work of
a token step (allocations, launches, linear/GEMM calls, off-CPU ms), drops, and the process's GPU
utilisation and device memory (NVML's gpu_samples; "-" for a process without a GPU); under it, per
tenant of each process: tokens/s, compute-seconds per second (its rows' shares of the forward passes'
durations, by tokens: the store's pass_shares rule) and its share. Where the numbers come from:

- a process some `attach` is attached to: the snapshot that agent rewrites once a second under
  $LLMOBS_RUN_DIR (default /run/llmobs): exact kernel totals and every drop counter;
- an instrumented process no agent is attached to: its map, read here (token columns only);
- `--db PATH` with no agent writing it: the store itself, read-only (its newest 10 s per process).
  DuckDB lets one process write a file and refuses other opens meanwhile, so while an agent writes
  the store `top --db` shows that agent's snapshots instead.

Refreshes in place on a terminal, prints plain tables otherwise; `--once` prints one and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import re
import sys
import time
from pathlib import Path

from llmobs import clock
from llmobs.errors import NotTracked, StoreError, UsageError
from llmobs.pipeline.live import WINDOW_S, LiveStats, read_snapshots, wall_time
from llmobs.pipeline.sources import ShmSource
from llmobs.shm import layout
from llmobs.store import default_db_path, schema
from llmobs.store.views import SHARES_VERSION

COLUMNS = ("PID", "MODEL", "TENANTS", "TOKENS", "TOK/S", "P50 ms", "P99 ms", "LOSS", "ALLOC/STEP",
           "LAUNCH/STEP", "COMPUTE/STEP", "OFFCPU ms/STEP", "DROPS", "GPU %", "GPU MiB",
           "SOURCE")  # fmt: skip
TENANT_COLUMNS = ("PID", "TENANT", "TOK/S", "COMPUTE s/s", "COMPUTE %")
_CLEAR = "\x1b[H\x1b[2J"
HINT = "e.g. `llmobs-agent top --interval 0.5 --iterations 10`; see `llmobs-agent top --help`"


def configure(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--db", nargs="?", const="", metavar="PATH", help="the processes of this store")
    where.add_argument("--pid", type=int, action="append", metavar="N", help="this process (repeatable)")
    parser.add_argument("--once", action="store_true", help="print one table and exit (for scripts)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S", help="refresh period (1 s)")
    parser.add_argument("--iterations", type=int, metavar="K", help="stop after K refreshes")


class MapWatcher:
    """A process's map read directly: its token steps folded into LiveStats as they appear."""

    def __init__(self, pid: int, shm_dir: str = layout.SHM_DIR):
        self.source = ShmSource(pid, shm_dir=shm_dir, advertise=False)  # a viewer: stores nothing
        self.live = LiveStats(pid)

    def row(self) -> dict | None:
        while (columns := self.source.poll()) is not None:
            self.live.add_steps(columns)
            events = self.source.poll_request_events()
            if events is not None:
                self.live.add_request_events(events)
        if self.source.reader is None:
            return None
        counters = self.source.stats()
        drops = counters["lost"] + counters["corrupt"] + counters["writer_dropped"]
        return {**self.live.row(), "drops": drops, "source": "map (no agent)"}

    def close(self) -> None:
        self.source.close()


def _snapshot_row(snapshot: dict) -> dict:
    drops = sum(int(v) for v in snapshot.get("drops", {}).values())
    return {**snapshot["stats"], "drops": drops, "source": f"agent {snapshot['agent_pid']}"}


def _instrumented_pids(shm_dir: str = layout.SHM_DIR) -> list[int]:
    pids = []
    for path in glob.glob(os.path.join(shm_dir, "llmobs.*")):
        match = re.fullmatch(r"llmobs\.(\d+)", os.path.basename(path))
        if match and os.path.isdir(f"/proc/{match.group(1)}"):
            pids.append(int(match.group(1)))
    return sorted(pids)


_STORE_SQL = """
WITH last AS (SELECT pid, max(t_end_ns) AS t, count(*) AS tokens FROM token_steps GROUP BY pid),
recent AS (
    SELECT s.* FROM token_steps s JOIN last USING (pid) WHERE s.t_end_ns >= last.t - $window
),
steps AS (
    SELECT pid, any_value(model_id) AS model_id, string_agg(DISTINCT tenant, ',' ORDER BY tenant) AS tenants,
        count(*) / greatest((max(t_end_ns) - min(t_start_ns)) / 1e9, 1e-3) AS tokens_per_s,
        quantile_cont(latency_ns, 0.5) / 1e6 AS p50_ms, quantile_cont(latency_ns, 0.99) / 1e6 AS p99_ms,
        avg(loss) FILTER (NOT isnan(loss)) AS mean_loss, min(t_start_ns) AS since
    FROM recent GROUP BY pid
),
work AS (
    SELECT r.pid, avg(allocations) AS alloc, avg(launches) AS launch, avg(compute_calls) AS compute,
        avg(off_cpu_ns) AS offcpu
    FROM step_rollups r JOIN steps s ON r.pid = s.pid AND r.t_start_ns >= s.since GROUP BY r.pid
),
{gpu}
SELECT s.pid, s.model_id, s.tenants, l.tokens, s.tokens_per_s, s.p50_ms, s.p99_ms, s.mean_loss,
    w.alloc, w.launch, w.compute, w.offcpu, g.gpu_util, g.gpu_mem
FROM steps s JOIN last l USING (pid) LEFT JOIN work w USING (pid) LEFT JOIN gpu g USING (pid) ORDER BY s.pid
"""
# Per tenant over the same 10 s: token steps per second, and the compute-seconds (pass_shares: each
# pass's duration shared by its rows' tokens) per second, and the tenant's share of the process's
# compute-seconds in the window
_STORE_TENANTS_SQL = """
WITH last AS (SELECT pid, max(t_end_ns) AS t FROM token_steps GROUP BY pid),
steps AS (
    SELECT s.pid, coalesce(s.tenant, '') AS tenant, count(*) AS tokens, min(s.t_start_ns) AS since,
        max(s.t_end_ns) AS until
    FROM token_steps s JOIN last USING (pid) WHERE s.t_end_ns >= last.t - $window GROUP BY ALL
),
span AS (SELECT pid, greatest((max(until) - min(since)) / 1e9, 1e-3) AS s FROM steps GROUP BY pid),
work AS (
    SELECT w.pid, coalesce(w.tenant, '') AS tenant, sum(w.compute_ns) AS compute_ns
    FROM pass_shares w JOIN last USING (pid) WHERE w.t_start_ns >= last.t - $window GROUP BY ALL
)
SELECT pid, tenant, coalesce(s.tokens, 0) / p.s, coalesce(w.compute_ns, 0) / 1e9 / p.s,
    w.compute_ns / nullif(sum(w.compute_ns) OVER (PARTITION BY pid), 0)
FROM steps s FULL JOIN work w USING (pid, tenant) JOIN span p USING (pid)
ORDER BY pid, 4 DESC, 3 DESC, tenant
"""
# NVML samples of the same 10 s: SM utilisation averaged, each GPU's newest process memory summed
_STORE_GPU = """
gpu_each AS (
    SELECT g.pid, g.gpu_index, avg(g.sm_util) AS util, arg_max(g.mem_used, g.ts_ns) AS mem
    FROM gpu_samples g JOIN last l ON g.pid = l.pid AND g.ts_ns >= l.t - $window GROUP BY ALL
),
gpu AS (SELECT pid, avg(util) AS gpu_util, sum(mem) AS gpu_mem FROM gpu_each GROUP BY pid)
"""
# a store older than the gpu_samples table (schema 6), opened read-only: no GPU numbers
_STORE_NO_GPU = "gpu AS (SELECT NULL::INTEGER AS pid, NULL::DOUBLE AS gpu_util, NULL::BIGINT AS gpu_mem)"


def store_rows(path: Path) -> list[dict]:
    """Rows from a store no agent is writing: its newest WINDOW_S seconds of each process."""
    from llmobs.store.sink import DuckDBStore

    with DuckDBStore(path, read_only=True) as store:
        conn = store.connection
        has_gpu = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'gpu_samples'"
        ).fetchall()[0][0]
        sql = _STORE_SQL.format(gpu=_STORE_GPU if has_gpu else _STORE_NO_GPU)
        result = conn.execute(sql, {"window": int(WINDOW_S * 1e9)}).fetchall()
        rates: dict[int, list[dict]] = {}
        if schema.current_version(conn) >= SHARES_VERSION:  # an older store has no pass_shares
            for pid, tenant, rate, compute, share in conn.execute(
                _STORE_TENANTS_SQL, {"window": int(WINDOW_S * 1e9)}
            ).fetchall():
                rates.setdefault(pid, []).append(
                    {
                        "tenant": tenant,
                        "tokens_per_s": rate,
                        "compute_s_per_s": compute,
                        "compute_share": share,
                    }
                )
    rows = []
    for pid, model, tenants, tokens, rate, p50, p99, loss, alloc, launch, compute, offcpu, gpu, mem in result:
        per_step = (
            {} if alloc is None else {"alloc": alloc, "launch": launch, "compute": compute, "offcpu": offcpu}
        )
        rows.append({
            "pid": pid, "model_id": model, "tenants": (tenants or "").split(","), "tokens": tokens,
            "tokens_per_s": rate, "p50_ms": p50, "p99_ms": p99, "mean_loss": loss, "per_step": per_step,
            "drops": None, "gpu_util_pct": gpu, "gpu_mem_bytes": mem, "source": "store (newest 10 s)",
            "by_tenant": rates.get(pid, []),
        })  # fmt: skip
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(rows: list[dict]) -> str:
    """The table: one line per process, numbers right-aligned, '-' where unknown."""
    cells = [COLUMNS]
    for row in rows:
        work = row.get("per_step") or {}
        offcpu = work.get("offcpu")
        offcpu_ms = None if offcpu is None else offcpu / 1e6
        gpu_mem = row.get("gpu_mem_bytes")
        gpu_mib = None if gpu_mem is None else gpu_mem / 2**20
        cells.append((
            str(row["pid"]), (row.get("model_id") or "-")[:24], ",".join(row.get("tenants") or []) or "-",
            _fmt(row.get("tokens"), ","), _fmt(row.get("tokens_per_s"), ".1f"),
            _fmt(row.get("p50_ms"), ".2f"), _fmt(row.get("p99_ms"), ".2f"), _fmt(row.get("mean_loss"), ".3f"),
            _fmt(work.get("alloc"), ",.1f"), _fmt(work.get("launch"), ",.1f"),
            _fmt(work.get("compute"), ",.1f"), _fmt(offcpu_ms, ".2f"), _fmt(row.get("drops"), ","),
            _fmt(row.get("gpu_util_pct"), ".0f"), _fmt(gpu_mib, ",.0f"), row["source"],
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    left = {1, 2, len(COLUMNS) - 1}
    lines = []
    for line in cells:
        padded = (c.ljust(widths[i]) if i in left else c.rjust(widths[i]) for i, c in enumerate(line))
        lines.append("  ".join(padded))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def render_tenants(rows: list[dict]) -> str:
    """Per-tenant rates of each process (a server's tenants): tokens/s, compute-seconds per second
    (its rows' shares of the forward passes' durations) and the tenant's share of that; '' = no tenant."""
    cells = [TENANT_COLUMNS]
    for row in rows:
        for t in row.get("by_tenant") or []:
            share = t.get("compute_share")
            cells.append((
                str(row["pid"]), t["tenant"] or "-", _fmt(t.get("tokens_per_s"), ".1f"),
                _fmt(t.get("compute_s_per_s"), ".3f"), _fmt(None if share is None else 100 * share, ".1f"),
            ))  # fmt: skip
    if len(cells) == 1:
        return ""
    widths = [max(len(line[i]) for line in cells) for i in range(len(TENANT_COLUMNS))]
    lines = ["  ".join(c.ljust(widths[i]) if i == 1 else c.rjust(widths[i]) for i, c in enumerate(line))
             for line in cells]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines) + "\n"


def agent_lines(rows: list[dict]) -> list[str]:
    """One header line per attached agent: its own CPU, RSS, events and drops, and the overhead
    governor's state for its process (from the `agent` field of the snapshot: governor.telemetry)."""
    lines = []
    for row in rows:
        agent = row.get("agent")
        if not agent:
            continue
        line = (
            f"agent {agent.get('agent_pid', '?')}: cpu {agent.get('cpu_percent', 0):.1f}%  "
            f"rss {agent.get('rss_bytes', 0) / 2**20:,.0f} MiB  events {agent.get('events', 0):,}  "
            f"drops kernel {agent.get('drops_kernel', 0):,} user {agent.get('drops_user', 0):,}"
        )
        if agent.get("export_failures") is not None:
            line += f"  export failures {agent['export_failures']:,}"
        if agent.get("anomaly_lag_s") is not None:  # the live detectors falling behind shows here
            line += (f"  anomaly lag {agent['anomaly_lag_s'] * 1e3:,.0f} ms"
                     f" ({agent.get('anomaly_rows_late', 0):,} rows late)")  # fmt: skip
        governor = agent.get("governor")
        if governor is None:
            line += "  | governor off"
        else:
            shed = ",".join(governor.get("shed") or []) or "none"
            line += (
                f"  | governor {governor['budget']:.2%}: pid {row['pid']} est. slowdown "
                f"{governor.get('estimate', 0):.2%}, shed {shed}"
            )
            if governor.get("last"):
                line += f" (last: {governor['last']})"
        lines.append(line)
    return lines


class Top:
    """Collects the rows of one refresh from snapshots, maps and (when free) the store."""

    def __init__(self, args: argparse.Namespace, shm_dir: str = layout.SHM_DIR):
        self.pids = args.pid
        self.shm_dir = shm_dir
        self.db = None if args.db is None else Path(args.db or default_db_path()).resolve()
        self.watchers: dict[int, MapWatcher] = {}
        if self.pids:
            from llmobs.shm.reader import ShmReader

            for pid in self.pids:  # a wrong pid is one clear error up front, not an empty table
                with ShmReader(pid, shm_dir=shm_dir):
                    pass

    def rows(self) -> list[dict]:
        snapshots = read_snapshots()
        if self.db is not None:
            mine = [s for s in snapshots if Path(s.get("db", "")).resolve() == self.db]
            if mine:
                return [_snapshot_row(s) for s in sorted(mine, key=lambda s: s["pid"])]
            try:
                return store_rows(self.db)
            except StoreError as exc:
                if "lock" in str(exc).lower():
                    raise StoreError(
                        f"{self.db} is being written by another process that publishes no snapshot",
                        hint="run `top` as the agent's user, or `top --pid N` to read the process's map",
                    ) from None
                raise
        by_pid = {s["pid"]: s for s in snapshots}
        wanted = self.pids or sorted(set(by_pid) | set(_instrumented_pids(self.shm_dir)))
        rows = []
        for pid in wanted:
            if pid in by_pid:
                rows.append(_snapshot_row(by_pid[pid]))
                continue
            watcher = self.watchers.get(pid) or self.watchers.setdefault(pid, MapWatcher(pid, self.shm_dir))
            row = watcher.row()
            if row is not None:
                rows.append(row)
        return rows

    def close(self) -> None:
        for watcher in self.watchers.values():
            watcher.close()


def run(args: argparse.Namespace) -> int:
    # Argument mistakes are usage errors (exit 2), said before any map or store is opened. A NaN
    # interval made the loop spin (time.sleep's ValueError is suppressed below), an infinite one a
    # traceback (OverflowError), and --iterations 0 (falsy) refreshed forever.
    if not (math.isfinite(args.interval) and args.interval > 0):
        raise UsageError(f"--interval must be a positive number of seconds, not {args.interval:g}", hint=HINT)
    if args.iterations is not None and args.iterations < 1:
        raise UsageError(f"--iterations must be at least 1, not {args.iterations}", hint=HINT)
    top = Top(args)
    tty = sys.stdout.isatty() and not args.once
    shown = 0
    try:
        while True:
            began = clock.monotonic_ns()
            rows = top.rows()
            if args.once and not rows:
                raise NotTracked(
                    "no attached or instrumented process to show",
                    hint="start `llmobs-agent attach --pid N --db`, or instrument the workload",
                )
            header = f"llmobs top  {wall_time()}  {len(rows)} process(es); window {WINDOW_S:.0f} s"
            header = "\n".join([header, *agent_lines(rows)])
            tenants = render_tenants(rows)
            text = f"{header}\n{render(rows)}" if rows else f"{header}\n(no process)\n"
            if tenants:
                text += f"\nper tenant (window {WINDOW_S:.0f} s)\n{tenants}"
            sys.stdout.write((_CLEAR + text) if tty else text + ("" if args.once else "\n"))
            sys.stdout.flush()
            shown += 1
            if args.once or (args.iterations and shown >= args.iterations):
                return 0
            with contextlib.suppress(ValueError):
                time.sleep(max(args.interval - (clock.monotonic_ns() - began) / 1e9, 0.05))
    except KeyboardInterrupt:
        return 0
    finally:
        top.close()
