"""correlate: eBPF events and CUPTI records joined to forward passes in a real DuckDB file, exact counts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from llmobs.pipeline.correlate import correlate
from llmobs.store import DuckDBStore, synthetic
from llmobs.store.synthetic import DEFAULT_PROBES, ProbeSpec

UNTAGGED = (ProbeSpec("alloc_cpu", "mem", 3, value=100), ProbeSpec("page_fault_user", "host", 2))


def _spec(name):
    return next(p for p in DEFAULT_PROBES if p.probe == name)


@pytest.fixture
def store(tmp_path):
    with DuckDBStore(tmp_path / "c.duckdb") as s:
        yield s


def _rollups(store, pid):
    return {
        r["step_seq"]: r for r in store.query("SELECT * FROM step_rollups WHERE pid = ?", [pid]).to_pylist()
    }


def test_tagged_and_windowed_events_roll_up_per_forward_pass(store):
    steps_a = synthetic.token_steps(pid=100, requests=4, tokens_per_request=5, batch_rows=2, seed=1)
    # A second process, interleaved in time with different work, must not leak into the first.
    steps_b = synthetic.token_steps(
        pid=200, requests=1, tokens_per_request=6, seed=2, start_ns=1_000_000_500_000
    )
    events_a = synthetic.events_for_steps(steps_a, untagged=UNTAGGED, seed=3)
    events_b = synthetic.events_for_steps(steps_b, (ProbeSpec("alloc_cpu", "mem", 1, value=7),), seed=4)
    # Untagged events between passes (in the 1 ms gaps) and tagged events of an unknown step.
    passes_a = synthetic.forward_passes(steps_a)
    gap_ts = passes_a["t_end_ns"].to_numpy()[:-1] + 10
    strays = pa.table(
        {
            "pid": np.full(len(gap_ts), 100, np.int32),
            "ts_ns": gap_ts,
            "probe": ["alloc_cpu"] * len(gap_ts),
            "kind": ["mem"] * len(gap_ts),
            "step_seq": np.zeros(len(gap_ts), np.int64),
            "trace_id": [""] * len(gap_ts),
            "value": np.full(len(gap_ts), 1, np.int64),
        }
    )
    orphans = pa.table(
        {
            "pid": pa.array([100, 100], pa.int32()),
            "ts_ns": [5, 6],
            "probe": ["alloc_cpu"] * 2,
            "kind": ["mem"] * 2,
            "step_seq": [999_999, 999_999],
        }
    )
    batch = {
        "token_steps": pa.concat_tables([steps_a, steps_b]),
        "events": pa.concat_tables([events_a, events_b]),
    }
    assert store.export(batch).ok
    assert store.export({"events": strays}).ok
    assert store.export({"events": orphans}).ok

    stats = correlate(store.connection)

    assert stats.passes == 10 + 6
    rollups = _rollups(store, 100)
    assert sorted(rollups) == sorted(passes_a["step_seq"].to_pylist())
    alloc, free, gemm, switch, fault = (
        _spec(n) for n in ("alloc_cpu", "free_cpu", "sgemm_", "sched_switch", "page_fault_user")
    )
    latency = dict(
        store.connection.execute(
            "SELECT step_seq, max(latency_ns) FROM token_steps WHERE pid = 100 GROUP BY ALL"
        ).fetchall()
    )
    for seq, r in rollups.items():
        assert r["tokens"] == 2  # two batch rows share each forward pass
        assert r["allocations"] == alloc.count + UNTAGGED[0].count
        assert r["alloc_bytes"] == alloc.count * alloc.value + UNTAGGED[0].count * UNTAGGED[0].value
        assert r["frees"] == free.count
        assert r["compute_calls"] == gemm.count
        assert r["off_cpu_ns"] == switch.count * switch.duration_ns
        assert r["page_faults"] == fault.count + UNTAGGED[1].count
        assert r["launches"] == 0 and r["memcpy_bytes"] == 0
        assert r["gpu_ns"] is None  # no CUPTI ran
        assert r["tagged_events"] == sum(p.count for p in DEFAULT_PROBES)
        assert r["windowed_events"] == sum(p.count for p in UNTAGGED)
        assert r["counts_exact"] is False
        assert r["decode_latency_ns"] == latency[seq]
    other = _rollups(store, 200)
    assert len(other) == 6
    assert all(
        r["allocations"] == 1 and r["alloc_bytes"] == 7 and r["windowed_events"] == 0 for r in other.values()
    )
    # Every untagged event in a window was placed once; those in gaps were not placed at all.
    assert stats.windowed_events == 10 * sum(p.count for p in UNTAGGED)
    assert stats.orphan_events == 2
    requests = store.query("SELECT pid, tokens FROM requests ORDER BY pid, trace_id").to_pylist()
    assert [r["tokens"] for r in requests] == [5, 5, 5, 5, 6] and stats.requests == 5


def test_exact_aggregates_win_over_sampled_events(store):
    steps = synthetic.token_steps(pid=300, requests=1, tokens_per_request=4, seed=5)
    # The kernel kept 1 in 10 events as samples, but counted all of them in its per-CPU aggregates.
    sampled = synthetic.events_for_steps(steps, sample_ratio=10, untagged=UNTAGGED[:1], seed=6)
    exact = synthetic.aggregates_for_steps(steps, DEFAULT_PROBES, scale=10)
    assert store.export({"token_steps": steps, "events": sampled, "probe_aggregates": exact}).ok
    correlate(store.connection)
    alloc = _spec("alloc_cpu")
    for r in _rollups(store, 300).values():
        assert r["counts_exact"] is True
        assert r["allocations"] == 10 * alloc.count + UNTAGGED[0].count
        assert r["alloc_bytes"] == 10 * alloc.count * alloc.value + UNTAGGED[0].count * UNTAGGED[0].value
        assert r["tagged_events"] == 10 * sum(p.count for p in DEFAULT_PROBES)


def test_gpu_launches_by_tag_and_cupti_time_by_external_id(store):
    steps = synthetic.token_steps(pid=400, requests=1, tokens_per_request=3, seed=7)
    launches = synthetic.events_for_steps(
        steps,
        (ProbeSpec("cuLaunchKernel", "gpu", 30), ProbeSpec("cuMemcpyHtoDAsync_v2", "mem", 2, value=1 << 20)),
    )
    passes = synthetic.forward_passes(steps)
    seqs = passes["step_seq"].to_numpy()
    starts = passes["t_start_ns"].to_numpy()
    kernels_per_step = 4
    cupti = pa.table(
        {
            "pid": np.full(len(seqs) * kernels_per_step, 400, np.int32),
            "ts_ns": np.repeat(starts, kernels_per_step),
            "probe": ["CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL"] * (len(seqs) * kernels_per_step),
            "source": ["cupti"] * (len(seqs) * kernels_per_step),
            "name": ["gemm_kernel"] * (len(seqs) * kernels_per_step),
            "external_id": np.repeat(seqs, kernels_per_step),
            "gpu_start_ns": np.repeat(starts, kernels_per_step) + 1000,
            "gpu_end_ns": np.repeat(starts, kernels_per_step)
            + 1000
            + np.tile(np.arange(1, kernels_per_step + 1), len(seqs)) * 500,
        }
    )
    assert store.export({"token_steps": steps, "events": launches, "gpu_ops": cupti}).ok
    correlate(store.connection)
    for r in _rollups(store, 400).values():
        assert r["launches"] == 30  # the CUPTI records are not counted again as launches
        assert r["memcpy_bytes"] == 2 << 20
        assert r["gpu_ns"] == 500 * sum(range(1, kernels_per_step + 1))


def test_incremental_correlation_only_touches_the_window(store):
    steps = synthetic.token_steps(pid=500, requests=1, tokens_per_request=6, seed=8)
    events = synthetic.events_for_steps(steps, (ProbeSpec("alloc_cpu", "mem", 2, value=1),))
    assert store.export({"token_steps": steps, "events": events}).ok
    correlate(store.connection)
    passes = synthetic.forward_passes(steps)
    first, last = passes.to_pylist()[0], passes.to_pylist()[-1]
    late = pa.table(
        {
            "pid": pa.array([500, 500], pa.int32()),
            "ts_ns": [first["t_start_ns"] + 1, last["t_start_ns"] + 1],
            "probe": ["alloc_cpu"] * 2,
            "kind": ["mem"] * 2,
            "step_seq": [first["step_seq"], last["step_seq"]],
            "value": [1, 1],
        }
    )
    assert store.export({"events": late}).ok
    stats = correlate(store.connection, since_ns=last["t_start_ns"], pid=500)
    assert stats.passes == 1
    rollups = _rollups(store, 500)
    assert rollups[first["step_seq"]]["allocations"] == 2  # outside the window: not recomputed
    assert rollups[last["step_seq"]]["allocations"] == 3
    correlate(store.connection)
    assert _rollups(store, 500)[first["step_seq"]]["allocations"] == 3
    assert store.count("step_rollups") == 6


def test_a_repeated_prompt_is_two_requests_though_its_trace_id_repeats(store):
    # The workload derives the trace id from the prompt: the same prompt twice gives the same trace id.
    steps = synthetic.token_steps(pid=600, requests=2, tokens_per_request=4, seed=9)
    same = steps["trace_id"][0].as_py()
    steps = steps.set_column(steps.schema.get_field_index("trace_id"), "trace_id", pa.array([same] * 8))
    assert store.export({"token_steps": steps}).ok
    stats = correlate(store.connection)
    assert stats.requests == 2
    rows = store.query(
        "SELECT trace_id, first_step_seq, tokens FROM requests ORDER BY first_step_seq"
    ).to_pylist()
    assert [(r["trace_id"], r["first_step_seq"], r["tokens"]) for r in rows] == [(same, 1, 4), (same, 5, 4)]


def _served_store(path) -> DuckDBStore:
    """Two processes' passes (batches of 4 rows of known tokens, and single rows), tagged and untagged
    events, exact totals for one pid, and prefill chunks: in passes with tokens and in passes of their own."""
    a = synthetic.token_steps(pid=100, requests=24, tokens_per_request=30, batch_rows=4, seed=11)
    rng = np.random.default_rng(12)
    a = a.append_column("tokens_in_pass", pa.array(rng.integers(1, 6, a.num_rows), pa.int32()))
    b = synthetic.token_steps(pid=200, requests=3, tokens_per_request=40, seed=13, start_ns=1_000_000_400_000)
    passes = synthetic.forward_passes(a).to_pylist()
    chunk_rows = []
    for i, p in enumerate(passes):  # a chunk-only pass in the gap after each pass, a chunk in every 9th
        base = {"pid": 100, "kind": "chunk", "request_seq": 500 + i, "trace_id": p["trace_id"], "tenant": "t"}
        if i % 9 == 0:
            chunk_rows.append({**base, "step_seq": p["step_seq"], "t_start_ns": p["t_start_ns"],
                               "t_end_ns": p["t_end_ns"], "prefill_tokens": 7 + i})  # fmt: skip
        chunk_rows.append({**base, "step_seq": 10_000 + i, "t_start_ns": p["t_end_ns"] + 100,
                           "t_end_ns": p["t_end_ns"] + 900, "prefill_tokens": 3})  # fmt: skip
    only = [r for r in chunk_rows if r["step_seq"] >= 10_000]  # an untagged event in each chunk-only pass
    n = len(only)
    in_chunks = {
        "pid": pa.array([100] * n, pa.int32()), "tid": pa.array([100] * n, pa.int32()),
        "cpu": pa.array([0] * n, pa.int16()), "ts_ns": [r["t_end_ns"] - 50 for r in only],
        "probe": ["alloc_cpu"] * n, "kind": ["mem"] * n, "step_seq": [0] * n, "trace_id": [""] * n,
        "value": [5] * n, "duration_ns": [0] * n, "sample_ratio": pa.array([1] * n, pa.int32()),
    }  # fmt: skip
    store = DuckDBStore(path)
    batch = {
        "token_steps": pa.concat_tables([a, b], promote_options="default"),
        "events": pa.concat_tables(
            [
                synthetic.events_for_steps(a, untagged=UNTAGGED, seed=14),
                synthetic.events_for_steps(b, untagged=UNTAGGED, seed=15),
                pa.table(in_chunks),
            ],
            promote_options="default",
        ),
        "probe_aggregates": synthetic.aggregates_for_steps(b, (_spec("alloc_cpu"),), scale=3),
        "request_events": pa.Table.from_pylist(chunk_rows),
    }
    result = store.export(batch)
    assert result.ok, result.error
    return store


def _correlated(store) -> dict[str, list]:
    return {
        "step_rollups": store.query("SELECT * FROM step_rollups ORDER BY pid, step_seq").to_pylist(),
        "pass_shares": store.query("SELECT * FROM pass_shares ORDER BY ALL").to_pylist(),
        "requests": store.query("SELECT * FROM requests ORDER BY ALL").to_pylist(),
    }


def test_a_window_correlated_in_slices_gives_the_same_rows_as_in_one(tmp_path, monkeypatch):
    """A window of more than SLICE_STEPS token steps is correlated in slices cut at pass starts, each its
    own transaction (a transaction's rows stay in memory until it commits: ~400,000 pass_shares rows of a
    20k steps/s server ran out of the agent's DuckDB cap). Slices of ~40 steps (10 to 21 of them) must give
    every rollup, share and request row of the one-transaction run, whole and incremental; passes cut in
    two, or events of a slice's passes read short, change rows."""
    whole, sliced = _served_store(tmp_path / "whole.duckdb"), _served_store(tmp_path / "sliced.duckdb")
    try:
        middle = whole.query("SELECT quantile_disc(t_start_ns, 0.5) AS t FROM token_steps").to_pylist()[0][
            "t"
        ]
        one = [correlate(whole.connection), correlate(whole.connection, since_ns=middle, pid=100)]
        expected = _correlated(whole)
        monkeypatch.setattr("llmobs.pipeline.correlate.SLICE_STEPS", 40)
        cut = [correlate(sliced.connection), correlate(sliced.connection, since_ns=middle, pid=100)]
        assert [s.slices for s in one] == [1, 1] and min(s.slices for s in cut) >= 10
        assert _correlated(sliced) == expected
        assert len(expected["pass_shares"]) == whole.count("token_steps") + 180 + 20  # every row, chunks too
        for a, b in zip(one, cut, strict=True):  # the same passes, events and orphans reported
            assert (a.passes, a.tagged_events, a.windowed_events, a.orphan_events) == (
                b.passes, b.tagged_events, b.windowed_events, b.orphan_events)  # fmt: skip
        assert one[0].tagged_events > 0 and one[0].windowed_events > 0
    finally:
        whole.close()
        sliced.close()
