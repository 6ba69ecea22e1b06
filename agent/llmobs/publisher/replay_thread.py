"""Which threads are running a replay: the live publisher's hooks (hf.py, the layer samplers, the serving
adapter) return at once on such a thread, so a replay of the flight recorder never publishes a token
step or a layer record (the shadow scorer's passes, publisher/shadow.py, run marked so too). A leaf
module (it imports nothing of llmobs), so every hook can check it without an import cycle:
`with replaying(): ...` around the replayed passes, `in_replay_thread()` in a hook.
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def in_replay_thread() -> bool:
    """True while the calling thread is inside `replaying()` (one attribute lookup)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def replaying():
    """Mark the calling thread as running a replay for the block (nestable)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
