"""Jittered exponential backoff whose waits a shutdown can cut short.

The delay doubles from `initial_s` up to `max_s`, each wait multiplied by a random factor in
[1 - jitter, 1 + jitter] so that many agents restarted together do not retry in lockstep (the
opentelemetry-python exporters use the same 0.8-1.2 spread). `wait()` sleeps on a threading.Event:
setting the event (shutdown) ends the wait at once.
"""

from __future__ import annotations

import random
import threading


class Backoff:
    def __init__(
        self,
        initial_s: float = 1.0,
        max_s: float = 30.0,
        jitter: float = 0.2,
        stop: threading.Event | None = None,
        rng: random.Random | None = None,
    ):
        if initial_s <= 0 or max_s < initial_s or not 0 <= jitter < 1:
            raise ValueError("need 0 < initial_s <= max_s and 0 <= jitter < 1")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self.stop = stop or threading.Event()
        self._rng = rng or random.Random()
        self.attempt = 0  # failures since the last success

    def next_delay(self, retry_after_s: float | None = None) -> float:
        """The wait before the next try; a collector's Retry-After / RetryInfo wins (capped at max_s)."""
        if retry_after_s is not None and retry_after_s >= 0:
            delay = min(retry_after_s, self.max_s)
        else:
            base = min(self.initial_s * (2**self.attempt), self.max_s)
            delay = base * self._rng.uniform(1 - self.jitter, 1 + self.jitter)
        self.attempt += 1
        return delay

    def wait(self, retry_after_s: float | None = None) -> bool:
        """Sleep the next delay; False when shutdown was asked (then the caller stops retrying)."""
        return not self.stop.wait(self.next_delay(retry_after_s))

    def reset(self) -> None:
        self.attempt = 0
