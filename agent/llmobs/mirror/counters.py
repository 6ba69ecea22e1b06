"""What the mirror did, counted: printed as one line at exit and served as JSON at STATS_PATH.

Every request the mirror reads is accounted for twice, once per side:
  primary: requests = forwarded + primary_errors + (those still in flight)
  shadow:  copies = mirrored + dropped_full + dropped_down + shadow_errors + shadow_timeouts
           + shadow_abandoned
           + (those queued or in flight)
so a drop is never silent: a shadow that is down turns each copy into a shadow_errors (refused),
dropped_down (not tried: it refused less than a second ago) or shadow_timeouts, and a full queue into
dropped_full, while the primary goes on serving.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

STATS_PATH = b"/llmobs/mirror/stats"


@dataclass
class Counters:
    requests: int = 0  # requests read from clients (the stats path and refused requests excluded)
    forwarded: int = 0  # primary responses relayed to the client whole
    primary_errors: int = 0  # the primary failed: a 502 to the client, or its response broke off
    client_gone: int = 0  # the client left before its response was relayed whole
    bad_requests: int = 0  # refused by the mirror (400, 413, 417, 431): forwarded nowhere
    copies: int = 0  # copies offered to the shadow queue
    mirrored: int = 0  # copies the shadow answered (any status; the answer is read and discarded)
    dropped_full: int = 0  # the queue was full: the copy was dropped
    dropped_down: int = 0  # the shadow refused a connection less than DOWN_RETRY_S ago: dropped untried
    shadow_errors: int = 0  # refused, reset, or a broken answer from the shadow
    shadow_timeouts: int = 0  # no whole answer within --shadow-timeout
    shadow_abandoned: int = 0  # still queued or in flight when the mirror stopped
    traceparent_kept: int = 0  # the client's traceparent went to both
    traceparent_added: int = 0  # the client sent none: the mirror's went to both
    traceparent_replaced: int = 0  # the client's was malformed (or repeated): the mirror's went to both

    def as_dict(self, **extra: int) -> dict[str, int]:
        return {**asdict(self), **extra}

    def line(self, **extra: int) -> str:
        return " ".join(f"{key}={value}" for key, value in self.as_dict(**extra).items())
