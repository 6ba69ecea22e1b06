"""Root-cause candidate of one token step: the layer stream that deviates most from its own baseline on
that step, weighted by how that stream moves with the process's anomalies, named by its real module.

For each stream (kind, layer, head) sampled on the step (pid, step_seq, trace_id):
  z      = 0.6745 (x - median) / MAD over the stream's values on the process's other sampled steps
           (the BASELINE_STEPS nearest before the step, else after it; MAD floored at MIN_MAD_REL of
           |median| so a perfectly flat stream does not give an infinite z)
  weight = max(|r|, MIN_WEIGHT), r = the stream's point-biserial correlation with anomalies
           (llmobs.diagnostics.correlation); MIN_WEIGHT when the process has no anomaly yet
  score  = |z| x weight, for the streams with |z| >= MIN_Z only (a stream that follows the anomalies
           elsewhere but is normal on this step is no cause of this step)
A fault in a layer propagates downstream: every later layer's stream may deviate too, some even more
once the residual stream has grown. So among the streams scoring at least UPSTREAM_SHARE of the best,
the earliest layer is the candidate (ties by score); the evidence lists the runners-up.

When the store holds a replay of the step (llmobs-agent replay, issue 17), its full per-head streams
come first: the target pass's robust z of every (layer, head) against the replayed window's other passes
(llmobs.diagnostics.replay.replay_root_cause); the sampled streams above are the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmobs.diagnostics.correlation import correlation_matrix, fallback_module, kind_name

MAD_TO_Z = 0.6745
BASELINE_STEPS = 64  # sampled steps of the same process that make a stream's baseline
MIN_BASELINE = 4  # fewer: the stream is not scored
MIN_MAD_REL = 1e-3  # MAD floor, relative to |median|
MIN_WEIGHT = 0.1  # a stream's weight when its correlation with anomalies is unknown or near 0
UPSTREAM_SHARE = 0.5  # streams within this share of the best score compete on layer order
MIN_Z = 3.5  # below this robust z no stream is unusual enough to name


@dataclass
class RootCause:
    module: str
    score: float
    evidence: list[str] = field(default_factory=list)
    kind: int = 0
    layer: int = 0
    head: int = -1
    z: float = 0.0
    r: float | None = None


def _robust_z(x: float, baseline: np.ndarray) -> tuple[float, float, float]:
    median = float(np.median(baseline))
    mad = float(np.median(np.abs(baseline - median)))
    floor = max(mad, MIN_MAD_REL * abs(median), 1e-12)
    return MAD_TO_Z * (x - median) / floor, median, mad


def _baselines(conn, pid: int, step_seq: int) -> dict[tuple[int, int, int], np.ndarray]:
    """(kind, layer, head) -> values on up to BASELINE_STEPS other sampled steps (nearest first)."""
    rows = conn.execute(
        """
        WITH other AS (
            SELECT kind, layer, head, value, step_seq,
                row_number() OVER (PARTITION BY kind, layer, head
                                   ORDER BY (step_seq > $seq), abs(step_seq - $seq)) AS k
            FROM layer_streams
            WHERE pid = $pid AND isfinite(value) AND step_seq <> $seq  -- every row of the step is suspect
        )
        SELECT kind, layer, head, list(value) FROM other WHERE k <= $limit GROUP BY kind, layer, head
        """,
        {"pid": pid, "seq": step_seq, "limit": BASELINE_STEPS},
    ).fetchall()
    return {(int(k), int(la), int(h)): np.asarray(v, np.float64) for k, la, h, v in rows}


def root_cause(conn, pid: int, step_seq: int, trace_id: str | None = None) -> RootCause | None:
    """The module most likely behind the step's anomaly, or None when the step has no layer streams,
    no baseline, or nothing deviates (robust z < MIN_Z)."""
    replayed = _from_replay(conn, pid, step_seq, trace_id)
    if replayed is not None:
        return replayed
    params = {"pid": pid, "seq": step_seq, "trace": trace_id}
    rows = conn.execute(
        "SELECT kind, layer, head, avg(value) FROM layer_streams WHERE pid = $pid AND step_seq = $seq"
        " AND ($trace IS NULL OR trace_id = $trace) AND isfinite(value) GROUP BY kind, layer, head",
        params,
    ).fetchall()
    if not rows:
        return None
    baselines = _baselines(conn, pid, step_seq)
    matrix = {(c.kind, c.layer, c.head): c for c in correlation_matrix(conn, pid)}
    scored = []
    for kind, layer, head, value in rows:
        key = (int(kind), int(layer), int(head))
        base = baselines.get(key)
        if base is None or len(base) < MIN_BASELINE:
            continue
        z, median, mad = _robust_z(float(value), base)
        corr = matrix.get(key)
        r = corr.r if corr is not None else None
        weight = max(abs(r), MIN_WEIGHT) if r is not None else MIN_WEIGHT
        name = corr.module if corr is not None else fallback_module(layer, kind, head)
        scored.append((abs(z) * weight, key, name, float(value), z, median, mad, r, len(base)))
    scored = [s for s in scored if abs(s[4]) >= MIN_Z]  # only a stream that deviates can be the cause
    if not scored:
        return None
    scored.sort(key=lambda s: -s[0])
    best = scored[0][0]
    upstream = [s for s in scored if s[0] >= UPSTREAM_SHARE * best]
    pick = min(upstream, key=lambda s: (s[1][1], -s[0]))
    score, (kind, layer, head), name, value, z, median, mad, r, n = pick
    r_text = f"{r:+.2f}" if r is not None else "n/a (no anomalies to correlate with)"
    evidence = [
        f"{name}: {kind_name(kind)} {value:.6g} vs baseline median {median:.6g} (MAD {mad:.3g}, "
        f"{n} sampled steps): robust z {z:+.1f}",
        f"correlation of this stream with the process's anomalies: r {r_text}",
    ]
    if pick is not scored[0]:
        evidence.append(
            f"earliest of {len(upstream)} streams within {UPSTREAM_SHARE:.0%} of the top score: a fault "
            "propagates to later layers"
        )
    for other in scored[:4]:
        if other is not pick:
            evidence.append(f"also deviating: {other[2]} {kind_name(other[1][0])} z {other[4]:+.1f}, "
                            f"score {other[0]:.1f}")  # fmt: skip
    return RootCause(name, float(score), evidence, kind, layer, head, float(z), r)


def _from_replay(conn, pid: int, step_seq: int, trace_id: str | None) -> RootCause | None:
    """The candidate from the newest ok replay of the step's full per-head streams; None: no replay
    (or a store from before replays), or nothing in it deviates."""
    import duckdb

    from llmobs.diagnostics import replay

    try:
        found = conn.execute(
            """SELECT r.replay_id, s.pass FROM replays r JOIN replay_steps s
                   ON s.replay_id = r.replay_id AND s.repeat = 0 AND s.step_seq = r.target_step_seq
               WHERE r.pid = $pid AND r.target_step_seq = $seq AND r.status = 'ok'
                 AND ($trace IS NULL OR r.trace_id = $trace)
               ORDER BY r.ts_ns DESC LIMIT 1""",
            {"pid": pid, "seq": step_seq, "trace": trace_id},
        ).fetchall()
    except duckdb.Error:
        return None
    if not found:
        return None
    replay_id, target = found[0]
    rows = conn.execute(
        "SELECT pass, layer, head, attn_entropy, mlp_var FROM replay_layers"
        " WHERE replay_id = ? AND repeat = 0",
        [replay_id],
    ).fetchnumpy()
    if not len(rows["pass"]):
        return None
    passes, layers = int(rows["pass"].max()) + 1, int(rows["layer"].max()) + 1
    heads = max(int(rows["head"].max()) + 1, 1)
    attn = np.full((1, passes, layers, heads), np.nan)
    mlp = np.full((1, passes, layers), np.nan)
    p, la, h = rows["pass"].astype(int), rows["layer"].astype(int), rows["head"].astype(int)
    with_head = h >= 0
    attn[0, p[with_head], la[with_head], h[with_head]] = _floats(rows["attn_entropy"])[with_head]
    mlp[0, p, la] = _floats(rows["mlp_var"])
    arrays = {"attn_entropy": attn, "mlp_var": mlp, "loss": np.zeros((1, passes))}
    best = replay.replay_root_cause(arrays, int(target))
    if best is None:
        return None
    name = _module_name(conn, pid, best.kind, best.layer, best.head)
    evidence = [
        f"{name}: {kind_name(best.kind)} {best.value:.6g} on the replayed step vs median {best.median:.6g}"
        f" of the replayed window's other {best.others} passes (MAD {best.mad:.3g}): robust z {best.z:+.1f}",
        f"from replay {replay_id}: the full per-head streams of the window, recomputed in the workload",
    ]
    for kind, layer, head, z in best.runners_up:
        evidence.append(f"also deviating: {fallback_module(layer, kind, head)} z {z:+.1f}")
    return RootCause(name, abs(best.z), evidence, best.kind, best.layer, best.head, best.z, None)


def _floats(values) -> np.ndarray:
    """A fetched FLOAT column as float64 with NULL as NaN (fetchnumpy gives a masked array for NULLs)."""
    return np.ma.filled(np.ma.asarray(values, dtype=np.float64), np.nan)


def _module_name(conn, pid: int, kind: int, layer: int, head: int) -> str:
    rows = conn.execute(
        "SELECT module FROM layer_modules WHERE pid = ? AND kind = ? AND layer = ? LIMIT 1",
        [pid, kind, layer],
    ).fetchall()
    if not rows:
        return fallback_module(layer, kind, head)
    return rows[0][0] + (f" head {head}" if head >= 0 else "")
