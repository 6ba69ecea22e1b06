"""The runtime's drain period (attach, demo and the daemon): 20 ms while events flow; while the ring is
sparse, as long as the ring can hold a burst at the fastest event rate the agent is sized for on top of
what a wake may leave in it ((1 - DEFER_SHARE) x ring_records / MAX_EVENTS_PER_S: a burst that starts
just after a wake cannot overflow the ring before the next), never more than DRAIN_PERIOD_S[1]. A
sparse ring is drained only when it holds DEFER_SHARE of its space or DEFER_MAX_S after its last
drain (bpf/ringbuf.py DrainPacer), and at every wake until its first event (attach's first-event
latency). The wait for the drain must stay well inside
the loss-anomaly rows' 200 ms spike-to-row target (docs/diagnostics.md); the map's steps are read at
most every MAP_PERIOD_S, so a sparse drain longer than that does not add a second wait. The idle CPU is
measured by bench/drain_idle.py and bench/step_cost.py (slow)."""

from __future__ import annotations

import pytest
from llmobs.bpf.program import DEFAULT_RING_BYTES
from llmobs.bpf.records import RING_RECORD_DTYPE
from llmobs.bpf.ringbuf import DEFER_MAX_S, DEFER_SHARE, DrainPacer
from llmobs.pipeline.core import MAP_PERIOD_S
from llmobs.runtime import agent

SPIKE_TO_ROW_TARGET_S = 0.2
DEFAULT_RING_RECORDS = DEFAULT_RING_BYTES // RING_RECORD_DTYPE.itemsize


@pytest.mark.parametrize("ring_records", [1_000, 10_000, 100_000, DEFAULT_RING_RECORDS, 10_000_000])
def test_a_burst_at_the_maximum_rate_cannot_overflow_the_ring_before_the_next_drain(ring_records):
    period = agent.sparse_period(ring_records)
    busy, longest = agent.DRAIN_PERIOD_S
    assert busy <= period <= longest
    # at the bound, what the fastest probes write in one period fits beside what a wake may leave in the
    # ring (or the period is the busy one: a ring that small is drained as often as when events flow)
    left = DEFER_SHARE * ring_records
    assert left + period * agent.MAX_EVENTS_PER_S <= ring_records * (1 + 1e-12) or period == busy


def test_the_default_ring_is_drained_as_rarely_as_it_allows_when_sparse():
    period = agent.sparse_period(DEFAULT_RING_RECORDS)
    free = (1 - DEFER_SHARE) * DEFAULT_RING_RECORDS
    assert period == pytest.approx(free / agent.MAX_EVENTS_PER_S)  # ~94 ms
    assert period > 0.05  # longer than the former fixed 50 ms: fewer wake-ups of a quiet agent


def test_the_wait_for_the_drain_stays_inside_the_spike_to_row_target():
    busy, longest = agent.DRAIN_PERIOD_S
    assert 0 < busy <= longest
    # a step waits at most one sparse period for the drain that reads the map (the map's own period is
    # shorter, so it falls on every drain), leaving half the target to score and commit it
    assert MAP_PERIOD_S <= longest <= SPIKE_TO_ROW_TARGET_S / 2


def test_an_agent_with_no_ring_waits_the_longest_period():
    assert agent.sparse_period(0) == agent.DRAIN_PERIOD_S[1]


class Ring:
    """A ring's fill as the pacer reads it (RingConsumer.pending_bytes, data_bytes)."""

    def __init__(self, data_bytes: int):
        self.data_bytes = data_bytes
        self.pending = 0

    def pending_bytes(self) -> int:
        return self.pending


def test_a_sparse_ring_is_drained_once_per_defer_period_and_a_filling_one_at_once():
    ring, pacer = Ring(32_000), DrainPacer()
    assert pacer.due(ring, now=100.0)  # the first wake drains
    ring.pending = int(DEFER_SHARE * ring.data_bytes) - 1  # just under the share: left for later
    assert not pacer.due(ring, now=100.1)
    assert not pacer.due(ring, now=100.0 + DEFER_MAX_S * 0.99)
    assert pacer.due(ring, now=100.0 + DEFER_MAX_S)  # the defer period is over
    ring.pending += 1  # the share: drained at the very next wake
    assert pacer.due(ring, now=100.0 + DEFER_MAX_S + 0.01)
    ring.pending = 0
    assert not pacer.due(ring, now=100.0 + DEFER_MAX_S + 0.02)
    assert pacer.due(ring, now=100.0 + DEFER_MAX_S + 0.02, eager=True)  # no first event yet: every wake
