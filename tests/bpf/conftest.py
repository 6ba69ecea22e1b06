"""Fixtures shared by the bpf tier's modules."""

from __future__ import annotations

import pytest
from test_probes_target import TargetPool


@pytest.fixture(scope="module")
def targets():
    """The module's plain targets (test_probes_target.TargetPool), each started while the test before it
    runs: a target imports torch (~2.7 s)."""
    pool = TargetPool()
    yield pool
    pool.close()
