"""CUPTI activity of a replay's own passes (issue 17): which kernels each replayed forward pass ran on
the GPU, and for how long, collected by the replay thread itself while the live workload goes on.

    activity, reason = ReplayActivity.start(llmobs.cupti.installed())
    ... activity.pass_begin(k) / activity.pass_end() around replayed pass k ...
    summary = activity.finish(passes)   # after the replay's stream was synchronised

Why not the live collector's path (CMD_COLLECT_CUPTI into the map's CUPTI ring): that one attributes
records to live token steps (step_seq as CUPTI's external id) and the agent drains them as the steps'
GPU time; a replay's passes are not live steps, and its result file is where everything else about
them goes. So the replay thread subscribes to CUPTI for the replay's duration, pushes its own external
id around each pass (CUPTI's external-id stack is per thread: the live threads' kernels carry none of
ours and are left out), and summarises per pass into the result's meta.

CUPTI has one subscriber per process: the replay claims the live collector (CuptiCollector.try_claim),
so a CMD_COLLECT_CUPTI that arrives meanwhile is answered ACK_BUSY, and a replay that starts during a
live collection runs without CUPTI and says why. Nothing here raises into the replay: every CUPTI
failure becomes the summary's `reason`.
"""

from __future__ import annotations

import collections
import contextlib

from llmobs.cupti import protocol as p

# Kernels and copies only: the device work of the passes. No API records (the replay's CPU side is
# what the operator sequence already describes), no memory records.
REPLAY_KINDS = (p.KIND_CONCURRENT_KERNEL, p.KIND_MEMCPY, p.KIND_MEMSET, p.KIND_EXTERNAL_CORRELATION)
FLUSH_FORCED = 1  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: hand over partially filled buffers too
BUFFER_BYTES = 4 << 20
MAX_BUFFERS = 256  # completed buffers held until finish(); more are dropped, counted
TOP_KERNELS = 5  # the kernels by total time across the replay, named in the summary


class ReplayActivity:
    """One replay's CUPTI session on the replay thread; see the module docstring."""

    def __init__(self, collector, cupti):
        self.collector = collector
        self.cupti = cupti
        self._subscriber = None
        self._enabled: list[int] = []
        self._buffers: collections.deque = collections.deque()
        self._pushed = False
        self.dropped = 0

    @classmethod
    def start(cls, collector) -> tuple[ReplayActivity | None, str]:
        """(a running session, "") or (None, why not). `collector`: this process's CuptiCollector
        (llmobs.cupti.installed()), None where CUDA or cupti-python is missing."""
        if collector is None:
            return None, "no CUPTI collector in this process (no CUDA device, or llmobs.cupti not installed)"
        if not collector.try_claim():
            return None, "a live CUPTI collection (CMD_COLLECT_CUPTI) holds CUPTI in this process"
        try:
            cupti = collector.cupti if collector.cupti is not None else collector.load()
        except ImportError as exc:
            collector.release()
            return None, f"cupti-python is not installed in this process's environment ({exc})"
        if collector.profiler_running():
            collector.release()
            return None, "the PyTorch profiler is running in this process and owns CUPTI"
        collector.cupti = cupti
        session = cls(collector, cupti)
        try:
            session._subscriber = cupti.subscribe(_ignore, None)
            cupti.activity_register_callbacks(session._requested, session._completed)
            for kind in REPLAY_KINDS:
                cupti.activity_enable(kind)
                session._enabled.append(kind)
        except Exception as exc:
            session._close()
            return None, f"CUPTI refused the replay's session: {exc}"
        return session, ""

    # --- around each replayed pass (the replay thread) ----------------------------------------------
    def pass_begin(self, index: int) -> None:
        """Kernels launched from this thread until pass_end() belong to pass `index` (0-based)."""
        with contextlib.suppress(Exception):
            self.cupti.activity_push_external_correlation_id(p.EXTERNAL_KIND_CUSTOM2, index + 1)
            self._pushed = True

    def pass_end(self) -> None:
        if self._pushed:
            self._pushed = False
            with contextlib.suppress(Exception):
                self.cupti.activity_pop_external_correlation_id(p.EXTERNAL_KIND_CUSTOM2)

    @contextlib.contextmanager
    def outside_the_pass(self):
        """The capture's own measuring ops inside a pass (entropy, variance, copies): their kernels get
        external id 0, so they count as `other_records`, not as the model's."""
        pushed = False
        with contextlib.suppress(Exception):
            self.cupti.activity_push_external_correlation_id(p.EXTERNAL_KIND_CUSTOM2, 0)
            pushed = True
        try:
            yield
        finally:
            if pushed:
                with contextlib.suppress(Exception):
                    self.cupti.activity_pop_external_correlation_id(p.EXTERNAL_KIND_CUSTOM2)

    # --- the end (the replay thread, after its stream was synchronised) -----------------------------
    def finish(self, passes: int) -> dict:
        """Flush, give CUPTI back, and summarise: per pass (in pass order) the kernels, their summed
        device time, the copies and memsets; the top kernels by total time; records left out."""
        self.pass_end()
        with contextlib.suppress(Exception):
            self.cupti.activity_flush_all(FLUSH_FORCED)
        self._close()
        return summarise(self._take(), passes, self.dropped)

    def _close(self) -> None:
        while self._enabled:
            kind = self._enabled.pop()
            with contextlib.suppress(Exception):
                self.cupti.activity_disable(kind)
        if self._subscriber is not None:
            with contextlib.suppress(Exception):
                self.cupti.unsubscribe(self._subscriber)
            self._subscriber = None
        self.collector.release()

    # --- CUPTI's buffer callbacks (CUPTI's thread, its lock held): hand over, nothing else ----------
    def _requested(self):
        return BUFFER_BYTES, 0

    def _completed(self, activities) -> None:
        if len(self._buffers) < MAX_BUFFERS:
            self._buffers.append(activities)
        else:
            self.dropped += len(activities)

    def _take(self) -> list:
        out = []
        while self._buffers:
            out.extend(self._buffers.popleft())
        return out


def summarise(activities, passes: int, dropped: int = 0) -> dict:
    """Group activity records by the pass whose external id their API call carried (the correlation
    records map correlation id -> pass + 1). Records of other threads (no id of ours) are counted in
    `other_records` only."""
    pass_of: dict[int, int] = {}
    device = []
    for act in activities:
        try:
            kind = int(act.kind)
            if kind == p.KIND_EXTERNAL_CORRELATION:
                if int(act.external_kind) == p.EXTERNAL_KIND_CUSTOM2:
                    pass_of[int(act.correlation_id)] = int(act.external_id) - 1
            elif kind in p.DEVICE_KINDS:
                device.append(act)
        except Exception:
            dropped += 1
    kernels, kernel_ns, copies = [0] * passes, [0] * passes, [0] * passes
    by_name: dict[str, list[int]] = {}
    other = 0
    for act in device:
        k = pass_of.get(int(act.correlation_id), -1)
        if not 0 <= k < passes:
            other += 1
            continue
        ns = max(0, int(act.end) - int(act.start))
        if int(act.kind) in p.KERNEL_KINDS:
            kernels[k] += 1
            kernel_ns[k] += ns
            name = act.name.decode("utf-8", "replace") if isinstance(act.name, bytes) else str(act.name)
            entry = by_name.setdefault(name, [0, 0])
            entry[0] += 1
            entry[1] += ns
        else:
            copies[k] += 1
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return {
        "status": "collected", "reason": "", "kernels": kernels, "kernel_ns": kernel_ns, "copies": copies,
        "top_kernels": [{"name": name, "calls": c, "ns": ns} for name, (c, ns) in top],
        "other_records": other, "dropped_records": dropped,
    }  # fmt: skip


def not_collected(reason: str) -> dict:
    """The summary of a replay that ran without CUPTI (on the CPU, or CUPTI was busy or missing)."""
    return {"status": "off", "reason": reason}


def _ignore(*_args) -> None:
    """The subscriber callback: activity records need a subscriber, not callbacks."""
