"""The in-process CUPTI collector: idle until the agent asks (CMD_COLLECT_CUPTI), then K steps of
activity records into the map's CUPTI ring, then off again.

Threads and who does what:
- the workload thread, inside ShmWriter.begin_step: `handle` (enable, at the step the command is
  seen), `on_step` (pop the previous step's external id, push this one's) and `stop` (after K steps:
  pop, disable, hand over to the drain thread). Each is a few CUPTI calls, never a wait.
- CUPTI's thread(s): the buffer callbacks. They only append the buffer to a deque: a Python callback
  runs holding CUPTI's lock, and waiting there for anything (a lock, the drain thread) can deadlock
  against a workload thread that holds the GIL and calls into CUDA.
- the drain thread: decodes buffers (decode.ActivityDecoder), writes ring records, keeps the clock
  fit, and at the end flushes CUPTI, writes MARK_CLOCK and MARK_END (the agent's "all flushed" signal)
  and gives CUPTI back (unsubscribe).

NVIDIA's module is imported lazily as `cupti` (from cupti-python); nothing here runs until a command
arrives, so a workload that is never traced pays nothing.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import time

from llmobs import clock
from llmobs.cupti import protocol as p
from llmobs.cupti.decode import ActivityDecoder
from llmobs.cupti.ring import CuptiRing
from llmobs.shm import layout

DRAIN_PERIOD_S = 0.02  # how often the drain thread looks for completed buffers while collecting
BUFFER_BYTES = 4 << 20  # CUPTI activity buffer size handed out on request
MAX_QUEUED_BUFFERS = 256  # completed buffers waiting for the drain thread; more are dropped, counted
FINISH_TIMEOUT_S = 10.0  # how long the drain thread waits for the last step's GPU work before a forced flush
CLOCK_SAMPLES_START = 32
CLOCK_SAMPLES_PER_DRAIN = 4
MAX_CLOCK_SAMPLES = 1024


def load_cupti():
    """NVIDIA's cupti-python module; ImportError when it is not installed."""
    from cupti import cupti

    return cupti


def _profiler_running() -> bool:
    """True while torch.profiler (Kineto) is collecting: it owns CUPTI then."""
    try:
        import torch

        return bool(torch._C._autograd._profiler_enabled())
    except Exception:
        return False


class Refused(Exception):
    """A collection cannot start: `status` is the LLMOBS_ACK_* code, the message says why."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class CuptiCollector:
    """One per process. `handle` is the writer's CMD_COLLECT_CUPTI handler."""

    def __init__(self, load=load_cupti, profiler_running=_profiler_running):
        self._load = load
        self._profiler_running = profiler_running
        self.cupti = None
        self.writer = None
        self.active = False  # from handle() until the drain thread has written MARK_END
        self._subscriber = None
        self._enabled: list[int] = []
        self._pushed: dict[int, bool] = {}  # thread -> an id of ours is on its (per-thread) CUPTI stack
        self._buffers: collections.deque = collections.deque()
        self.queue_dropped = 0
        self._start_event = threading.Event()
        self._finish: tuple[int, object] | None = None  # (last step, CUDA event) once stop() ran
        self._first_step = 0
        self._thread: threading.Thread | None = None
        self.sessions = 0
        self.lost_ownership = False
        self.last_error: str | None = None
        self._claim_lock = threading.Lock()

    # --- who holds CUPTI: one subscriber per process (a live collection, or a replay's session) ------
    def try_claim(self) -> bool:
        """Take CUPTI for a collection (False: a live collection or a replay holds it). Atomic, so a
        CMD_COLLECT_CUPTI on the workload thread and a replay thread never both subscribe."""
        with self._claim_lock:
            if self.active:
                return False
            self.active = True
            return True

    def release(self) -> None:
        """Give CUPTI back (a refused start, the drain thread's end, a replay's end)."""
        self.active = False

    def load(self):
        """NVIDIA's cupti module (ImportError when cupti-python is missing)."""
        return self._load()

    def profiler_running(self) -> bool:
        return self._profiler_running()

    # --- the command handler (workload thread, inside begin_step) ---------------------------------
    def handle(self, writer, steps: int):
        """Start collecting for `steps` token steps; returns (ack status, stop callback)."""
        try:
            self._start(writer, steps)
        except Refused as exc:
            self.last_error = str(exc)
            _publish_status(writer, exc.status, str(exc))
            return exc.status, None
        return layout.ACK_OK, self.stop

    def _start(self, writer, steps: int) -> None:
        if steps < 1:
            raise Refused(layout.ACK_UNSUPPORTED, "asked for 0 steps; ask for at least 1")
        if not self.try_claim():
            raise Refused(layout.ACK_BUSY, "a CUPTI collection or a replay's CUPTI session is already "
                                           "running in this process")  # fmt: skip
        try:
            self._subscribe_and_enable(writer)
        except BaseException:
            self.release()
            raise

    def _subscribe_and_enable(self, writer) -> None:
        if self.cupti is None:
            try:
                self.cupti = self._load()
            except ImportError as exc:
                raise Refused(
                    layout.ACK_UNSUPPORTED,
                    f"cupti-python is not installed in this process's environment ({exc}); "
                    "pip install cupti-python",
                ) from None
        if self._profiler_running():
            raise Refused(layout.ACK_BUSY, "the PyTorch profiler is running in this process and owns CUPTI")
        cupti = self.cupti
        try:
            self._subscriber = cupti.subscribe(_ignore_callback, None)
        except Exception as exc:
            raise _refusal(cupti, exc, "subscribe") from None
        try:
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
            for kind in p.ENABLED_KINDS:
                cupti.activity_enable(kind)
                self._enabled.append(kind)
        except Exception as exc:
            self._disable()
            self._unsubscribe()
            raise _refusal(cupti, exc, "activity_enable") from None
        self.writer = writer
        self.sessions += 1
        self._finish = None
        self.lost_ownership = False
        self._first_step = writer.step_seq
        writer.step_hook = self.on_step  # begin_step calls it right after this handler returns
        self._ensure_thread()
        self._start_event.set()

    # --- per step (workload thread) -------------------------------------------------------------
    def on_step(self, step_seq: int) -> None:
        """At each step start (step_seq) or request end (0): the external id CUPTI stamps on API calls."""
        cupti = self.cupti
        if step_seq and self._profiler_running():  # the PyTorch profiler started: yield CUPTI to it
            self.lost_ownership = True
            self.stop()
            return
        tid = threading.get_ident()  # CUPTI's external-id stack is per thread: pop only what we pushed here
        try:
            if self._pushed.pop(tid, False):
                cupti.activity_pop_external_correlation_id(p.EXTERNAL_KIND_CUSTOM2)
            if step_seq:
                cupti.activity_push_external_correlation_id(p.EXTERNAL_KIND_CUSTOM2, step_seq)
                self._pushed[tid] = True
        except Exception as exc:  # never into the workload
            self.last_error = f"external correlation: {exc}"

    def stop(self) -> None:
        """After K steps (called by the writer at the start of step K+1): stop recording, hand over.
        Idempotent: it also runs early when the PyTorch profiler takes CUPTI over."""
        if self._finish is not None or not self.active:
            return
        writer = self.writer
        if writer is not None and writer.step_hook == self.on_step:
            writer.step_hook = None
        self.on_step(0)
        self._disable()
        event = None
        try:  # marks the end of the last collected step's GPU work, without waiting for it
            import torch

            event = torch.cuda.Event()
            event.record()
        except Exception:
            event = None
        last = writer.step_seq - 1 if writer is not None else 0
        self._finish = (last, event)

    def _disable(self) -> None:
        while self._enabled:
            kind = self._enabled.pop()
            with contextlib.suppress(Exception):
                self.cupti.activity_disable(kind)

    def _unsubscribe(self) -> None:
        if self._subscriber is not None:
            with contextlib.suppress(Exception):
                self.cupti.unsubscribe(self._subscriber)
            self._subscriber = None

    # --- CUPTI's buffer callbacks (CUPTI's thread, CUPTI's lock held): hand over, nothing else ----
    def _buffer_requested(self):
        return BUFFER_BYTES, 0

    def _buffer_completed(self, activities) -> None:
        if len(self._buffers) < MAX_QUEUED_BUFFERS:
            self._buffers.append(activities)
        else:
            self.queue_dropped += len(activities)

    # --- the drain thread --------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._drain_loop, name="llmobs-cupti-drain", daemon=True)
            self._thread.start()

    def _drain_loop(self) -> None:
        while True:
            self._start_event.wait()
            self._start_event.clear()
            try:
                self._drain_session()
            except Exception as exc:  # the workload goes on; the agent sees MARK_END or times out
                self.last_error = f"drain: {exc}"
            finally:
                self._buffers.clear()
                self._unsubscribe()
                self.release()

    def _drain_session(self) -> None:
        cupti, writer = self.cupti, self.writer
        session = DrainSession(writer, cupti)
        while self._finish is None:
            session.take_clock_samples(CLOCK_SAMPLES_PER_DRAIN)
            session.write(self._take_buffers())
            time.sleep(DRAIN_PERIOD_S)
        last_step, event = self._finish
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while event is not None and time.monotonic() < deadline:
            try:
                if event.query():
                    break
            except Exception:
                break
            session.write(self._take_buffers())
            time.sleep(0.005)
        with contextlib.suppress(Exception):
            cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: hand over partial buffers too
        session.take_clock_samples(CLOCK_SAMPLES_START)
        session.write(self._take_buffers())
        session.write([], final=True)
        session.finish(
            first_step=self._first_step, last_step=last_step, cupti_dropped=_dropped_records(cupti),
            collector_dropped=self.queue_dropped, lost_ownership=self.lost_ownership,
        )  # fmt: skip
        self.queue_dropped = 0

    def _take_buffers(self) -> list:
        out = []
        while self._buffers:
            out.extend(self._buffers.popleft())
        return out


class DrainSession:
    """One collection's decoding and writing: the clock fit, the decoder, the counters."""

    def __init__(self, writer, cupti, read_foreign=None):
        self.writer = writer
        self.cupti = cupti
        self._read_foreign = read_foreign or cupti.get_timestamp
        self.samples: list[clock.BracketedSample] = []
        self.fit: clock.ClockFit | None = None
        self.take_clock_samples(CLOCK_SAMPLES_START)
        self.decoder = ActivityDecoder(self._intern, None, self._api_name)  # times mapped per batch
        self.ring = CuptiRing(writer)
        self.written = 0

    def take_clock_samples(self, count: int) -> None:
        try:
            self.samples += clock.sample_brackets(self._read_foreign, count)
        except Exception:
            return
        if len(self.samples) > MAX_CLOCK_SAMPLES:  # keep the first ones: they anchor the drift
            self.samples = self.samples[:64] + self.samples[-(MAX_CLOCK_SAMPLES - 64) :]
        with contextlib.suppress(ValueError):
            self.fit = clock.fit_clock(self.samples)

    def _intern(self, text: str) -> int:
        return self.writer.name(layout.NAME_OTHER, text)

    def _api_name(self, kind: int, cbid: int) -> str:
        cupti = self.cupti
        domain = (
            cupti.CallbackDomain.DRIVER_API if kind == p.KIND_DRIVER else cupti.CallbackDomain.RUNTIME_API
        )
        return str(cupti.get_callback_name(domain, cbid))

    def write(self, activities, final: bool = False) -> int:
        records = self.decoder.decode(activities, final=final)
        self.ring.publish(records, self.fit)
        self.written += len(records)
        return len(records)

    def finish(self, *, first_step: int, last_step: int, cupti_dropped: int, collector_dropped: int,
               lost_ownership: bool = False) -> None:  # fmt: skip
        if self.fit is not None:
            f = self.fit
            mark = p.ClockMark(f.ref_mono_ns, f.offset_ns, f.drift_ppm, f.residual_ns, f.max_residual_ns,
                               f.samples)  # fmt: skip
            self.writer.publish_cupti(**mark.fields())
        end = p.EndMark(
            first_step=first_step, last_step=last_step, written=self.written, cupti_dropped=cupti_dropped,
            collector_dropped=collector_dropped, unattributed=self.decoder.unattributed,
            lost_ownership=lost_ownership,
        )  # fmt: skip
        self.writer.publish_cupti(**end.fields())


def _ignore_callback(*_args) -> None:
    """The subscriber's callback: never enabled for any domain, it only claims CUPTI for us."""


def _dropped_records(cupti) -> int:
    """Records CUPTI dropped for lack of buffer space (context-less buffers), 0 when unknown."""
    try:
        dropped = ctypes.c_size_t(0)
        cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(dropped))
        return int(dropped.value)
    except Exception:
        return 0


def _refusal(cupti, exc: Exception, what: str) -> Refused:
    """Map a CUPTI failure to the acknowledgement the agent sees, with the reason in words."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "driver is not found" in text or "libcuda" in text or type(exc).__name__ == "NotSupportedError":
        return Refused(layout.ACK_NO_GPU, f"no CUDA driver: {text}")
    status = getattr(exc, "status", None)
    result = getattr(cupti, "Result", None)
    busy = set()
    if result is not None:
        for name in ("ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED", "ERROR_OLD_PROFILER_API_INITIALIZED"):
            with contextlib.suppress(AttributeError):
                busy.add(int(getattr(result, name)))
    if status is not None and int(status) in busy:
        return Refused(
            layout.ACK_BUSY,
            f"another tool owns CUPTI in this process (the PyTorch profiler or Nsight?): {what}: {text}",
        )
    return Refused(layout.ACK_UNSUPPORTED, f"CUPTI {what} failed: {text}")


def _publish_status(writer, status: int, reason: str) -> None:
    """Tell the agent why, in-band: a MARK_STATUS record naming the reason in the names table."""
    with contextlib.suppress(Exception):
        h = writer.name(layout.NAME_OTHER, reason[: layout.NAME_TEXT_BYTES])
        writer.publish_cupti(**p.status_fields(status, writer.step_seq, h))
