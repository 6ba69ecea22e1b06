"""A stand-in for NVIDIA's `cupti` module (cupti-python) where no GPU exists: the same functions the
collector calls, and activity records shaped like cupti-python's (same attribute names).

It models what the collector relies on: buffer callbacks registered once, records produced only for
enabled kinds, an EXTERNAL_CORRELATION record for every API call made while an external id is pushed
(per kind, a stack), completed buffers handed to the callback when full or on flush, and a timestamp
clock that is CLOCK_MONOTONIC plus an offset (so the collector's clock fit has something to find).
"""

from __future__ import annotations

import enum
import threading
import time
from types import SimpleNamespace

from llmobs.cupti import protocol as p

CLOCK_OFFSET_NS = 1_700_000_000_000_000_000 - time.monotonic_ns()  # a wall-clock-like CUPTI time base


class CallbackDomain(enum.IntEnum):
    DRIVER_API = 1
    RUNTIME_API = 2


class Result(enum.IntEnum):
    ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39


class cuptiError(Exception):
    def __init__(self, status):
        super().__init__(f"CUPTI_ERROR {status!r}")
        self.status = status


RUNTIME_NAMES = {211: "cudaLaunchKernel", 51: "cudaMemcpyAsync"}
DRIVER_NAMES = {307: "cuLaunchKernel"}


class FakeCupti:
    CallbackDomain = CallbackDomain
    Result = Result
    cuptiError = cuptiError

    def __init__(self, buffer_records: int = 16, subscribed_by: str | None = None):
        self.buffer_records = buffer_records
        self.subscribed_by = subscribed_by
        self.enabled: set[int] = set()
        self.callbacks = None
        self.stacks: dict[tuple[int, int], list[int]] = {}  # (thread, kind) -> ids: per thread, as in CUPTI
        self.buffer: list = []
        self.correlation = 0
        self.subscribers = 0
        self.lock = threading.Lock()
        self.pushes = 0
        self.completed_threads: set[str] = set()

    # --- the API the collector uses ---------------------------------------------------------------
    def subscribe(self, callback, userdata):
        if self.subscribed_by:
            raise cuptiError(Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
        self.subscribers += 1
        return 1

    def unsubscribe(self, handle):
        self.subscribers -= 1

    def activity_register_callbacks(self, requested, completed):
        self.callbacks = (requested, completed)

    def activity_enable(self, kind):
        self.enabled.add(int(kind))

    def activity_disable(self, kind):
        self.enabled.discard(int(kind))

    def activity_push_external_correlation_id(self, kind, ident):
        self.stacks.setdefault((threading.get_ident(), int(kind)), []).append(int(ident))
        self.pushes += 1

    def activity_pop_external_correlation_id(self, kind):
        stack = self.stacks.get((threading.get_ident(), int(kind)))
        if not stack:
            raise cuptiError("CUPTI_ERROR_QUEUE_EMPTY")
        return stack.pop()

    def stack_of_this_thread(self, kind=p.EXTERNAL_KIND_CUSTOM2) -> list[int]:
        return self.stacks.get((threading.get_ident(), kind), [])

    def activity_flush_all(self, flag):
        self._complete()

    def activity_get_num_dropped_records(self, context, stream, ptr):
        return None  # leaves *ptr at 0

    def get_timestamp(self):
        return time.monotonic_ns() + CLOCK_OFFSET_NS

    def get_callback_name(self, domain, cbid):
        names = DRIVER_NAMES if domain == CallbackDomain.DRIVER_API else RUNTIME_NAMES
        return names[cbid]

    # --- what the "GPU program" does --------------------------------------------------------------
    def launch(self, kernel: str, duration_ns: int = 2000) -> None:
        """A cudaLaunchKernel (runtime) -> cuLaunchKernel (driver) -> kernel on the device."""
        with self.lock:
            self.correlation += 1
            corr = self.correlation
            now = self.get_timestamp()
            stack = self.stack_of_this_thread()
            if p.KIND_EXTERNAL_CORRELATION in self.enabled and stack:
                ext = p.EXTERNAL_KIND_CUSTOM2
                self._add(SimpleNamespace(kind=p.KIND_EXTERNAL_CORRELATION, correlation_id=corr,
                                          external_kind=ext, external_id=stack[-1]))  # fmt: skip
            if p.KIND_RUNTIME in self.enabled:
                self._add(SimpleNamespace(kind=p.KIND_RUNTIME, cbid=211, start=now, end=now + 500,
                                          correlation_id=corr, process_id=1, thread_id=1))  # fmt: skip
            if p.KIND_DRIVER in self.enabled:
                self._add(SimpleNamespace(kind=p.KIND_DRIVER, cbid=307, start=now + 100, end=now + 400,
                                          correlation_id=corr, process_id=1, thread_id=1))  # fmt: skip
            if p.KIND_CONCURRENT_KERNEL in self.enabled:
                self._add(SimpleNamespace(kind=p.KIND_CONCURRENT_KERNEL, name=kernel, start=now + 1000,
                                          end=now + 1000 + duration_ns, correlation_id=corr, device_id=0,
                                          stream_id=7))  # fmt: skip
        if len(self.buffer) >= self.buffer_records:
            self._complete()

    def _add(self, rec) -> None:
        self.buffer.append(rec)

    def _complete(self) -> None:
        with self.lock:
            records, self.buffer = self.buffer, []
        if records and self.callbacks is not None:
            self.completed_threads.add(threading.current_thread().name)
            self.callbacks[1](records)
