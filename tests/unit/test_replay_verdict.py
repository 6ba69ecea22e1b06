"""Replay verdicts (llmobs.diagnostics.replay) on result arrays built per the file contract (R2's
ReplayResult.to_arrays), and their ingest into a real DuckDB store in one transaction (migration 12)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llmobs.diagnostics import replay as verdicts
from llmobs.errors import StoreError
from llmobs.pipeline import replay_ingest
from llmobs.publisher.replay import ReplayResult
from llmobs.store import schema
from llmobs.store.sink import DuckDBStore

PID, FIRST_SEQ, PROMPT, TRACE = 4242, 100, 16, "ab" * 16
R, N, L, H = 2, 9, 4, 3
TARGET = 4  # the replayed pass of the target token step (the window's middle)


def build(live_batch_size: int = 1, **change) -> dict:
    """The .npz mapping of an ok replay of token steps 4..12 (target step 8): repeats identical."""
    rng = np.random.default_rng(7)
    positions = np.arange(PROMPT + 3, PROMPT + 3 + N, dtype=np.int64)  # position p scores step p + 1 - P
    step_index = (positions + 1 - PROMPT).astype(np.int32)
    loss = np.repeat(rng.uniform(1.0, 4.0, (1, N)).astype(np.float32), R, axis=0)
    attn = np.repeat((2.0 + 0.05 * rng.standard_normal((1, N, L, H))).astype(np.float32), R, axis=0)
    mlp = np.repeat((0.5 + 0.01 * rng.standard_normal((1, N, L))).astype(np.float32), R, axis=0)
    fingerprint = np.repeat(rng.integers(0, 2**63, (1, N, L), dtype=np.uint64), R, axis=0)
    fields = {
        "positions": positions,
        "step_index": step_index,
        "step_seq": FIRST_SEQ + step_index.astype(np.int64),
        "loss": loss,
        "entropy": loss / 2,
        "top5_ids": np.tile(np.arange(5), (R, N, 1)),
        "top5_probs": np.tile(np.float32([0.5, 0.2, 0.1, 0.05, 0.01]), (R, N, 1)),
        "attn_entropy": attn,
        "mlp_var": mlp,
        "fingerprint": fingerprint,
        "layer_maxdiff": np.zeros((N, L), np.float32),
        "op_hash": np.full((R, N), 11, np.uint64),
        "graph_hash": np.full((R, N), 0xABCDEF, np.uint64),
        "linear_calls": np.full((R, N), 211, np.int32),
    }
    meta = {
        "format": "llmobs-replay/1",
        "status": "ok",
        "reason": "",
        "source": "snapshot",
        "snapshot_len": 16,
        "snapshot_dropped": False,
        "model": "smol",
        "layers": L,
        "heads": H,
        "repeats": R,
        "wall_ms": 12.5,
        "prefill_ms": 1.5,
        "t_start_ns": 1,
        "t_end_ns": 2,
        "attn_implementations": ["sdpa"],
        "pid": PID,
        "trace_id": TRACE,
        "target_step_seq": FIRST_SEQ + 8,
        "target_batch_row": 0,
        "target_index": 8,
        "window": 4,
        "live_batch_size": live_batch_size,
        "recorder": {},
    }
    for key, value in change.items():
        fields[key] = value(fields[key]) if callable(value) else value
    ops = ["aten.mm.default(f32[1,576],f32[576,1536])", "aten.add.Tensor(f32[1,576],f32[1,576])"]
    return ReplayResult(meta=meta, ops=ops, **fields).to_arrays()


def recorded_of(arrays: dict, offset: float = 0.0, **kw) -> verdicts.Recorded:
    """The recorded losses = repeat 0's replayed losses (+ offset at the target)."""
    loss = arrays["loss"][0].astype(np.float64)
    steps = arrays["step_index"]
    losses = {int(s): float(v) for s, v in zip(steps, loss, strict=True)}
    losses[int(steps[TARGET])] += offset
    return verdicts.Recorded(losses, **kw)


def test_identical_repeats_within_tolerance_are_reproduced():
    arrays = build()
    v = verdicts.decide(verdicts.from_arrays(arrays), recorded_of(arrays, offset=5e-5))
    assert v.verdict == "reproduced" and v.target_pass == TARGET
    assert v.first_diverging_layer is None and v.cause is None and v.diverging_pass is None
    assert v.loss_diff == pytest.approx(5e-5, abs=1e-6) and v.replay_loss == float(arrays["loss"][0, TARGET])
    assert v.graph_hash == 0xABCDEF and v.op_hash == 11 and v.linear_calls == 211
    assert v.detail.endswith("the 2 repeats are bit-identical")


def test_repeats_that_differ_name_the_first_diverging_layer():
    def flip(fp):  # repeat 1 differs from pass 2 on, from layer 2 on (a fault propagates downstream)
        fp = fp.copy()
        fp[1, 2:, 2:] ^= np.uint64(1)
        return fp

    arrays = build(fingerprint=flip)
    v = verdicts.decide(verdicts.from_arrays(arrays), recorded_of(arrays))
    assert (v.verdict, v.cause, v.diverging_pass, v.first_diverging_layer) == (
        "drift",
        "nondeterminism",
        2,
        2,
    )
    assert f"first at position {PROMPT + 5}, layer 2" in v.detail


def test_repeats_that_differ_only_in_the_loss_diverge_after_the_last_layer():
    def nudge(loss):
        loss = loss.copy()
        loss[1, 6] = np.nextafter(loss[1, 6], np.float32(9))
        return loss

    arrays = build(loss=nudge)
    v = verdicts.decide(verdicts.from_arrays(arrays), recorded_of(arrays))
    assert (v.verdict, v.diverging_pass, v.first_diverging_layer) == ("drift", 6, None)
    assert "after the last layer" in v.detail


@pytest.mark.parametrize(("batch", "cause"), [(4, "batch_composition"), (1, "numerics")])
def test_agreeing_repeats_off_the_recorded_loss_drift_with_the_cause(batch, cause):
    arrays = build(live_batch_size=batch)
    v = verdicts.decide(verdicts.from_arrays(arrays), recorded_of(arrays, offset=2e-4))
    assert (v.verdict, v.cause, v.first_diverging_layer) == ("drift", cause, None)
    assert v.loss_diff == pytest.approx(2e-4, rel=1e-3)
    assert ("batch composition changes floating-point results" in v.detail) == (batch > 1)


def test_a_new_op_graph_or_other_linear_calls_is_graph_changed():
    arrays = build()
    result = verdicts.from_arrays(arrays)
    same = verdicts.decide(
        result, recorded_of(arrays, earlier_graph_hashes=(0xABCDEF,), live_linear_calls=211)
    )
    assert same.verdict == "reproduced"
    other = verdicts.decide(result, recorded_of(arrays, earlier_graph_hashes=(0x1234,)))
    assert (other.verdict, other.cause) == ("graph_changed", "graph") and "0000000000001234" in other.detail
    linear = verdicts.decide(result, recorded_of(arrays, live_linear_calls=210))
    assert (linear.verdict, linear.cause) == ("graph_changed", "linear_calls")
    assert "211 F.linear calls in the replayed pass, 210 live" in linear.detail


def test_root_cause_names_the_deviating_head_of_the_target_pass():
    def spike(attn):
        attn = attn.copy()
        attn[:, TARGET, 2, 1] += 1.0  # layer 2 head 1, ~20 MADs away
        attn[:, TARGET, 3, 0] += 0.5  # downstream, less
        return attn

    arrays = build(attn_entropy=spike)
    v = verdicts.decide(verdicts.from_arrays(arrays), recorded_of(arrays))
    root = v.root
    assert (root.kind, root.layer, root.head) == (verdicts.KIND_ATTENTION_ENTROPY, 2, 1)
    assert root.z > verdicts.MIN_Z and root.others == N - 1
    assert root.runners_up[0][:3] == (verdicts.KIND_ATTENTION_ENTROPY, 3, 0)
    assert verdicts.replay_root_cause(build(), TARGET) is None  # nothing deviates: no candidate


def test_a_failed_replay_and_a_malformed_file():
    failed = ReplayResult.empty("prompt_gone", "the request's tokens were evicted", repeats=2).to_arrays()
    v = verdicts.decide(verdicts.from_arrays(failed), verdicts.Recorded({}))
    assert v.verdict == "failed" and "prompt_gone: the request's tokens were evicted" in v.detail
    bad = dict(build())
    bad["loss"] = bad["loss"].astype(np.float64)
    with pytest.raises(verdicts.BadResult, match="`loss` is float64"):
        verdicts.from_arrays(bad)
    del bad["loss"]
    with pytest.raises(verdicts.BadResult, match="no `loss` array"):
        verdicts.from_arrays(bad)
    wrong = dict(build(), meta=np.array(json.dumps({"format": "other"})))
    with pytest.raises(verdicts.BadResult, match="format 'other'"):
        verdicts.from_arrays(wrong)


def _store_with_steps(path, arrays) -> DuckDBStore:
    store = DuckDBStore(path)
    steps = arrays["step_index"].astype(np.int64)
    n = len(steps)
    store.append(
        {
            "token_steps": {
                "pid": np.full(n, PID, np.int32),
                "step_seq": FIRST_SEQ + steps,
                "trace_id": [TRACE] * n,
                "step": steps.astype(np.int32),
                "position": (PROMPT + steps).astype(np.int32),
                "loss": arrays["loss"][0],
                "t_start_ns": steps * 10,
                "t_end_ns": steps * 10 + 5,
                "batch_row": np.zeros(n, np.int32),
            }
        }
    )
    return store


def test_ingest_stores_one_replay_with_every_row_in_one_transaction(tmp_path):
    arrays = build()
    path = tmp_path / "map.replay.200.npz"
    np.savez(path, **arrays)
    with _store_with_steps(tmp_path / "s.duckdb", arrays) as store:
        got = replay_ingest.ingest_file(store, str(path), ack_step_seq=200)
        assert got.replay_id == f"{PID}-{FIRST_SEQ + 8}-0-200" and got.verdict.verdict == "reproduced"
        assert got.target == replay_ingest.Target(PID, FIRST_SEQ + 8, 0, TRACE, 8, FIRST_SEQ)
        assert got.rows == {
            "replays": 1,
            "replay_steps": R * N,
            "replay_layers": R * N * L * H,
            "replay_ops": 2,
        }
        conn = store.connection
        row = conn.execute(
            "SELECT verdict, step, first_step_seq, recorded_loss, op_graph_hash, trigger FROM replays"
        ).fetchall()
        assert row == [("reproduced", 8, FIRST_SEQ, float(arrays["loss"][0, TARGET]), 0xABCDEF, "command")]
        steps = conn.execute(
            "SELECT step, position, loss = recorded_loss, top5_ids FROM replay_steps"
            " WHERE repeat = 0 ORDER BY pass"
        ).fetchall()
        assert steps[TARGET] == (8, PROMPT + 7, True, [0, 1, 2, 3, 4])
        assert (
            conn.execute("SELECT list(op ORDER BY seq) FROM replay_ops")
            .fetchall()[0][0][1]
            .startswith("aten.add.Tensor")
        )
        head = conn.execute(
            "SELECT attn_entropy, fingerprint FROM replay_layers WHERE repeat = 1 AND pass = 3"
            " AND layer = 2 AND head = 1"
        ).fetchall()
        assert head == [(float(arrays["attn_entropy"][1, 3, 2, 1]), int(arrays["fingerprint"][1, 3, 2]))]
        # A second replay of the same model with another op graph: graph_changed against the first.
        np.savez(path, **build(graph_hash=np.full((R, N), 0x99, np.uint64)))
        again = replay_ingest.ingest_file(store, str(path), ack_step_seq=201)
        assert again.verdict.verdict == "graph_changed"
        # A batch that fails in its last table leaves none of its rows (one transaction).
        batch = replay_ingest.rows_of(
            "broken", again.result, again.verdict, verdicts.Recorded({}), again.target, "command", 5
        )
        batch["replay_ops"]["op"] = [None] * len(batch["replay_ops"]["op"])  # op is NOT NULL
        with pytest.raises(StoreError):
            store.append(batch)
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM replays), (SELECT count(*) FROM replay_steps),"
            " (SELECT count(*) FROM replay_layers WHERE replay_id = 'broken')"
        ).fetchall()
        assert counts == [(2, 2 * R * N, 0)]


def test_migration_12_upgrades_a_store_at_11(tmp_path):
    import duckdb

    conn = duckdb.connect(str(tmp_path / "old.duckdb"))
    schema.migrate(conn, target=11)
    assert schema.migrate(conn, target=12) == [12] and schema.current_version(conn) == 12
    assert list(schema.table_columns(conn, "replay_ops")) == ["replay_id", "seq", "op", "ts_ns"]
    conn.close()


def test_root_cause_and_explain_use_the_stored_replay(tmp_path):
    from llmobs.commands import explain
    from llmobs.diagnostics.rootcause import root_cause

    def spike(attn):
        attn = attn.copy()
        attn[:, TARGET, 1, 2] += 1.0
        return attn

    arrays = build(attn_entropy=spike)
    path = tmp_path / "r.npz"
    np.savez(path, **arrays)
    with _store_with_steps(tmp_path / "s.duckdb", arrays) as store:
        conn = store.connection
        assert root_cause(conn, PID, FIRST_SEQ + 8, TRACE) is None  # no replay, no layer streams
        replay_ingest.ingest_file(store, str(path), ack_step_seq=300)
        found = root_cause(conn, PID, FIRST_SEQ + 8, TRACE)
        assert (found.module, found.kind, found.layer, found.head) == (
            "layer 1 head 2 (attention_entropy)",
            1,
            1,
            2,
        )
        assert found.z > verdicts.MIN_Z and f"from replay {PID}-{FIRST_SEQ + 8}-0-300" in found.evidence[1]
        request = explain.find_request(conn, TRACE[:8], None, None, None)
        report = explain.explain(conn, request, 8)
        assert (
            report["replay"]["verdict"] == "reproduced"
            and report["replay"]["op_graph_hash"] == "0000000000abcdef"
        )
        assert report["root_cause"]["module"] == "layer 1 head 2 (attention_entropy)"


def test_automatic_replays_are_rate_limited_per_target_and_counted(tmp_path):
    from llmobs.pipeline.auto_replay import AutoReplayer, ReplayOptions

    from bench.rotel_harness import wait_until

    def rows(*keys, pid=PID):  # (step_seq, batch_row, step) of flagged rows, as the anomaly lane commits
        return {"pid": [pid] * len(keys), "step_seq": [k[0] for k in keys], "batch_row": [k[1] for k in keys],
                "step": [k[2] for k in keys]}  # fmt: skip

    # no map in this shm dir: every queued replay fails at the post (NotTracked), counted
    auto = AutoReplayer(None, PID, ReplayOptions(max_per_minute=2), shm_dir=str(tmp_path))
    try:
        assert auto.on_rows(rows((10, 0, 3), (10, 0, 3), (11, 0, 4)), now=100.0) == 2  # a token once
        assert auto.on_rows(rows((12, 0, 5), (13, 1, 5), (14, 0, None)), now=159.0) == 0  # step-level: no
        assert auto.on_rows(rows((15, 0, 6), pid=PID + 1), now=159.0) == 0  # another target's row
        assert auto.counters.skipped_rate == 2
        assert auto.on_rows(rows((16, 0, 7), (17, 0, 8), (18, 0, 9)), now=160.0) == 2  # 60 s on
        assert auto.counters.skipped_rate == 3
        wait_until(lambda: auto.counters.failed == 4, 10, what="the four replays to fail at the post")
        assert (auto.counters.requested, auto.counters.stored, auto.counters.busy) == (0, 0, 0)
        assert "publishes no llmobs map" in auto.counters.last_error
        assert auto.summary().startswith(
            "replays on anomaly (at most 2/min): 0 requested, 0 stored (none), 3 skipped"
        )
    finally:
        assert auto.close(5)


def test_the_replay_is_a_span_event_on_its_token_steps_span(tmp_path):
    from llmobs.otlp.encoder import REPLAY_EVENT_NAME, SpanIds, TraceEncoder
    from llmobs.otlp.source import ExportCursor

    def drift(fp):
        fp = fp.copy()
        fp[1, TARGET:, 3:] ^= np.uint64(8)
        return fp

    arrays = build(fingerprint=drift)
    path = tmp_path / "r.npz"
    np.savez(path, **arrays)
    with _store_with_steps(tmp_path / "s.duckdb", arrays) as store:
        replay_ingest.ingest_file(store, str(path), ack_step_seq=400, trigger="anomaly")
        batch = ExportCursor(store.connection.cursor()).next_batch(
            limit=100, max_events_per_span=64, flush=True
        )
        request = TraceEncoder(SpanIds(), 0).encode(batch)
    spans = [s for rs in request.resource_spans for scope in rs.scope_spans for s in scope.spans]
    with_replay = [s for s in spans if any(e.name == REPLAY_EVENT_NAME for e in s.events)]
    assert len(with_replay) == 1
    span = with_replay[0]
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["llmobs.step_seq"].int_value == FIRST_SEQ + 8
    (event,) = [e for e in span.events if e.name == REPLAY_EVENT_NAME]
    got = {a.key: a.value for a in event.attributes}
    assert got["llmobs.replay.verdict"].string_value == "drift"
    assert got["llmobs.replay.first_diverging_layer"].int_value == 3
    assert got["llmobs.replay.cause"].string_value == "nondeterminism"
    assert got["llmobs.replay.op_graph_hash"].string_value == "0000000000abcdef"
    assert got["llmobs.replay.trigger"].string_value == "anomaly"
    assert got["llmobs.replay.id"].string_value == f"{PID}-{FIRST_SEQ + 8}-0-400"


def test_replay_settings_reach_attach_the_daemon_and_the_command_line(tmp_path, capsys):
    from llmobs import cli
    from llmobs.commands import attach
    from llmobs.daemon import config as daemon_config
    from llmobs.errors import ConfigError, UsageError
    from llmobs.pipeline.auto_replay import ReplayOptions

    parse = cli.build_parser().parse_args
    args = parse(["attach", "--pid", "1", "--db", str(tmp_path / "s.duckdb"), "--replay-on-anomaly"])
    attach._validate(args)
    assert args.replay == ReplayOptions(max_per_minute=2)
    args = parse(
        ["attach", "--pid", "1", "--db", "x", "--replay-on-anomaly", "false", "--replay-max-per-minute", "5"]
    )
    attach._validate(args)
    assert args.replay is None
    with pytest.raises(UsageError, match="needs --db"):
        attach._validate(parse(["attach", "--pid", "1", "--replay-on-anomaly"]))
    env = {"LLMOBS_REPLAY_ON_ANOMALY": "yes", "LLMOBS_REPLAY_MAX_PER_MINUTE": "7"}
    config = daemon_config.load(None, env=env)
    assert config.replay_options() == ReplayOptions(max_per_minute=7)
    assert config.sources["replay.max_per_minute"] == "env LLMOBS_REPLAY_MAX_PER_MINUTE"
    assert (
        daemon_config.load(None, env={}, flags={"replay.on_anomaly": "true"}).replay_options()
        == ReplayOptions()
    )
    assert daemon_config.load(None, env={}).replay_options() is None
    with pytest.raises(ConfigError, match=r"replay.max_per_minute = '0' \(from env"):
        daemon_config.load(None, env={"LLMOBS_REPLAY_MAX_PER_MINUTE": "0"})
    # the command's usage errors: one error and one hint line, exit 2, before any store is opened
    assert cli.main(["replay", "--trace", "xyz", "--step", "1", "--db", str(tmp_path / "none.duckdb")]) == 2
    assert cli.main(["replay", "--trace", "ab", "--step", "1", "--window", "4096"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: --trace 'xyz' is not a hex trace id (or prefix)",
        "hint: e.g. --trace 4bf92f35",
        "error: --window must be in 1..4095 (0: the default), not 4096",
        "hint: see `llmobs-agent replay --help`",
    ]
    assert cli.main(["replay", "--trace", "ab", "--step", "1", "--db", str(tmp_path / "none.duckdb")]) == 11


def test_a_file_of_another_request_is_refused_and_stores_nothing(tmp_path):
    arrays = build()
    meta = json.loads(str(arrays["meta"][()]))
    meta["trace_id"] = "cd" * 16  # the pid now belongs to another process that replayed its own request
    path = tmp_path / "r.npz"
    np.savez(path, **dict(arrays, meta=np.array(json.dumps(meta))))
    with _store_with_steps(tmp_path / "s.duckdb", arrays) as store:
        with pytest.raises(verdicts.BadResult, match=f"replays trace {'cd' * 16}, not the stored {TRACE}"):
            replay_ingest.ingest_file(store, str(path), ack_step_seq=1)
        assert store.count("replays") == 0
