"""The replay's share of the wall time (Recorder.replay_share): the wait after each piece of replay work
keeps the work at `share` of the time, and replay_window hands the pacer every prefill and every pass."""

from __future__ import annotations

import pytest
import torch
from continuous_batching import tiny_llama
from llmobs.publisher import recorder as flight
from llmobs.publisher.replay import replay_window


@pytest.mark.parametrize(
    ("work", "share", "wait"),
    [(0.2, 0.5, 0.2), (0.1, 0.25, 0.3), (0.3, 1.0, 0.0), (0.0, 0.5, 0.0), (4.0, 0.2, flight.MAX_PACE_S)],
)
def test_the_wait_keeps_the_work_at_its_share_of_the_wall_time(work, share, wait):
    assert flight.pace_wait(work, share) == pytest.approx(wait)
    if 0 < wait < flight.MAX_PACE_S:
        assert work / (work + wait) == pytest.approx(share)


@pytest.mark.parametrize("share", [0.0, 0.01, 1.5])
def test_a_share_outside_its_range_is_refused(share):
    with pytest.raises(ValueError, match="replay_share"):
        flight.Recorder(replay_share=share)


def test_replay_window_paces_after_each_prefill_and_each_pass():
    model = tiny_llama()
    paced: list[float] = []
    result = replay_window(model, torch.arange(1, 13), 6, 9, repeats=2, pace=paced.append)
    assert result.status == "ok"
    assert len(paced) == 2 * (1 + 4) and all(s > 0 for s in paced)  # per repeat: its prefill, 4 passes
    # the prefills' own times, as the meta reports them (one per repeat: before each repeat's passes)
    assert sum(paced[0::5]) * 1e3 == pytest.approx(result.meta["prefill_ms"], rel=0.05)
