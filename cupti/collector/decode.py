"""cupti-python activity records -> compact CUPTI ring records (llmobs_cupti_record), in the drain thread.

One record in, at most one out: (step_seq, start_ns, end_ns, correlation_id, name_hash, kind,
device_id, stream_id) with times already on CLOCK_MONOTONIC. The step comes from CUPTI's external
correlation: the collector pushes the token step's step_seq as a CUSTOM2 external id around each step,
and CUPTI emits an EXTERNAL_CORRELATION record (correlation id -> external id) for every API call made
while it is pushed; kernels, copies and syncs carry the correlation id of the API call that issued
them. A record whose correlation is not known yet waits (bounded) until a later buffer brings it,
and is written with step 0 ("untracked") if it never does.

The decoder reads only attributes, so a test can feed it any object shaped like cupti-python's
records (kind, start, end, name, correlation_id, ...) and exercise exactly the live path.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from llmobs.cupti import protocol as p

Record = tuple[int, int, int, int, int, int, int, int]
MAX_PENDING = 1 << 16  # records held for a correlation id still to come; more are written untracked
MAX_CORRELATIONS = 1 << 20  # correlation -> step entries kept; the oldest go first

_MEMCPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD",
                 9: "HtoH", 10: "PtoP"}  # fmt: skip
_SYNC_TYPES = {1: "event_synchronize", 2: "stream_wait_event", 3: "stream_synchronize",
               4: "context_synchronize"}  # fmt: skip
_MEMORY_OPS = {1: "alloc", 2: "free"}


class ActivityDecoder:
    """Turns batches of activity records into ring records. Not thread-safe: the drain thread owns it.

    intern(text) -> 64-bit name hash (publishes the string in the map's names table);
    to_mono(cupti_ns) -> CLOCK_MONOTONIC ns, or None to leave CUPTI time for a batch conversion
    (ring.CuptiRing does it on whole columns); api_name(kind, cbid) -> "cudaLaunchKernel" etc.
    """

    def __init__(
        self,
        intern: Callable[[str], int],
        to_mono: Callable[[int], int] | None,
        api_name: Callable[[int, int], str],
    ):
        self.intern = intern
        self.to_mono = to_mono
        self.api_name = api_name
        self.step_of: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.pending: collections.deque = collections.deque()
        self._names: dict[tuple, int] = {}  # (kind, key) -> hash: intern each distinct name once
        self.decoded = 0
        self.unattributed = 0  # written with step 0: no external correlation ever came
        self.skipped = 0  # records of kinds we do not write (or malformed ones)

    # --- names ------------------------------------------------------------------------------------
    def _name(self, key: tuple, make: Callable[[], str]) -> int:
        h = self._names.get(key)
        if h is None:
            try:
                text = make()
            except Exception:
                text = f"{key[0]}:{key[1]}"
            h = self.intern(text or f"{key[0]}:{key[1]}")
            self._names[key] = h
        return h

    def name_hash(self, act) -> int:
        kind = int(act.kind)
        if kind in p.KERNEL_KINDS:  # the common case first, and without building a closure
            h = self._names.get(("kernel", act.name))
            if h is not None:
                return h
        elif kind in p.API_KINDS:
            h = self._names.get((kind, act.cbid))
            if h is not None:
                return h
        return self._slow_name_hash(act, kind)

    def _slow_name_hash(self, act, kind: int) -> int:
        if kind in p.KERNEL_KINDS:
            name = act.name
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            h = self._name(("kernel", name), lambda: str(name))
            self._names[("kernel", act.name)] = h  # also under the raw (bytes) key the fast path sees
            return h
        if kind in p.API_KINDS:
            cbid = int(act.cbid)
            return self._name((kind, cbid), lambda: self.api_name(kind, cbid))
        if kind == p.KIND_MEMCPY:
            ck = int(act.copy_kind)
            return self._name(("memcpy", ck), lambda: f"memcpy {_MEMCPY_KINDS.get(ck, ck)}")
        if kind == p.KIND_MEMSET:
            return self._name(("memset", 0), lambda: "memset")
        if kind == p.KIND_SYNCHRONIZATION:
            t = int(act.type)
            return self._name(("sync", t), lambda: f"sync {_SYNC_TYPES.get(t, t)}")
        if kind == p.KIND_MEMORY2:
            op = int(act.memory_operation_type)
            return self._name(("memory", op), lambda: f"device {_MEMORY_OPS.get(op, op)}")
        return self._name(("kind", kind), lambda: f"activity {kind}")

    # --- records ----------------------------------------------------------------------------------
    def _learn(self, activities: Iterable) -> list:
        """First pass over a buffer: learn its external correlations; return the other records."""
        rest = []
        for act in activities:
            try:
                kind = int(act.kind)
            except Exception:
                self.skipped += 1
                continue
            if kind == p.KIND_EXTERNAL_CORRELATION:
                if int(act.external_kind) == p.EXTERNAL_KIND_CUSTOM2:
                    self.step_of[int(act.correlation_id)] = int(act.external_id)
                    if len(self.step_of) > MAX_CORRELATIONS:
                        self.step_of.popitem(last=False)
            elif kind in p.KIND_NAMES:
                rest.append(act)
            else:
                self.skipped += 1
        return rest

    def _record(self, act, step: int) -> Record:
        kind = int(act.kind)
        to_mono = self.to_mono
        if kind == p.KIND_MEMORY2:
            start = int(act.timestamp)
            start = end = to_mono(start) if to_mono else start
        else:
            # the start is mapped; the duration is kept as CUPTI measured it (mapping both ends would
            # round it by a nanosecond either way for a drift nobody can see inside one kernel)
            start, end = int(act.start), int(act.end)
            mapped = to_mono(start) if to_mono else start
            start, end = mapped, mapped + max(0, end - start)
        device = int(getattr(act, "device_id", p.NO_DEVICE)) if kind not in p.API_KINDS else p.NO_DEVICE
        stream = int(getattr(act, "stream_id", 0) or 0) if kind not in p.API_KINDS else 0
        return (step, start, end, int(act.correlation_id), self.name_hash(act), kind,
                device & 0xFFFFFFFF, stream & 0xFFFFFFFF)  # fmt: skip

    def decode(self, activities: Iterable, final: bool = False) -> list[Record]:
        """Records ready to write: those whose step is known, plus, when `final`, all still pending
        (as step 0). Held records come out first, so order within a correlation is kept."""
        batch = self._learn(activities)
        out: list[Record] = []
        waiting: collections.deque = collections.deque()
        for act in (*self.pending, *batch):
            try:
                corr = int(act.correlation_id)
                step = self.step_of.get(corr)
                if step is None:
                    if not final and len(waiting) < MAX_PENDING:
                        waiting.append(act)
                        continue
                    step = 0
                    self.unattributed += 1
                out.append(self._record(act, step))
            except Exception:  # a record we cannot read: skip it, never stop the drain
                self.skipped += 1
        self.pending = waiting
        self.decoded += len(out)
        return out
