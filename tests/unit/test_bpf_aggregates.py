"""Finished-step selection and the merge of harvested and live totals."""

from __future__ import annotations

import numpy as np
from llmobs.bpf.aggregates import FINISHED_STEP_MARGIN, Totals, finished
from llmobs.bpf.records import AGG_KEY_DTYPE, AGG_VAL_DTYPE


def _keys(rows):
    return np.array(rows, dtype=AGG_KEY_DTYPE)


def _vals(rows):
    return np.array(rows, dtype=AGG_VAL_DTYPE)


def test_finished_keeps_recent_steps_and_untracked_per_pid():
    keys = _keys([(1, 0, 0), (1, 0, 5), (1, 0, 10), (1, 2, 10 - FINISHED_STEP_MARGIN), (2, 0, 3), (2, 0, 4)])
    assert list(finished(keys)) == [False, True, False, False, False, False]


def test_totals_merge_sums_harvested_and_live():
    totals = Totals()
    totals.add(_keys([(1, 0, 5)]), _vals([(3, 30, 300)]))
    totals.add(_keys([(1, 0, 5)]), _vals([(1, 10, 100)]))
    merged = totals.merged(_keys([(1, 0, 5), (1, 1, 6)]), _vals([(2, 20, 200), (7, 0, 0)]))
    assert merged == {(1, 0, 5): [6, 60, 600], (1, 1, 6): [7, 0, 0]}
