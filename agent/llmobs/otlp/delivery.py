"""The OTLP exporter: a cursor over the store, one bounded batch in flight, retried until acknowledged.

Loop: read the next batch of unexported rows (source.ExportCursor) -> encode (encoder.TraceEncoder) ->
cut into requests under `max_request_bytes` (split) -> send them (transport) -> once all are acked,
commit the cursor and feed the metrics; on a retryable failure wait a jittered exponential backoff
(interrupted at once by `shutdown`) and send the unacked requests again; a request refused as too
large goes again halved.

Guarantees:
- at-least-once: the cursor moves only after an ack, in the same transaction as the request state, so an
  agent killed at any point resumes from the last acked batch; duplicates are limited to a batch whose
  ack was lost, or whose requests were acked in part when the agent stopped (span ids are
  deterministic, so the backend can drop them).
- bounded memory: nothing is queued; while the collector is down the rows wait in the store, and the
  exporter holds one batch (<= batch_spans steps, their events capped per span) whatever the backlog.
- counted: spans sent (acked), failed (spans in failed attempts, each attempt counted), dropped (the
  collector rejected them for good: a partial success, a non-retryable "bad data" answer, or a single
  span still too large for it).
- never raises into the pipeline from `export_pending`; `run()` raises ExportFailed only for a
  one-shot export that cannot finish (collector unreachable past `give_up_after_s`, or refused for a
  configuration reason such as authentication).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import duckdb

from llmobs import clock
from llmobs.bpf.records import trace_kept
from llmobs.errors import LlmobsError
from llmobs.otlp.backoff import Backoff
from llmobs.otlp.config import MIN_MAX_REQUEST_BYTES, OtlpConfig
from llmobs.otlp.encoder import EncodedTraces, SpanIds, TraceEncoder
from llmobs.otlp.metrics import MetricsAggregator
from llmobs.otlp.source import ExportCursor, StepBatch
from llmobs.otlp.split import halve, split_request
from llmobs.otlp.tenant_compute import TenantCompute
from llmobs.otlp.transport import SendResult, Transport, make_transport

if TYPE_CHECKING:
    from llmobs.store.sink import StoreCursor

log = logging.getLogger("llmobs.otlp")

# Answers that mean "fix the configuration", not "this data is bad": keep the rows, do not drop them.
_CONFIG_ERRORS = (
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "UNIMPLEMENTED",
    "NOT_FOUND",
    "HTTP 401",
    "HTTP 403",
    "HTTP 404",
    "HTTP 405",
)


# How often a follow loop forgets the export state of rows retention removed (ExportCursor.prune): two
# DELETEs, each with a min() over a table, so not every poll.
PRUNE_INTERVAL_S = 60.0
# A follow round that sent nothing (no new step, or each still settling or waiting for its rollup) makes
# the next wait twice as long, up to this: even an idle round reads the pending steps, the served and
# the open requests and the rollup watermark (~9 ms here), every poll_interval_s, which at a slowly
# stepping target (its spans held ~15 s for correlation) was most of the exporter's CPU. A round that
# sends goes back to poll_interval_s.
IDLE_POLL_MAX_S = 2.0


class ExportFailed(LlmobsError):
    exit_code = 12
    default_hint = (
        "check that the collector is up and reachable (--endpoint, --protocol); rows stay in the store"
    )


@dataclass
class ExportCounters:
    spans_sent: int = 0  # acknowledged by the collector (minus any it rejected)
    spans_failed: int = 0  # spans in attempts that failed; a batch tried 3 times counts 3 times
    spans_dropped: int = 0  # rejected for good (partial success, a non-retryable bad-data answer, or
    #                         a single span the collector refused as too large)
    spans_sampled_out: int = 0  # not sent because 1/N trace sampling left their trace out (still counted
    #                             in the metrics)
    batches_sent: int = 0  # batches committed (every request of theirs answered)
    requests_sent: int = 0  # trace requests acked: a batch over the request limit goes as several
    requests_too_large: int = 0  # requests the collector refused for their size (then sent halved)
    span_events_truncated: int = 0  # events cut from spans too large for a request of their own
    attempts_failed: int = 0
    retries: int = 0
    metrics_sent: int = 0
    metrics_failed: int = 0
    max_batch_spans: int = 0  # memory bound, observed: the largest batch held in flight
    max_batch_bytes: int = 0  # its encoding (all its requests together)
    max_request_bytes: int = 0  # the largest trace request the collector acknowledged
    last_error: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class OtlpExporter:
    """Exports a store's token steps, requests, probe events and metrics over OTLP."""

    def __init__(
        self,
        conn: duckdb.DuckDBPyConnection | StoreCursor,
        config: OtlpConfig,
        transport: Transport | None = None,
        stop: threading.Event | None = None,
        headroom: Callable[[Callable[[], object]], object] | None = None,
    ):
        self.config = config
        # A live store's memory cap is shared with the writer, the anomaly lane and correlate: a batch
        # read that runs out of it is run once more with headroom (DuckDBStore.with_headroom), not
        # failed and retried at the cap.
        self._headroom = headroom or (lambda run: run())
        self.cursor = ExportCursor(conn)
        self.stop = stop or threading.Event()
        # Set by rollups_committed (the store's follower call after each correlate commit, where
        # start_exporter registered it): what a round held back for rollups sleeps on (_sleep).
        self._rollups = threading.Event()
        self._rollups_followed = False
        self.transport = transport or make_transport(config)
        self.counters = ExportCounters()
        self.backoff = Backoff(config.backoff_initial_s, config.backoff_max_s, stop=self.stop)
        # max_request_bytes, lowered when the collector refuses a request as too large
        self._request_limit = config.max_request_bytes
        self.ids = SpanIds(
            config.trace_id_mode, self.cursor.salt() if config.trace_id_mode == "random" else b""
        )
        offset = self.cursor.wall_offset_ns()
        self.encoder = TraceEncoder(self.ids, offset, config.service_name, config.resource_attributes)
        resource = {k: v for k, v in self.encoder.resource(0, {}, None).items() if k != "process.pid"}
        self.metrics = MetricsAggregator(self.ids, offset, clock.realtime_ns(), resource)
        self.metrics.tenant_compute = TenantCompute(self.cursor.conn, self.metrics.tenants, offset)
        newest = self.cursor.newest_step_ns()
        # Settling by the agent's clock only makes sense for a store written on this boot.
        self._same_boot = newest is None or newest <= clock.monotonic_ns()
        self._last_metrics_ns = clock.monotonic_ns()
        self._metrics_dirty = False
        self._last_prune_ns = clock.monotonic_ns()
        self._thread: threading.Thread | None = None

    # -- one batch -------------------------------------------------------------------------------------

    def _next_batch(self, follow: bool) -> StepBatch:
        config = self.config
        now = clock.monotonic_ns()
        live = follow and self._same_boot
        cutoff = now - int(config.settle_s * 1e9) if live else None
        return self.cursor.next_batch(
            config.batch_spans,
            config.max_events_per_span,
            cutoff_ns=cutoff,
            rollup_cutoff_ns=now - int(config.rollup_wait_s * 1e9) if live else None,
            request_idle_ns=int(config.request_idle_s * 1e9),
            now_ns=now if self._same_boot else None,
            flush=not follow,
        )

    def _kept(self, trace_hex: str) -> bool:
        """1/N trace sampling: the kernel's own decision for this trace id (bpf trace_kept)."""
        try:
            hi, lo = int(trace_hex[:16], 16), int(trace_hex[16:32], 16)
        except ValueError:
            return True  # an untracked / malformed id: keep (it cannot be matched to kernel samples)
        return trace_kept(hi, lo, self.config.sample_n)

    def _deliver(self, batch: StepBatch, give_up_at_ns: int | None) -> bool:
        """Send `batch` until every request of it is acked (True) or stopped / given up / refused by
        configuration (False).

        The batch's encoding is cut into requests of at most the request limit (llmobs.otlp.split),
        sent one at a time in order; the cursor commits once the last is acked. A retry after a failure
        resends only the requests not acked yet. A request the collector refuses as too large is sent
        again at once (no backoff: a smaller request is a different request) as two halves, down to one
        span, whose events are then cut to fit, and which is dropped (counted) when it has none left to
        cut; later batches are cut to half the refused size. A batch left unfinished (given up, stopped,
        refused by configuration, agent killed) is read and sent whole next time: the requests of it
        already acked arrive twice, with the same span ids.
        """
        sent = batch if self.config.sample_n <= 1 else batch.only(self._kept)
        spans = sent.span_count
        self.counters.spans_sampled_out += batch.span_count - spans
        if spans == 0:  # every trace of the batch sampled out: nothing to send, still progress
            self._acked(batch, 0, 0)
            return True
        encoded = self.encoder.encode(sent)
        self.counters.max_batch_spans = max(self.counters.max_batch_spans, spans)
        self.counters.max_batch_bytes = max(self.counters.max_batch_bytes, encoded.ByteSize())
        pending = deque(self._split(encoded))
        del encoded  # cut into requests: hold the batch's bytes once, not twice, while it is sent
        self._idle()  # read and encoded: nothing of the store is held while it is sent, or retried
        acked = rejected = 0
        while pending:
            request = pending[0]
            result = self.transport.send_traces(request)
            if result.ok:
                pending.popleft()
                acked += request.spans
                rejected += min(result.rejected, request.spans)
                if result.rejected:
                    log.warning(
                        "collector rejected %d of %d spans: %s", result.rejected, request.spans, result.error
                    )
                self.counters.requests_sent += 1
                self.counters.max_request_bytes = max(self.counters.max_request_bytes, request.ByteSize())
                self.backoff.reset()
                continue
            self.counters.attempts_failed += 1
            self.counters.spans_failed += request.spans
            self.counters.last_error = result.error
            if result.too_large:
                self._too_large(pending, result)
                continue
            if not result.retryable:
                if any(marker in (result.error or "") for marker in _CONFIG_ERRORS):
                    log.error("collector refused the export: %s", result.error)
                    raise ExportFailed(
                        f"the collector refused the export ({result.error})",
                        hint="check --header / OTEL_EXPORTER_OTLP_HEADERS, TLS and the URL",
                    )
                # Bad data: retrying cannot help and would block every later row; count and move on.
                log.error("collector rejected %d spans for good: %s", request.spans, result.error)
                self.counters.spans_dropped += request.spans
                pending.popleft()
                continue
            if give_up_at_ns is not None and clock.monotonic_ns() >= give_up_at_ns:
                return False
            log.warning("export failed (%s); retrying", result.error)
            if not self.backoff.wait(result.retry_after_s):
                return False
            self.counters.retries += 1
        self._acked(batch, acked, rejected)
        return True

    def _split(self, encoded: EncodedTraces) -> list[EncodedTraces]:
        """The batch's requests under the request limit, counting the events cut from oversized spans."""
        split = split_request(encoded, self._request_limit)
        if split.events_truncated:
            self.counters.span_events_truncated += split.events_truncated
            log.warning(
                "%d spans over %d bytes each lost %d events to fit a request",
                split.spans_truncated,
                self._request_limit,
                split.events_truncated,
            )
        return split.requests

    def _too_large(self, pending: deque[EncodedTraces], result: SendResult) -> None:
        """The collector refused pending[0] for its size: halve it, or cut its one span's events, or
        drop that span when it has no events left to cut."""
        request = pending.popleft()
        size = request.ByteSize()
        self.counters.requests_too_large += 1
        # Later batches are cut below what was refused (not below the configured minimum: that would
        # take the events of ordinary spans on a collector that refuses a span for another reason).
        self._request_limit = max(MIN_MAX_REQUEST_BYTES, min(self._request_limit, size // 2))
        if request.spans > 1:
            log.warning("collector refused a request of %d bytes as too large; sending it halved", size)
            pending.extendleft(reversed(halve(request)))
            return
        if self._request_limit < size:
            smaller = self._split(request)
            if smaller[0].ByteSize() < size:
                pending.appendleft(smaller[0])
                return
        self.counters.spans_dropped += request.spans
        self.counters.last_error = (
            f"dropped a span of {size} bytes: the collector refused it as too large ({result.error})"
        )
        log.error("%s", self.counters.last_error)

    def _acked(self, batch: StepBatch, spans: int, rejected: int) -> None:
        """Every request of `batch` answered: commit the cursor, count, and feed the metrics."""
        self.cursor.commit(batch)
        self.counters.spans_sent += spans - rejected
        self.counters.spans_dropped += rejected
        self.counters.batches_sent += 1
        self.backoff.reset()
        try:
            self.metrics.observe(batch, None if self.config.sample_n <= 1 else self._kept)
            self._metrics_dirty = True
        except Exception as exc:  # metrics are derived; a bug there must not stop the spans
            self.counters.last_error = f"metrics: {exc}"
            log.exception("metrics aggregation failed")

    # -- loops -----------------------------------------------------------------------------------------

    def export_pending(self, follow: bool = False, give_up_at_ns: int | None = None) -> int:
        """Export batches until none is ready; return the spans acked. False from a batch ends early."""
        exported = 0
        while not self.stop.is_set():
            batch = self._next_batch(follow)
            if batch.span_count == 0:
                break
            before = self.counters.spans_sent + self.counters.spans_dropped
            if not self._deliver(batch, give_up_at_ns):
                break
            exported += self.counters.spans_sent + self.counters.spans_dropped - before
            self.maybe_send_metrics()
        return exported

    def maybe_send_metrics(self, force: bool = False) -> SendResult | None:
        now = clock.monotonic_ns()
        due = now - self._last_metrics_ns >= self.config.metrics_interval_s * 1e9
        if not (self._metrics_dirty or self.metrics.agent_dirty) or not (force or due):
            return None
        request = self.metrics.encode(clock.realtime_ns())
        self._last_metrics_ns = now
        if request is None:
            return None
        result = self.transport.send_metrics(request)
        if result.ok:
            self.counters.metrics_sent += 1
            # cumulative: a failed send is made good by the next one
            self._metrics_dirty = self.metrics.agent_dirty = False
        else:
            self.counters.metrics_failed += 1
            self.counters.last_error = result.error
        return result

    def _maybe_prune(self, force: bool = False) -> None:
        """Forget the export state of rows retention removed, at most every PRUNE_INTERVAL_S."""
        now = clock.monotonic_ns()
        if force or now - self._last_prune_ns >= PRUNE_INTERVAL_S * 1e9:
            self._last_prune_ns = now
            try:
                self.cursor.prune()
            except duckdb.Error as exc:  # bookkeeping only: the export goes on, the next prune retries
                self.counters.last_error = f"store: {str(exc).splitlines()[0]}"
                log.error("%s", self.counters.last_error)

    def run(self, follow: bool = False, give_up_after_s: float | None = 60.0) -> ExportCounters:
        """One-shot (export everything, flush open requests, send metrics) or follow until `shutdown`."""
        if follow:
            wait_s = self.config.poll_interval_s
            while not self.stop.is_set():
                try:
                    sent = self._headroom(functools.partial(self.export_pending, follow=True))
                    wait_s = self._next_poll(wait_s, sent)
                    self.maybe_send_metrics()
                    self._maybe_prune()
                except ExportFailed as exc:  # keep the rows; try again later, loudly
                    log.error("%s", exc)
                    self._idle()
                    self.backoff.wait()
                    continue
                except duckdb.Error as exc:  # e.g. the store is being compacted: try the next poll
                    self.counters.last_error = f"store: {str(exc).splitlines()[0]}"
                    log.error("%s", self.counters.last_error)
                self._idle()
                self._sleep(wait_s)
            self.maybe_send_metrics(force=True)
            return self.counters
        give_up = None if give_up_after_s is None else clock.monotonic_ns() + int(give_up_after_s * 1e9)
        self.export_pending(follow=False, give_up_at_ns=give_up)
        self.maybe_send_metrics(force=True)
        self._maybe_prune(force=True)
        remaining = self.cursor.pending_steps()
        if remaining and not self.stop.is_set():
            raise ExportFailed(
                f"{remaining} token steps not exported: {self.counters.last_error or 'collector unreachable'}"
            )
        return self.counters

    def _next_poll(self, wait_s: float, sent: int) -> float:
        """The wait before the next follow round: poll_interval_s after a round that sent, else twice
        the last, up to IDLE_POLL_MAX_S (or poll_interval_s, if that is longer)."""
        interval = self.config.poll_interval_s
        return interval if sent else min(wait_s * 2, max(IDLE_POLL_MAX_S, interval))

    def follow_rollups(self, store) -> None:
        """Be woken by `store` (a DuckDBStore) after each correlate commit on it, so that a round held
        back for rollups sleeps until then (_sleep): for a live store correlated in this process."""
        store.follow_rollups(self._rollups.set)
        self._rollups_followed = True

    def _sleep(self, wait_s: float) -> None:
        """Between follow rounds: `wait_s`; or, after a round held back by a step waiting for its
        rollup on a store that wakes this exporter (follow_rollups), until the next correlate commit or
        until that step would go without its rollup, checking `stop` every IDLE_POLL_MAX_S. At a slowly
        stepping target, whose steps wait ~15 s for correlation, the rounds polled in between read the
        same held steps again and sent nothing: most of the exporter's CPU there."""
        held_s = self.cursor.held_for_ns / 1e9
        if not (self._rollups_followed and held_s > wait_s):
            self.stop.wait(wait_s)
            return
        deadline_ns = clock.monotonic_ns() + self.cursor.held_for_ns
        while not self.stop.is_set():
            left = (deadline_ns - clock.monotonic_ns()) / 1e9
            if left <= 0 or self._rollups.wait(min(left, IDLE_POLL_MAX_S)):
                break
        self._rollups.clear()  # before the next round reads: a commit during it sets it again

    def _idle(self) -> None:
        """Between rounds, nothing held: a live store's cursor (StoreCursor) goes back to the store, so
        that the store can reopen its database meanwhile (DuckDBStore.recycle)."""
        idle = getattr(self.cursor.conn, "idle", None)
        if idle is not None:
            idle()

    def start(self) -> threading.Thread:
        """Follow in a background thread (how `attach --otlp` runs it next to the ingest)."""
        self._thread = threading.Thread(
            target=self.run, kwargs={"follow": True}, name="llmobs-otlp", daemon=True
        )
        self._thread.start()
        return self._thread

    def shutdown(self, timeout: float | None = 5.0) -> ExportCounters:
        """Stop retrying at once (the backoff wait is interrupted), join the thread, close the transport."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.transport.close()
        return self.counters

    def finish(self, timeout: float = 10.0) -> ExportCounters:
        """Stop following, export what is still pending within `timeout`, send metrics, close.

        `attach --otlp` calls this at detach, after the pipeline's last commit and correlate and before
        the store closes, so the last token steps and the finished requests' spans leave too. Rows it
        cannot deliver in time stay unexported behind the cursor (a later `llmobs-agent otlp` sends them).
        """
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # stuck in a send: never run two loops over one cursor
                self.transport.close()
                return self.counters
        self.stop.clear()
        try:
            give_up_at_ns = clock.monotonic_ns() + int(timeout * 1e9)
            self._headroom(functools.partial(self.export_pending, follow=False, give_up_at_ns=give_up_at_ns))
            self.maybe_send_metrics(force=True)
        except (ExportFailed, duckdb.Error) as exc:
            self.counters.last_error = str(exc).splitlines()[0]
        finally:
            self.stop.set()
            self.transport.close()
        return self.counters

    def status(self) -> dict:
        return {
            **self.counters.as_dict(),
            **self.cursor.counts(),
            "pending_steps": self.cursor.pending_steps(),
        }
