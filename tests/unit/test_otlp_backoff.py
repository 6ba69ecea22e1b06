"""Jittered exponential backoff: growth, cap, jitter bounds, the collector's delay, shutdown interrupts."""

from __future__ import annotations

import random
import threading

import pytest
from llmobs.otlp.backoff import Backoff


def test_delays_double_within_the_jitter_and_stop_at_the_cap():
    backoff = Backoff(initial_s=1.0, max_s=8.0, jitter=0.2, rng=random.Random(1))
    delays = [backoff.next_delay() for _ in range(7)]
    for attempt, delay in enumerate(delays):
        base = min(2**attempt, 8.0)
        assert 0.8 * base <= delay <= 1.2 * base
    assert max(delays) <= 8.0 * 1.2
    assert len(set(delays)) == len(delays)  # jittered: no two retries at the same instant


def test_jitter_spreads_agents_restarted_together():
    firsts = {round(Backoff(1.0, 30.0, rng=random.Random(seed)).next_delay(), 6) for seed in range(50)}
    assert len(firsts) == 50 and min(firsts) >= 0.8 and max(firsts) <= 1.2


def test_reset_after_success_starts_again_from_the_initial_delay():
    backoff = Backoff(0.5, 30.0, jitter=0.0)
    assert [backoff.next_delay() for _ in range(3)] == [0.5, 1.0, 2.0]
    backoff.reset()
    assert backoff.next_delay() == 0.5


def test_collector_requested_delay_wins_but_is_capped():
    backoff = Backoff(1.0, 10.0, jitter=0.0)
    assert backoff.next_delay(retry_after_s=3.5) == 3.5
    assert backoff.next_delay(retry_after_s=3600) == 10.0
    assert backoff.attempt == 2


def test_shutdown_interrupts_a_long_wait():
    stop = threading.Event()
    backoff = Backoff(initial_s=300.0, max_s=300.0, stop=stop)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(backoff.wait()))
    waiter.start()
    stop.set()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and result == [False]  # returned at once, told the caller to stop


def test_wait_returns_true_when_not_stopped():
    assert Backoff(initial_s=0.001, max_s=0.001).wait() is True


@pytest.mark.parametrize("args", [(0, 1), (2, 1), (1, 2, 1.0)])
def test_bad_parameters(args):
    with pytest.raises(ValueError):
        Backoff(*args)
