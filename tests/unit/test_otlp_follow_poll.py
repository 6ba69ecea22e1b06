"""The follow loop's wait between rounds: poll_interval_s after a round that sent, doubling after each
round that sent nothing up to IDLE_POLL_MAX_S (an idle round still costs a few statements), and a
round that sends brings it back at once. On a real exporter of a real (empty) DuckDB file."""

from __future__ import annotations

import pytest
from llmobs.otlp.config import resolve
from llmobs.otlp.delivery import IDLE_POLL_MAX_S, OtlpExporter
from llmobs.store.sink import DuckDBStore
from test_otlp_rollup_wait import KeepingTransport


@pytest.fixture
def store(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    yield store
    store.close()


def _waits(exporter: OtlpExporter, sent: list[int]) -> list[float]:
    wait, waits = exporter.config.poll_interval_s, []
    for count in sent:
        wait = exporter._next_poll(wait, count)
        waits.append(wait)
    return waits


def test_idle_rounds_back_off_to_the_cap_and_a_sending_round_resets(store):
    exporter = OtlpExporter(store.connection.cursor(), resolve({"poll_interval_s": 0.25}, env={}),
                            KeepingTransport())  # fmt: skip
    waits = _waits(exporter, [0, 0, 0, 0, 0, 3, 0])
    assert waits == [0.5, 1.0, IDLE_POLL_MAX_S, IDLE_POLL_MAX_S, IDLE_POLL_MAX_S, 0.25, 0.5]


def test_a_poll_interval_above_the_cap_is_kept(store):
    exporter = OtlpExporter(store.connection.cursor(), resolve({"poll_interval_s": 5.0}, env={}),
                            KeepingTransport())  # fmt: skip
    assert _waits(exporter, [0, 0, 1]) == [5.0, 5.0, 5.0]
