"""A replay result file (CMD_REPLAY, docs/replay.md) into the store: its verdict and rows in one
transaction (an agent killed mid-ingest leaves no half-written replay).

`ingest_file(store, path)` reads the .npz (np.load without pickles), looks up what the store recorded
about the replayed steps (their losses, the live `linear` probe's hits on the target's pass, the op
graphs of earlier replays of the same model), decides the verdict (llmobs.diagnostics.replay), and
appends one `replays` row with its `replay_steps`, `replay_layers` and `replay_ops` rows through
DuckDBStore.append (one transaction for every table of the batch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from llmobs import clock
from llmobs.diagnostics import replay as verdicts
from llmobs.errors import StoreError


@dataclass(frozen=True)
class Target:
    """The replayed token step as the store knows it."""

    pid: int
    step_seq: int
    batch_row: int
    trace_id: str | None = None
    step: int | None = None
    first_step_seq: int | None = None


@dataclass(frozen=True)
class Ingested:
    replay_id: str
    result: verdicts.ReplayFile
    verdict: verdicts.Verdict
    target: Target
    rows: dict[str, int]


def load(path: str) -> verdicts.ReplayFile:
    """The result file at `path`; BadResult when it is not one."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return verdicts.from_arrays({key: data[key] for key in data.files})
    except (OSError, ValueError, EOFError) as exc:
        if isinstance(exc, verdicts.BadResult):
            raise
        raise verdicts.BadResult(f"cannot read {path}: {exc}") from None


def replay_id(pid: int, step_seq: int, batch_row: int, ack_step_seq: int) -> str:
    return f"{pid}-{step_seq}-{batch_row}-{ack_step_seq}"


def find_target(conn, pid: int, step_seq: int, batch_row: int) -> Target:
    """The token step (pid, step_seq, batch_row) with its request key; trace_id None when not stored."""
    rows = conn.execute(
        "SELECT trace_id, step FROM token_steps WHERE pid = ? AND step_seq = ? AND coalesce(batch_row, 0) = ?"
        " ORDER BY step LIMIT 1",
        [pid, step_seq, batch_row],
    ).fetchall()
    if not rows:
        return Target(pid, step_seq, batch_row)
    trace, step = rows[0]
    step = int(step or 0)
    return Target(pid, step_seq, batch_row, trace, step, step_seq - step)


def recorded(conn, target: Target, result: verdicts.ReplayFile) -> verdicts.Recorded:
    """What the store recorded about the replayed steps of `target`'s request."""
    losses: dict[int, float] = {}
    if target.trace_id is not None and result.ok:
        steps = sorted({int(s) for s in result.arrays["step_index"].tolist() if s >= 0})
        rows = conn.execute(
            """SELECT step, loss FROM token_steps
               WHERE pid = $pid AND trace_id = $trace AND coalesce(batch_row, 0) = $row
                 AND step_seq - coalesce(step, 0) = $first AND step IN (SELECT unnest($steps::INTEGER[]))""",
            {"pid": target.pid, "trace": target.trace_id, "row": target.batch_row,
             "first": target.first_step_seq, "steps": steps},
        ).fetchall()  # fmt: skip
        losses = {int(s): float(loss) for s, loss in rows if loss is not None}
    live = conn.execute(
        "SELECT sum(count) FROM probe_aggregates WHERE pid = ? AND step_seq = ? AND probe = 'linear'",
        [target.pid, target.step_seq],
    ).fetchall()[0][0]
    earlier = conn.execute(
        "SELECT DISTINCT op_graph_hash FROM replays WHERE model = ? AND status = 'ok' AND op_graph_hash"
        " IS NOT NULL",
        [result.meta.get("model") or ""],
    ).fetchall()
    return verdicts.Recorded(losses, None if live is None else int(live), tuple(int(h) for (h,) in earlier))


def ingest_file(store, path: str, *, ack_step_seq: int, trigger: str = "command",
                target: Target | None = None) -> Ingested:  # fmt: skip
    """Read, decide and store the replay in `path` (one transaction). `target` defaults to what the
    file's meta names. Raises BadResult (not a replay file) or StoreError."""
    result = load(path)
    meta = result.meta
    with store.cursor() as conn:
        if target is None:
            target = find_target(conn, int(meta["pid"]), int(meta["target_step_seq"]),
                                 int(meta.get("target_batch_row") or 0))  # fmt: skip
        replayed = meta.get("trace_id")
        if replayed and target.trace_id and replayed != target.trace_id:  # e.g. the pid was reused
            raise verdicts.BadResult(f"the file replays trace {replayed}, not the stored {target.trace_id}")
        known = recorded(conn, target, result)
    verdict = verdicts.decide(result, known)
    rid = replay_id(target.pid, target.step_seq, target.batch_row, ack_step_seq)
    batch = rows_of(rid, result, verdict, known, target, trigger, clock.monotonic_ns())
    rows = store.append(batch)
    return Ingested(rid, result, verdict, target, rows)


def rows_of(rid: str, result: verdicts.ReplayFile, v: verdicts.Verdict, known: verdicts.Recorded,
            target: Target, trigger: str, now_ns: int) -> dict:  # fmt: skip
    """The replay's rows, {table: columns}, for DuckDBStore.append."""
    meta = result.meta
    root = v.root
    replay = {
        "replay_id": [rid], "pid": [target.pid], "trace_id": [target.trace_id or meta.get("trace_id")],
        "first_step_seq": [target.first_step_seq], "target_step_seq": [target.step_seq],
        "target_batch_row": [target.batch_row], "step": [target.step],
        "window_steps": [meta.get("window")], "status": [meta.get("status") or "failed"],
        "reason": [meta.get("reason") or None], "source": [meta.get("source")],
        "snapshot_len": [meta.get("snapshot_len")], "snapshot_dropped": [bool(meta.get("snapshot_dropped"))],
        "model": [meta.get("model") or None], "layers": [meta.get("layers")], "heads": [meta.get("heads")],
        "repeats": [meta.get("repeats")], "live_batch_size": [meta.get("live_batch_size")],
        "verdict": [v.verdict], "verdict_detail": [v.detail],
        "first_diverging_layer": [v.first_diverging_layer], "cause": [v.cause],
        "recorded_loss": [v.recorded_loss], "replay_loss": [v.replay_loss], "loss_diff": [v.loss_diff],
        "op_hash": [v.op_hash], "op_graph_hash": [v.graph_hash], "linear_calls": [v.linear_calls],
        "live_linear_calls": [known.live_linear_calls], "root_layer": [root.layer if root else None],
        "root_head": [root.head if root else None], "root_z": [root.z if root else None],
        "wall_ms": [_float(meta.get("wall_ms"))], "prefill_ms": [_float(meta.get("prefill_ms"))],
        "t_start_ns": [meta.get("t_start_ns")], "t_end_ns": [meta.get("t_end_ns")], "trigger": [trigger],
        "meta": [json.dumps(meta, sort_keys=True)], "ts_ns": [now_ns],
    }  # fmt: skip
    batch = {"replays": _typed_replay(replay)}
    if not result.ok or not result.passes:
        return batch
    a = result.arrays
    r, n = a["loss"].shape
    rep, pas = np.repeat(np.arange(r), n), np.tile(np.arange(n), r)
    step = a["step_index"][pas].astype(np.int32)
    losses = np.asarray([known.losses.get(int(s), np.nan) for s in step], np.float32)
    batch["replay_steps"] = {
        "replay_id": [rid] * (r * n), "repeat": rep.astype(np.int16), "pass": pas.astype(np.int32),
        "step": step, "position": a["positions"][pas].astype(np.int32), "step_seq": a["step_seq"][pas],
        "loss": a["loss"].reshape(-1), "entropy": a["entropy"].reshape(-1), "recorded_loss": losses,
        "top5_ids": a["top5_ids"].reshape(r * n, -1).tolist(),
        "top5_probs": a["top5_probs"].reshape(r * n, -1).tolist(),
        "op_hash": a["op_hash"].reshape(-1), "graph_hash": a["graph_hash"].reshape(-1),
        "linear_calls": a["linear_calls"].reshape(-1), "ts_ns": np.full(r * n, now_ns, np.int64),
    }  # fmt: skip
    batch["replay_layers"] = _layer_rows(rid, a, now_ns)
    if result.ops:
        m = len(result.ops)
        batch["replay_ops"] = {"replay_id": [rid] * m, "seq": np.arange(m, dtype=np.int32),
                               "op": list(result.ops), "ts_ns": np.full(m, now_ns, np.int64)}  # fmt: skip
    return batch


def _layer_rows(rid: str, a: dict, now_ns: int) -> dict:
    """One row per (repeat, pass, layer, head): the head's attention entropy with its layer's MLP variance,
    fingerprint and (repeat 0) max |diff|; head -1 when the model reported no heads."""
    attn = a["attn_entropy"]
    r, n, layers, heads = attn.shape
    h = max(heads, 1)
    if heads == 0:
        attn = np.full((r, n, layers, 1), np.nan, np.float32)
    rep, pas, lay, hd = (x.reshape(-1) for x in np.meshgrid(np.arange(r), np.arange(n), np.arange(layers),
                                                              np.arange(h), indexing="ij"))  # fmt: skip
    maxdiff = np.where(rep == 0, a["layer_maxdiff"][pas, lay], np.nan).astype(np.float32)
    return {
        "replay_id": [rid] * len(rep), "repeat": rep.astype(np.int16), "pass": pas.astype(np.int32),
        "step": a["step_index"][pas].astype(np.int32), "layer": lay.astype(np.int16),
        "head": (hd if heads else np.full(len(hd), -1)).astype(np.int16),
        "attn_entropy": attn.reshape(-1), "mlp_var": a["mlp_var"][rep, pas, lay],
        "fingerprint": a["fingerprint"][rep, pas, lay], "maxdiff": maxdiff,
        "ts_ns": np.full(len(rep), now_ns, np.int64),
    }  # fmt: skip


def _float(value) -> float | None:
    return None if value is None else float(value)


def _typed_replay(columns: dict) -> dict:
    """The replays row with its integer columns typed (a None-only list has no type for Arrow)."""
    import pyarrow as pa

    types = {
        "pid": pa.int32(),
        "first_step_seq": pa.int64(),
        "target_step_seq": pa.int64(),
        "target_batch_row": pa.int32(),
        "step": pa.int32(),
        "window_steps": pa.int32(),
        "snapshot_len": pa.int32(),
        "layers": pa.int32(),
        "heads": pa.int32(),
        "repeats": pa.int32(),
        "live_batch_size": pa.int32(),
        "first_diverging_layer": pa.int32(),
        "recorded_loss": pa.float32(),
        "replay_loss": pa.float32(),
        "loss_diff": pa.float32(),
        "op_hash": pa.uint64(),
        "op_graph_hash": pa.uint64(),
        "linear_calls": pa.int32(),
        "live_linear_calls": pa.int64(),
        "root_layer": pa.int32(),
        "root_head": pa.int32(),
        "root_z": pa.float64(),
        "wall_ms": pa.float64(),
        "prefill_ms": pa.float64(),
        "t_start_ns": pa.int64(),
        "t_end_ns": pa.int64(),
        "ts_ns": pa.int64(),
        "snapshot_dropped": pa.bool_(),
    }
    names = list(columns)
    arrays = [pa.array(columns[c], type=types.get(c, pa.string())) for c in names]
    return pa.table(arrays, names=names)


def remove(path: str) -> None:
    """The file, once its rows are committed (the workload wrote it 0600 for the agent only)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StoreError(f"replay stored, but {path} could not be removed: {exc.strerror}") from None
