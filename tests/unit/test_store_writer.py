"""StoreWriter: coalesced commits, never-blocking submits with counted drops, flush and close."""

from __future__ import annotations

import time

import numpy as np
import pytest
from llmobs.bpf.profiles import PROBES
from llmobs.bpf.records import EVENT_DTYPE
from llmobs.store import DuckDBStore, synthetic
from llmobs.store.ingest import EventDecoder
from llmobs.store.writer import MAX_HOLD_S, SMALL_COMMIT_ROWS, StoreWriter, default_max_hold_s


def _records(n, seed=0):
    rng = np.random.default_rng(seed)
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["pid"] = 5
    ev["probe"] = 1  # alloc_cpu: kind mem
    ev["kind"] = 0
    ev["ts_ns"] = np.sort(rng.integers(1, 10**12, size=n))
    ev["step_seq"] = rng.integers(1, 100, size=n)
    return ev


@pytest.fixture
def store(tmp_path):
    with DuckDBStore(tmp_path / "w.duckdb") as s:
        yield s


def _wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)  # polling a condition with a deadline, not a fixed sleep


def test_items_are_coalesced_into_commits_of_max_rows(store):
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_rows=10_000, max_delay_s=60)
    for i in range(10):
        assert writer.submit(_records(3000, seed=i))
    steps = synthetic.token_steps(pid=5, requests=2, tokens_per_request=10)
    assert writer.submit({"token_steps": steps})
    assert writer.flush(timeout=30)
    # 4 x 3000 >= 10000 -> commit; again after 8; the flush commits the last 2 items and the steps.
    assert writer.counters.commits == 3
    assert writer.counters.committed_rows == 30_000 + 20 == writer.counters.submitted_rows
    assert store.count("mem_events") == 30_000 and store.count("token_steps") == 20
    assert writer.close(timeout=10)


def test_a_full_queue_drops_and_counts_instead_of_blocking(store):
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_rows=1, queue_items=4)
    with store._lock:  # the disk is "stuck": the writer's first commit waits here
        assert writer.submit(_records(100))
        _wait_until(lambda: writer._queue.qsize() == 0)  # the writer holds item 1, blocked on the store
        started = time.monotonic()
        accepted = [writer.submit(_records(100, seed=i)) for i in range(10)]
        assert time.monotonic() - started < 1.0  # submit never waits on the store
        assert accepted == [True] * 4 + [False] * 6
        assert writer.counters.dropped_rows == 600
    assert writer.flush(timeout=30)
    assert writer.counters.committed_rows == 500 and store.count("mem_events") == 500
    assert writer.close()


def test_bad_items_are_counted_and_the_writer_keeps_going(store):
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_rows=1)
    assert writer.submit(np.zeros(3, dtype=[("x", "<u8")]))  # not ring records
    assert writer.submit({"no_such_table": {"a": [1]}})
    assert writer.submit(_records(50))
    assert writer.flush(timeout=30)
    assert writer.counters.failed_rows == 4 and writer.counters.committed_rows == 50
    assert store.count("mem_events") == 50
    assert writer.close()


def test_close_commits_what_is_pending(store):
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_rows=10**9, max_delay_s=60)
    assert writer.submit(_records(123))
    assert writer.close(timeout=30)
    assert store.count("mem_events") == 123


def _map_steps(first: int, n: int) -> dict:
    """token_steps as the map reader hands them: numpy columns, strings as lists."""
    seq = np.arange(first, first + n, dtype=np.int64)
    return {"pid": np.full(n, 5, np.int32), "step_seq": seq, "t_start_ns": seq * 1000,
            "t_end_ns": seq * 1000 + 500, "trace_id": ["ab" * 16] * n,
            "model_id": [f"m{i % 2}" for i in range(n)]}  # fmt: skip


def test_small_items_are_converted_once_per_table_and_committed_together(store):
    # a slowly stepping target hands ~25 tiny items a second: held raw, merged per table at the commit
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_rows=10**9, max_delay_s=60)
    for i in range(20):
        assert writer.submit({"token_steps": _map_steps(10 * i, 2)})
        assert writer.submit(_records(3, seed=i))
    assert writer.flush(timeout=30)
    assert writer.counters.commits == 1 and writer.counters.committed_rows == 100
    assert store.count("token_steps") == 40 and store.count("mem_events") == 60
    models = store.query("SELECT model_id, count(*) AS n FROM token_steps GROUP BY 1 ORDER BY 1")
    assert models.column("model_id").to_pylist() == ["m0", "m1"] and models.column("n").to_pylist() == [
        20,
        20,
    ]
    assert writer.close()


def test_a_bad_item_among_merged_ones_fails_alone(store):
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_rows=10**9, max_delay_s=60)
    assert writer.submit({"token_steps": _map_steps(0, 3)})
    bad = _map_steps(100, 4)
    bad["step_seq"] = bad["step_seq"][:1]  # columns of different lengths: no table can be made of it
    assert writer.submit({"token_steps": bad})
    assert writer.submit({"token_steps": _map_steps(200, 5)})
    assert writer.flush(timeout=30)
    assert writer.counters.failed_rows == 4 and writer.counters.committed_rows == 8
    assert store.count("token_steps") == 8
    assert writer.close()


def test_a_small_commit_waits_for_the_hold_and_a_large_one_for_the_delay(store):
    """A commit's fixed cost makes a slow target's commit a second dear: fewer than SMALL_COMMIT_ROWS
    rows wait max_hold_s (never less: the contract is a lower bound); as soon as the pending rows reach
    it, the usual max_delay_s applies."""
    from llmobs.store.writer import SMALL_COMMIT_ROWS

    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_delay_s=0.01, max_hold_s=0.5)
    submitted = time.monotonic()
    assert writer.submit(_records(10))
    _wait_until(lambda: writer.counters.commits == 1)
    assert time.monotonic() - submitted >= 0.5
    writer.max_hold_s = 3600
    assert writer.submit(_records(10, seed=1))
    _wait_until(lambda: writer._queue.qsize() == 0)
    assert writer.submit(_records(SMALL_COMMIT_ROWS, seed=2))  # now large enough: due after max_delay_s
    _wait_until(lambda: writer.counters.commits == 2)
    assert store.count("mem_events") == SMALL_COMMIT_ROWS + 20
    assert writer.close(timeout=10)


def test_the_hold_is_never_shorter_than_the_delay(store):
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_delay_s=10, max_hold_s=1)
    assert writer.max_hold_s == 10
    assert writer.close(timeout=10)


def test_the_default_hold_can_only_be_shortened_by_the_environment(store, monkeypatch):
    shortened = [("1", 1.0), ("0", 0.0), ("2.5", 2.5)]
    ignored = [("9", MAX_HOLD_S), ("-1", MAX_HOLD_S), ("soon", MAX_HOLD_S), ("nan", MAX_HOLD_S)]
    cases = shortened + ignored
    for value, expected in cases:
        monkeypatch.setenv("LLMOBS_STORE_MAX_HOLD_S", value)
        assert default_max_hold_s() == expected, value
    monkeypatch.setenv("LLMOBS_STORE_MAX_HOLD_S", "2.5")
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_delay_s=1)
    assert writer.max_hold_s == 2.5
    assert writer.close(timeout=10)
    monkeypatch.delenv("LLMOBS_STORE_MAX_HOLD_S")
    assert default_max_hold_s() == MAX_HOLD_S


def _asleep(writer) -> bool:
    """The writer took everything queued and sleeps again (until its deadline or a wake-up)."""
    return writer._queue.qsize() == 0 and writer._queue._waiting


def test_a_slow_source_does_not_wake_the_writer_for_every_item(store):
    # each wake-up of a sleeping thread costs ~40 us of CPU a side here: a slowly stepping target's
    # ~25 small items a second wait for the commit's deadline instead of waking the writer one by one
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_delay_s=60, max_hold_s=60)
    assert writer.submit({"token_steps": _map_steps(0, 2)})  # asleep with nothing pending: woken once
    _wait_until(lambda: _asleep(writer))
    for i in range(1, 20):
        assert writer.submit({"token_steps": _map_steps(10 * i, 2)})
    assert writer._queue.wakeups == 1  # the 19 wait for the deadline
    assert writer.flush(timeout=30)
    assert writer._queue.wakeups == 2 and writer.counters.commits == 1
    assert store.count("token_steps") == 40
    assert writer.close()


def test_enough_rows_or_items_wake_the_writer_before_its_deadline(store):
    writer = StoreWriter(store, EventDecoder([p.name for p in PROBES]), max_delay_s=60, max_hold_s=60,
                         queue_items=8)  # fmt: skip
    assert writer.submit({"token_steps": _map_steps(0, 1)})
    _wait_until(lambda: _asleep(writer))
    assert writer.submit(_records(SMALL_COMMIT_ROWS))  # a small commit's hold ends: taken now
    _wait_until(lambda: _asleep(writer))
    assert writer._queue.wakeups == 2
    for i in range(3):  # under half the queue: they wait
        assert writer.submit(_records(2, seed=i))
    assert writer._queue.wakeups == 2
    assert writer.submit(_records(2, seed=9))  # half of queue_items: taken before the queue can fill
    _wait_until(lambda: _asleep(writer))
    assert writer._queue.wakeups == 3 and writer.counters.dropped_rows == 0
    assert writer.close(timeout=30)
    assert store.count("mem_events") == SMALL_COMMIT_ROWS + 8 and store.count("token_steps") == 1
