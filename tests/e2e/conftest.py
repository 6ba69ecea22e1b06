"""Fixtures the e2e modules share."""

from __future__ import annotations

import pytest

# The tiny serving workload, labelled as the mirror's primary (`--variant base --label template=v3`):
# test_mirror and test_serving_http both drive it, and a server start is most of either module's time.
TINY_SERVER = ("--model", "tiny", "--threads", "1", "--variant", "base", "--label", "template=v3")


@pytest.fixture(scope="session")
def tiny_server():
    """One `python -m llmobs.workloads.serve --model tiny` for the session (bench.held_server)."""
    from bench.held_server import HeldServer

    with HeldServer(*TINY_SERVER) as server:
        yield server
