"""Per-tenant compute (issue 15): every forward pass's exact totals shared by its rows' tokens
(pass_shares, store migration 9), on stores filled from the real continuous-batching engine (tiny Llama,
CPU) and from real generate() through the real map reader; the request key of served requests; and
`query --by-tenant` against a hand-computed SQL check on the same store.

The kernel's exact per-pass totals (probe_aggregates) and CUPTI records are written here with awkward
numbers, since this tier has no eBPF: what is under test is that they are shared out exactly.
"""

from __future__ import annotations

import json
import os
from fractions import Fraction

import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import llmobs  # noqa: E402
from llmobs.cli import main  # noqa: E402
from llmobs.pipeline.apportion import SHARED_TOTALS  # noqa: E402
from llmobs.pipeline.correlate import correlate  # noqa: E402
from llmobs.pipeline.live import WINDOW_S, LiveStats  # noqa: E402
from llmobs.shm.reader import ShmReader  # noqa: E402
from llmobs.store import DuckDBStore  # noqa: E402

from tests.unit.continuous_batching import cb_configs, serve_two_tenants, tiny_llama  # noqa: E402
from tests.unit.publisher_fixtures import isolated_writer, tiny_gpt2  # noqa: E402

pytestmark = pytest.mark.unit
PROBES = ("alloc_cpu", "sgemm", "sched_switch", "cuLaunchKernel")


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


def _store_from_map(shm_dir, path, read: list | None = None) -> DuckDBStore:
    """What the real reader decodes from this process's map, appended to a real store, with exact
    per-pass probe totals and CUPTI device time for every pass (odd numbers: remainders everywhere)."""
    with ShmReader(os.getpid(), shm_dir=str(shm_dir)) as r:
        steps, events = r.read_steps(0), r.read_request_events(0)
    assert steps.lost == 0 and steps.corrupt == 0
    if read is not None:
        read.extend([steps.columns, events.columns])
    store = DuckDBStore(path)
    store.append({"token_steps": steps.columns, "request_events": events.columns})
    passes = store.query(
        "SELECT pid, step_seq, min(t_start_ns) AS t FROM (SELECT pid, step_seq, t_start_ns FROM token_steps"
        " UNION ALL SELECT pid, step_seq, t_start_ns FROM request_events WHERE kind = 'chunk')"
        " GROUP BY ALL ORDER BY step_seq"
    ).to_pylist()
    agg = {k: [] for k in ("pid", "step_seq", "probe", "count", "sum_value", "sum_duration_ns", "ts_ns")}
    gpu = {k: [] for k in ("pid", "ts_ns", "probe", "source", "external_id", "gpu_start_ns", "gpu_end_ns")}
    for p in passes:
        seq = p["step_seq"]
        for i, probe in enumerate(PROBES):
            agg["pid"].append(p["pid"])
            agg["step_seq"].append(seq)
            agg["probe"].append(probe)
            agg["count"].append(7 + (seq * 13 + i * 5) % 11)
            agg["sum_value"].append(1_000_003 * seq + 4099 * i if probe == "alloc_cpu" else 0)
            agg["sum_duration_ns"].append(123_457 * seq + 31 if probe == "sched_switch" else 0)
            agg["ts_ns"].append(None)
        gpu["pid"].append(p["pid"])
        gpu["ts_ns"].append(p["t"])
        gpu["probe"].append("cupti_kernel")
        gpu["source"].append("cupti")
        gpu["external_id"].append(seq)
        gpu["gpu_start_ns"].append(p["t"])
        gpu["gpu_end_ns"].append(p["t"] + 99_991 * seq + 17)
    assert store.export({"probe_aggregates": agg, "gpu_ops": gpu}).ok
    correlate(store.connection)
    return store


def _assert_shares_add_up(store: DuckDBStore) -> int:
    """Per pass: every shared column of its rows sums to its step_rollups total exactly, each row's
    share is within 1 of its exact quota T * w / W, and every row of the pass has one share."""
    totals = ", ".join(f"{expr} AS {col}" for col, expr in SHARED_TOTALS.items())
    rollups = {
        r["step_seq"]: r for r in store.query(f"SELECT r.step_seq, {totals} FROM step_rollups r").to_pylist()
    }
    shares = store.query("SELECT * FROM pass_shares ORDER BY step_seq").to_pylist()
    rows = store.query(
        "SELECT (SELECT count(*) FROM token_steps) + (SELECT count(*) FROM request_events"
        " WHERE kind = 'chunk') AS n"
    ).to_pylist()[0]["n"]
    assert len(shares) == rows  # every token step and every chunk is a row of some pass
    by_pass: dict[int, list[dict]] = {}
    for s in shares:
        by_pass.setdefault(s["step_seq"], []).append(s)
    assert set(by_pass) == set(rollups)
    for seq, parts in by_pass.items():
        weight = sum(p["weight"] for p in parts)
        for col in SHARED_TOTALS:
            total = rollups[seq][col]
            got = [p[col] for p in parts]
            if total is None:
                assert got == [None] * len(parts)
                continue
            assert sum(got) == total, (seq, col)
            for p in parts:
                assert abs(p[col] - Fraction(total * p["weight"], weight)) < 1, (seq, col)
    return len(by_pass)


def _serve_two_tenants(model):
    """Two tenants' requests through the real manager, the second pair added while the first decodes;
    long prompts (> the 8-token batch budget) are prefilled in chunks."""
    gen, cb = cb_configs(6, page_size=4, max_batch_tokens=8, num_blocks=64)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    early = {"a0": list(range(1, 14)), "a1": [20, 21, 22]}
    late = {"b0": list(range(60, 71)), "b1": [30, 31, 32, 33], "b2": [30, 31, 32, 33]}  # b1, b2: same prompt
    _, done = serve_two_tenants(manager, early, late, session_suffix="-s")
    return done


def test_served_passes_are_shared_exactly_and_by_tenant_matches_a_hand_computed_check(shm, tmp_path, capsys):
    model = tiny_llama()
    llmobs.instrument(model, model_id="tiny-llama")
    done = _serve_two_tenants(model)
    read: list = []
    store = _store_from_map(shm, tmp_path / "s.duckdb", read)
    try:
        passes = _assert_shares_add_up(store)
        mixed = store.query(
            "SELECT count(*) AS n FROM (SELECT step_seq FROM pass_shares GROUP BY step_seq"
            " HAVING count(DISTINCT tenant) = 2 AND count(*) FILTER (row_kind = 'chunk') > 0)"
        ).to_pylist()[0]["n"]
        assert passes > 10 and mixed >= 1  # passes of both tenants with a prefill chunk in them
        # a chunk-only pass (a0's first 8 prompt tokens) is a pass with its totals too
        assert store.query("SELECT count(*) AS n FROM step_rollups WHERE tokens = 0").to_pylist()[0]["n"] >= 1

        # requests that skip passes are one request each, with all their tokens; b1, b2 share a prompt
        requests = store.query(
            "SELECT r.request_seq, r.tokens, r.tenant, t.request_id FROM requests r JOIN"
            " (SELECT DISTINCT pid, request_seq, request_id FROM token_steps) t USING (pid, request_seq)"
        ).to_pylist()
        assert sorted(r["request_id"] for r in requests) == sorted(done)
        assert all(r["tokens"] == len(done[r["request_id"]].generated_tokens) for r in requests)

        # the hand-computed check: each tenant's compute = sum over passes of the pass's duration times
        # its rows' tokens over the pass's tokens (floats, no rounding), straight from the source tables
        hand = {
            r["tenant"]: r
            for r in store.query(
                """WITH rows AS (
                    SELECT pid, step_seq, tenant, tokens_in_pass AS w FROM token_steps
                    UNION ALL SELECT pid, step_seq, tenant, prefill_tokens FROM request_events
                        WHERE kind = 'chunk'),
                per AS (
                    SELECT r.tenant, r.w, (s.t_end_ns - s.t_start_ns) * r.w / sum(r.w) OVER pass AS compute,
                        s.allocations * r.w / sum(r.w) OVER pass AS allocs,
                        s.gpu_ns * r.w / sum(r.w) OVER pass AS gpu
                    FROM rows r JOIN step_rollups s USING (pid, step_seq)
                    WINDOW pass AS (PARTITION BY r.step_seq))
                SELECT tenant, 100 * sum(compute) / sum(sum(compute)) OVER () AS compute_pct,
                    100 * sum(allocs) / sum(sum(allocs)) OVER () AS alloc_pct,
                    100 * sum(gpu) / sum(sum(gpu)) OVER () AS gpu_pct, sum(w) AS processed,
                    sum(compute) / 1e9 AS compute_s, count(*) AS n_rows, sum(sum(compute)) OVER () AS compute,
                    sum(sum(allocs)) OVER () AS alloc, sum(sum(gpu)) OVER () AS gpu
                FROM per GROUP BY tenant"""
            ).to_pylist()
        }
    finally:
        store.close()
    assert all(hand[t]["processed"] > 0 for t in ("tenant-a", "tenant-b"))
    code = main(["query", "--by-tenant", "--db", str(tmp_path / "s.duckdb"), "--format", "json"])
    assert code == 0
    shown = {r["tenant"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(shown) == {"tenant-a", "tenant-b"}
    assert shown["tenant-a"]["requests"] == 2 and shown["tenant-b"]["requests"] == 3
    for tenant, r in shown.items():
        for col in ("compute", "alloc", "gpu"):
            # each row's integer share is within 1 unit of its exact quota; the view rounds to 0.01
            bound = 100 * hand[tenant]["n_rows"] / hand[tenant][col] + 0.005
            assert abs(r[f"{col}_pct"] - hand[tenant][f"{col}_pct"]) <= bound, (tenant, col)
        assert abs(r["compute_s"] - hand[tenant]["compute_s"]) <= 0.0006
        assert r["processed"] == hand[tenant]["processed"]
    assert abs(sum(r["compute_pct"] for r in shown.values()) - 100) <= 0.011

    # top: the live per-tenant rates (what `attach` snapshots) share the passes by the same rule
    live = LiveStats(os.getpid())
    live.add_steps(read[0])
    live.add_request_events(read[1])
    last = int(max(read[0]["t_end_ns"]))
    rates = {r["tenant"]: r for r in live.row(now_ns=last)["by_tenant"]}
    window = last - int(WINDOW_S * 1e9)
    with DuckDBStore(tmp_path / "s.duckdb", read_only=True) as store:
        stored = dict(
            store.connection.execute(
                "SELECT w.tenant, sum(w.compute_ns) / sum(sum(w.compute_ns)) OVER () FROM pass_shares w"
                " JOIN step_rollups r USING (pid, step_seq) WHERE r.t_end_ns >= $w GROUP BY ALL",
                {"w": window},
            ).fetchall()
        )
    assert set(rates) == set(stored) == {"tenant-a", "tenant-b"}
    for tenant, share in stored.items():
        assert abs(rates[tenant]["compute_share"] - share) < 1e-6
    assert main(["top", "--db", str(tmp_path / "s.duckdb"), "--once"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("per tenant") :].splitlines()
    assert lines[1].split() == ["PID", "TENANT", "TOK/S", "COMPUTE", "s/s", "COMPUTE", "%"]
    assert {line.split()[1] for line in lines[2:]} == {"tenant-a", "tenant-b"}
    assert abs(sum(float(line.split()[-1]) for line in lines[2:]) - 100) <= 0.11


def test_plain_generate_store_gives_each_request_its_whole_passes(shm, tmp_path):
    """generate() with one request per pass (tokens_in_pass 0: unknown): the request's shares are its
    passes' totals, as before apportionment; and its request key is still step_seq - step."""
    model = tiny_gpt2()
    inst = llmobs.instrument(model, model_id="tiny-gpt2")
    try:
        for tenant, prompt in (("acme", [5, 6, 7, 8]), ("globex", [9, 10, 11]), ("acme", [5, 6, 7, 8])):
            ids = torch.tensor([prompt])
            with llmobs.context(tenant=tenant):
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                               do_sample=False, pad_token_id=0)  # fmt: skip
    finally:
        inst.remove()
    store = _store_from_map(shm, tmp_path / "g.duckdb")
    try:
        _assert_shares_add_up(store)
        cols = ", ".join(f"sum({c}) AS {c}" for c in SHARED_TOTALS)
        shares = store.query(
            f"SELECT trace_id, step_seq - step AS first, {cols} FROM pass_shares GROUP BY ALL ORDER BY first"
        ).to_pylist()
        totals = ", ".join(f"sum({expr}) AS {col}" for col, expr in SHARED_TOTALS.items())
        today = store.query(  # each token step joined to its pass's rollup: what a request did before
            f"SELECT t.trace_id, t.step_seq - t.step AS first, {totals} FROM token_steps t"
            " JOIN step_rollups r USING (pid, step_seq) GROUP BY ALL ORDER BY first"
        ).to_pylist()
        assert shares == today and len(today) == 3
        requests = store.query(
            "SELECT first_step_seq, request_seq, tokens FROM requests ORDER BY first_step_seq"
        ).to_pylist()
        assert [r["first_step_seq"] for r in requests] == [r["first"] for r in today]
        assert {(r["request_seq"], r["tokens"]) for r in requests} == {(0, 4)}
    finally:
        store.close()


def test_unknown_rows_weigh_the_mean_known_row_and_remainders_go_largest_first(tmp_path):
    """One pass of three rows with tokens 5, 0 (unknown), 1: the unknown row weighs round(mean(5, 1)) =
    3; 10 allocations split 5.56 / 3.33 / 1.11 -> 6 / 3 / 1. A pass with no known row splits evenly."""
    steps = pa.table({
        "pid": pa.array([1] * 5, pa.int32()), "step_seq": [1, 1, 1, 2, 2], "trace_id": ["a" * 32] * 5,
        "step": [0, 0, 0, 1, 1], "batch_row": [0, 1, 2, 0, 1], "position": [4, 9, 3, 5, 10],
        "t_start_ns": [100, 100, 100, 200, 200], "t_end_ns": [150, 150, 150, 207, 207],
        "latency_ns": [50, 50, 50, 7, 7], "tenant": ["x", "y", "z", "x", "y"],
        "tokens_in_pass": pa.array([5, 0, 1, 0, 0], pa.int32()),
    })  # fmt: skip
    agg = {"pid": [1, 1], "step_seq": [1, 2], "probe": ["alloc_cpu", "alloc_cpu"], "count": [10, 3],
           "sum_value": [0, 0], "sum_duration_ns": [0, 0]}  # fmt: skip
    with DuckDBStore(tmp_path / "u.duckdb") as store:
        assert store.export({"token_steps": steps, "probe_aggregates": agg}).ok
        correlate(store.connection)
        got = store.query(
            "SELECT step_seq, batch_row, weight, allocations, compute_ns FROM pass_shares"
            " ORDER BY step_seq, batch_row"
        ).to_pylist()
    assert [(r["weight"], r["allocations"], r["compute_ns"]) for r in got] == [
        (5, 6, 28), (3, 3, 17), (1, 1, 5),  # 50 ns: 27.8 / 16.7 / 5.6 -> 28 / 17 / 5
        (1, 2, 4), (1, 1, 3),  # 3 allocations, 7 ns over two equal rows: ties go to the first row
    ]  # fmt: skip


def test_a_window_of_one_row_passes_takes_the_whole_pass_path_to_the_general_rules_rows(tmp_path):
    """No pass with more than one row (one request decoding alone): share_passes writes them with the
    whole-pass join, and they are the rows the general rule (apportion.shares) gives, NULL gpu_ns and
    unknown (0) tokens included; one mixed pass in the window sends the whole window through the general
    one."""
    from llmobs.pipeline import apportion

    steps = pa.table({
        "pid": pa.array([1] * 4, pa.int32()), "step_seq": [1, 2, 3, 4], "trace_id": ["a" * 32] * 4,
        "step": [0, 1, 2, 3], "batch_row": [0, 0, 0, 0], "position": [4, 5, 6, 7],
        "t_start_ns": [100, 200, 300, 400], "t_end_ns": [150, 207, 390, 401],
        "latency_ns": [50, 7, 90, 1], "tenant": ["x", "x", "y", "y"],
        "tokens_in_pass": pa.array([0, 1, 3, 0], pa.int32()),
    })  # fmt: skip
    agg = {"pid": [1, 1, 1], "step_seq": [1, 3, 4], "probe": ["alloc_cpu"] * 3, "count": [10, 3, 7],
           "sum_value": [640, 64, 0], "sum_duration_ns": [0, 0, 0]}  # fmt: skip
    with DuckDBStore(tmp_path / "w.duckdb") as store:
        assert store.export({"token_steps": steps, "probe_aggregates": agg}).ok
        correlate(store.connection)
        conn, params = store.connection, {"since": 0, "until": None, "pid": None}
        assert conn.execute(apportion._MIXED_PASSES, params).fetchall() == [(False,)]
        stored = conn.execute("SELECT * EXCLUDE (t_start_ns) FROM pass_shares ORDER BY step_seq").fetchall()
        conn.register(
            "general", apportion.shares(conn.sql(apportion._ROWS_SQL, params=params).to_arrow_table())
        )
        general = conn.execute("SELECT * EXCLUDE (t_start_ns) FROM general ORDER BY step_seq").fetchall()
        whole = conn.execute(
            f"SELECT * EXCLUDE (t_start_ns) FROM ({apportion.WHOLE_PASS_SQL}) ORDER BY step_seq", params
        ).fetchall()
        assert stored == general == whole and len(stored) == 4
        weights = conn.execute("SELECT weight, allocations, gpu_ns FROM pass_shares ORDER BY step_seq")
        assert weights.fetchall() == [(1, 10, None), (1, 0, None), (3, 3, None), (1, 7, None)]

        second = steps.slice(0, 1)  # a second row of pass 1: the window is mixed now
        second = second.set_column(second.schema.get_field_index("batch_row"), "batch_row", pa.array([1]))
        assert store.export({"token_steps": second}).ok
        assert conn.execute(apportion._MIXED_PASSES, params).fetchall() == [(True,)]
        correlate(store.connection)
        pass_one = conn.execute(
            "SELECT batch_row, weight, allocations FROM pass_shares WHERE step_seq = 1 ORDER BY batch_row"
        )
        assert pass_one.fetchall() == [(0, 1, 5), (1, 1, 5)]  # split evenly: both rows unknown


def _largest_remainder(total: int, rows: list[dict]) -> list[int]:
    """The rule in Python integers, rows in row order: floor(T * w / W), then one unit to each of the
    T - sum(floors) rows with the largest remainders, ties to the earlier row."""
    weight = sum(r["weight"] for r in rows)
    quotas = [divmod(total * r["weight"], weight) for r in rows]
    short = total - sum(q for q, _ in quotas)
    order = sorted(range(len(rows)), key=lambda i: (-quotas[i][1], i))
    extra = set(order[:short])
    return [q + (i in extra) for i, (q, _) in enumerate(quotas)]


def test_the_statement_gives_the_rules_shares_exactly_for_any_totals_and_weights(tmp_path):
    """Random passes (1-19 rows, tokens 0 = unknown to 5,000, totals up to 2^62 so T * w passes 2^63),
    one pass weighing 2^32 (two rows of 2^31 - 1 tokens: past the BIGINT path, through HUGEINT) and one
    pass whose rows all tie: the stored shares equal the rule computed in Python integers, row by row."""
    import random

    import duckdb
    from llmobs.pipeline import apportion
    from llmobs.store import schema

    rng = random.Random(26)
    passes = [
        [rng.choice([0, 1, 1, 2, 7, 512, 5_000]) for _ in range(rng.randint(1, 19))] for _ in range(300)
    ]
    passes += [[2**31 - 1, 2**31 - 1, 3], [4] * 9]
    steps, rollups, rows_of = [], [], {}
    for seq, tokens in enumerate(passes, start=1):
        batch_rows = rng.sample(range(64), len(tokens))  # out of order: the rule orders them
        rows_of[seq] = sorted(zip(batch_rows, tokens, strict=True))
        steps += [
            {"pid": 1, "step_seq": seq, "trace_id": f"{seq:032x}", "step": 0, "batch_row": row,
             "position": row, "t_start_ns": 1000 * seq, "t_end_ns": 1000 * seq + 1, "latency_ns": 1,
             "tokens_in_pass": tok}
            for row, tok in zip(batch_rows, tokens, strict=True)
        ]  # fmt: skip
        big = [rng.randrange(2**62) for _ in range(4)]
        rollups.append({
            "pid": 1, "step_seq": seq, "tokens": len(tokens), "t_start_ns": 1000 * seq,
            "t_end_ns": 1000 * seq + rng.randrange(10**9), "launches": big[0],
            "allocations": rng.randrange(40), "alloc_bytes": big[1], "frees": 0, "memcpy_bytes": 0,
            "off_cpu_ns": big[2], "page_faults": 0,
            "compute_calls": len(tokens) - 1, "gpu_ns": big[3] if seq % 2 else None, "tagged_events": 0,
            "windowed_events": 0, "counts_exact": True,
        })  # fmt: skip
    int32 = pa.int32()
    step_types = {"pid": int32, "batch_row": int32, "step": int32, "position": int32, "tokens_in_pass": int32}
    conn = duckdb.connect(str(tmp_path / "rule.duckdb"))
    schema.migrate(conn)
    conn.register("s", pa.table({k: pa.array([r[k] for r in steps], step_types.get(k)) for k in steps[0]}))
    conn.register("r", pa.Table.from_pylist(rollups))
    conn.execute("INSERT INTO token_steps BY NAME SELECT * FROM s")
    conn.execute("INSERT INTO step_rollups BY NAME SELECT * FROM r")
    apportion.share_passes(conn, {"since": 0, "until": None, "pid": None})
    shared = ", ".join(SHARED_TOTALS)
    got = conn.execute(
        f"SELECT step_seq, batch_row, weight, {shared} FROM pass_shares ORDER BY step_seq, batch_row"
    ).fetchall()
    totals = conn.execute(
        f"SELECT step_seq, {', '.join(SHARED_TOTALS.values())} FROM step_rollups r ORDER BY 1"
    )
    expected = []
    for seq, *pass_totals in totals.fetchall():
        rows = [{"batch_row": row, "tokens": tok} for row, tok in rows_of[seq]]
        known = [r["tokens"] for r in rows if r["tokens"] > 0]
        fill = max(int(Fraction(sum(known), len(known)) + Fraction(1, 2)), 1) if known else 1
        for r in rows:
            r["weight"] = r["tokens"] if r["tokens"] > 0 else fill
        shares = [[None] * len(rows) if t is None else _largest_remainder(t, rows) for t in pass_totals]
        expected += [
            (seq, r["batch_row"], r["weight"], *column) for r, *column in zip(rows, *shares, strict=True)
        ]
    conn.close()
    assert max(g[2] for g in got) == 2**31 - 1  # the pass of weight 2^32 + 3 took the HUGEINT path
    assert got == expected
