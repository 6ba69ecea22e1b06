"""GPU and host evidence of one forward pass, against the process's recent baseline.

For a step (pid, step_seq) that correlate has rolled up, each measure of its step_rollups row (decode
latency, kernel launches, GPU time, off-CPU time, page faults, allocations, ...) is compared with the
same measure over the process's previous BASELINE_STEPS forward passes: the median, and a robust z
(0.6745 (x - median) / MAD). A measure is *unusual* when it is both far out (z above Z_UNUSUAL, with
the MAD floored so a constant baseline needs a real change) and materially larger (RATIO_UNUSUAL x the
median, or present where the baseline had none). Kernels (gpu_ops of the step, by name) get the same
treatment: slow kernels and extra kernels the baseline steps did not run. Unusual items are ranked by
z. The result is JSON for the anomaly row's `evidence` column; `summary()` is one line of it.
"""

from __future__ import annotations

import json

import duckdb
import numpy as np

from llmobs import clock

BASELINE_STEPS = 32  # previous forward passes of the process the step is compared with
MIN_BASELINE = 4  # fewer previous passes: no verdicts, the numbers only
Z_UNUSUAL = 3.5
RATIO_UNUSUAL = 1.5
MAX_STEPS_PER_REFRESH = 500  # anomalous steps evidenced per refresh call (bounded work per run)

# step_rollups measure -> (what it is called when unusual, unit)
MEASURES: dict[str, tuple[str, str]] = {
    "decode_latency_ns": ("slow step", "ns"),
    "launches": ("extra kernel launches", "count"),
    "gpu_ns": ("slow kernels (GPU time)", "ns"),
    "off_cpu_ns": ("off-CPU time", "ns"),
    "page_faults": ("page faults", "count"),
    "allocations": ("allocation burst (count)", "count"),
    "alloc_bytes": ("allocation burst (bytes)", "bytes"),
    "memcpy_bytes": ("memcpy volume", "bytes"),
    "compute_calls": ("extra compute calls", "count"),
}
# The floor of a baseline's MAD: 5% of its median, and 1 unit. A baseline that never moved (MAD 0)
# would otherwise make any change infinitely unusual; with the floor a step must move by more than
# Z_UNUSUAL / 0.6745 * 5% (~26%) of the median, and by RATIO_UNUSUAL, to be called unusual.
MAD_FLOOR_FRACTION = 0.05
# ... and an absolute floor per unit: what is too small to call a change at all. Counts of a baseline
# that never moved (the kernels of a decode step are deterministic) may move by one: the ratio test
# then decides (2 calls of a kernel where every previous step had 1 is unusual; 4 faults for 3 is not).
UNIT_FLOOR = {"ns": 1_000.0, "bytes": 4096.0, "count": 0.1}
EXTRA_Z = 99.0  # the rank of a kernel the baseline steps never ran: above any measured z


def _median(values: list[float]) -> float:
    """np.median's value (the mean of the middle two of an even count), for a baseline's ~32 numbers in
    Python: np.median's fixed cost a call (~60 us here) was most of an anomalous step's evidence."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _robust(value: float, base: list[float], unit: str) -> tuple[float, float, float]:
    """(median, MAD, robust z of value) of a baseline."""
    median = _median(base)
    mad = _median([abs(b - median) for b in base])
    floor = max(mad, abs(median) * MAD_FLOOR_FRACTION, UNIT_FLOOR[unit])
    return median, mad, 0.6745 * (value - median) / floor


def _unusual(value: float, median: float, z: float) -> bool:
    if value <= median or z < Z_UNUSUAL:
        return False
    return median <= 0 or value >= RATIO_UNUSUAL * median


def gather(
    conn: duckdb.DuckDBPyConnection, pid: int, step_seq: int, baseline: int = BASELINE_STEPS
) -> dict | None:
    """The evidence of one forward pass, or None when correlate has not rolled it up yet."""
    rows = conn.execute(
        f"""SELECT step_seq, {", ".join(MEASURES)}, counts_exact FROM step_rollups
            WHERE pid = $pid AND step_seq <= $seq ORDER BY step_seq DESC LIMIT $n""",
        {"pid": pid, "seq": step_seq, "n": baseline + 1},
    ).fetchall()
    if not rows or rows[0][0] != step_seq:
        return None
    previous = [r[0] for r in rows[1:]]
    kernels = _kernel_table(conn, pid, [step_seq, *previous]) if len(previous) >= MIN_BASELINE else {}
    return _evidence(pid, rows[0], rows[1:], kernels)


def gather_many(
    conn: duckdb.DuckDBPyConnection, pid: int, step_seqs: list[int], baseline: int = BASELINE_STEPS
) -> dict[int, dict]:
    """`gather` of many forward passes of one pid, set-based: one range query of step_rollups per
    cluster of nearby steps and one gpu_ops query for all of them, instead of ~3 queries per step.
    Steps not rolled up are left out; a step whose range lacks its baseline (a gap in the passes)
    falls back to `gather`. Same results as `gather` step by step."""
    out: dict[int, dict] = {}
    targets = sorted(set(step_seqs))
    span = 2 * baseline + 16  # passes are numbered consecutively: this reaches back a full baseline
    clusters: list[list[int]] = []
    for seq in targets:
        if clusters and seq - clusters[-1][-1] <= span:
            clusters[-1].append(seq)
        else:
            clusters.append([seq])
    fetched: dict[int, tuple[list, list]] = {}  # target -> (its row, its previous rows, newest first)
    for cluster in clusters:
        rows = conn.execute(
            f"""SELECT step_seq, {", ".join(MEASURES)}, counts_exact FROM step_rollups
                WHERE pid = $pid AND step_seq BETWEEN $lo AND $hi ORDER BY step_seq""",
            {"pid": pid, "lo": cluster[0] - span, "hi": cluster[-1]},
        ).fetchall()
        index = {r[0]: i for i, r in enumerate(rows)}
        for seq in cluster:
            i = index.get(seq)
            if i is None:
                continue  # not rolled up (yet)
            if i >= baseline:
                fetched[seq] = (rows[i], rows[i - baseline : i][::-1])
                continue
            # the range holds fewer previous passes (a gap, or the session's first passes): the
            # per-step query looks further back
            evidence = gather(conn, pid, seq, baseline)
            if evidence is not None:
                out[seq] = evidence
    wanted = {r[0] for this, prev in fetched.values() if len(prev) >= MIN_BASELINE for r in (this, *prev)}
    kernels = _kernel_table(conn, pid, sorted(wanted)) if wanted else {}
    for seq, (this, previous) in fetched.items():
        out[seq] = _evidence(pid, this, previous, kernels)
    return out


def _evidence(pid: int, this: tuple, previous: list, kernels: dict) -> dict:
    """The evidence of the pass of rollup row `this` against the rows `previous` (newest first)."""
    columns = list(MEASURES)
    step_seq = this[0]
    step = {c: this[1 + i] for i, c in enumerate(columns)}
    out: dict = {"pid": pid, "step_seq": step_seq, "baseline_steps": len(previous),
                 "counts_exact": bool(this[-1]), "step": step, "baseline": {}, "unusual": []}  # fmt: skip
    for i, column in enumerate(columns):
        value = step[column]
        base = [float(r[1 + i]) for r in previous if r[1 + i] is not None]
        if value is None or len(base) < MIN_BASELINE:
            continue
        median, mad, z = _robust(float(value), base, MEASURES[column][1])
        out["baseline"][column] = {"median": median, "mad": mad}
        if _unusual(float(value), median, z):
            what, unit = MEASURES[column]
            out["unusual"].append(_item(what, column, unit, value, median, z))
    out["unusual"].extend(_kernels(kernels, step_seq, [r[0] for r in previous]))
    out["unusual"].sort(key=lambda u: -u["z"])
    return out


def _item(what: str, measure: str, unit: str, value, median: float, z: float) -> dict:
    ratio = round(float(value) / median, 2) if median > 0 else None
    return {"what": what, "measure": measure, "unit": unit, "value": value, "baseline": median,
            "ratio": ratio, "z": round(z, 2)}  # fmt: skip


def _kernel_table(conn, pid: int, steps: list[int]) -> dict[str, dict[int, tuple[int, int]]]:
    """kernel name -> {step_seq: (calls, ns)} of these forward passes of pid (one gpu_ops query)."""
    per = conn.execute(
        """SELECT coalesce(external_id, step_seq) AS s, coalesce(name, probe) AS kernel, count(*) AS n,
                  sum(coalesce(gpu_end_ns - gpu_start_ns, duration_ns)) AS ns
           FROM gpu_ops WHERE pid = $pid AND coalesce(external_id, step_seq) IN (SELECT unnest($steps))
           GROUP BY ALL""",
        {"pid": pid, "steps": steps},
    ).fetchall()
    found: dict[str, dict[int, tuple[int, int]]] = {}
    for s, kernel, n, ns in per:
        found.setdefault(kernel, {})[s] = (n, ns or 0)
    return found


def _kernels(found: dict, step_seq: int, previous: list[int]) -> list[dict]:
    """Slow or extra GPU kernels of the step, by name, against the same names in the previous steps."""
    if len(previous) < MIN_BASELINE or not found:
        return []
    items = []
    for kernel, by_step in found.items():
        if step_seq not in by_step:
            continue
        n, ns = by_step[step_seq]
        counts = [float(by_step.get(s, (0, 0))[0]) for s in previous]
        times = [float(by_step.get(s, (0, 0))[1]) for s in previous]
        if not any(counts):
            items.append(_item(f"extra kernel: {kernel}", f"kernel:{kernel}", "count", n, 0.0, EXTRA_Z))
            continue
        checks = ((n, counts, "extra calls", "count"), (ns, times, "slow kernel", "ns"))
        for value, base, what, unit in checks:
            median, _mad, z = _robust(float(value), base, unit)
            if _unusual(float(value), median, z):
                items.append(_item(f"{what}: {kernel}", f"kernel:{kernel}", unit, value, median, z))
    return items


def _fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ns":
        return f"{value / 1e6:.2f} ms"
    if unit == "bytes":
        return f"{value / 1024:.1f} KiB" if value < 1 << 20 else f"{value / (1 << 20):.1f} MiB"
    return f"{value:,.0f}"


def describe(item: dict) -> str:
    """One unusual item as words with its numbers."""
    ratio = f", {item['ratio']:.1f}x" if item.get("ratio") else ""
    value, baseline = _fmt(item["value"], item["unit"]), _fmt(item["baseline"], item["unit"])
    z = f"z {item['z']:.1f}" if item["z"] < 1000 else "z > 999"
    return f"{item['what']}: {value} vs median {baseline}{ratio} ({z})"


def summary(evidence: dict | None) -> str:
    """One line: what is unusual about the step, or that nothing is."""
    if evidence is None:
        return "no evidence yet (the step is not rolled up)"
    if evidence["baseline_steps"] < MIN_BASELINE:
        return f"no baseline ({evidence['baseline_steps']} previous steps)"
    if not evidence["unusual"]:
        return f"nothing unusual in GPU/host work vs the previous {evidence['baseline_steps']} steps"
    return "; ".join(describe(u) for u in evidence["unusual"])


def refresh_evidence(
    conn: duckdb.DuckDBPyConnection, pid: int | None, since_ns: int, pages: int | None = 1
) -> int:
    """Fill (or refresh) the evidence of anomaly rows whose step is rolled up: those without evidence,
    and those detected since `since_ns` (their rollup may still change as late events arrive).
    Set-based: one query finds up to MAX_STEPS_PER_REFRESH steps (a page, in step order), `gather_many`
    computes their evidence, one UPDATE per pid writes only what changed (a recent anomaly's evidence is
    recomputed on every correlate run for a few seconds, and mostly comes out the same). A correlate run
    does one page (bounded work; what is left waits for the next run); `pages=None` goes on until every
    step is done (the session's last pass: a page each time from the start gave the session's first
    500 anomalous steps their evidence and none of the rest). Returns the anomaly rows updated."""
    updated, after, page = 0, (-1, -1), 0
    while pages is None or page < pages:
        steps = conn.execute(
            """SELECT a.pid, a.step_seq, any_value(a.evidence) FROM anomalies a
               SEMI JOIN step_rollups r ON r.pid = a.pid AND r.step_seq = a.step_seq
               WHERE (a.step_seq > $after_seq OR (a.step_seq = $after_seq AND a.pid > $after_pid))
                 AND ($pid IS NULL OR a.pid = $pid) AND (a.evidence IS NULL OR a.ts_ns >= $since)
               GROUP BY a.pid, a.step_seq ORDER BY a.step_seq, a.pid LIMIT $limit""",
            {
                "pid": pid,
                "since": since_ns,
                "limit": MAX_STEPS_PER_REFRESH,
                "after_seq": after[0],
                "after_pid": after[1],
            },  # fmt: skip
        ).fetchall()
        updated += _evidence_page(conn, steps)
        page += 1
        if len(steps) < MAX_STEPS_PER_REFRESH:
            break
        after = (steps[-1][1], steps[-1][0])  # the page is done: the next one starts after its last step
    return updated


def _evidence_page(conn: duckdb.DuckDBPyConnection, steps: list[tuple]) -> int:
    """The evidence of these (pid, step_seq, stored evidence) steps, written where it changed."""
    by_pid: dict[int, dict[int, str | None]] = {}
    for step_pid, step_seq, stored in steps:
        by_pid.setdefault(step_pid, {})[step_seq] = stored
    updated = 0
    for step_pid, stored in by_pid.items():
        changed_steps, changed = [], []
        for step_seq, evidence in gather_many(conn, step_pid, list(stored)).items():
            evidence["summary"] = summary(evidence)
            text = json.dumps(evidence, default=_json_number)
            if text != stored[step_seq]:
                changed_steps.append(step_seq)
                changed.append(text)
        if changed:
            updated += conn.execute(
                """UPDATE anomalies SET evidence = u.evidence, evidence_ns = $ns
                   FROM (SELECT unnest($steps) AS step_seq, unnest($evidence) AS evidence) u
                   WHERE anomalies.pid = $pid AND anomalies.step_seq = u.step_seq""",
                {"steps": changed_steps, "evidence": changed, "ns": clock.monotonic_ns(), "pid": step_pid},
            ).fetchall()[0][0]
    return updated


def _json_number(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")
