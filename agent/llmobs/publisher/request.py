"""The in-process token-step publisher: requests, their trace ids, tenant/session context, steps.

    with llmobs.request(input_ids, tenant="a", session="s1") as req:
        for ...:
            req.begin_step()            # before the forward pass: tags everything it does
            logits = model(...)
            req.step(logits, target_ids)

Tenant and session come from context variables, so concurrent requests (threads, asyncio tasks)
never mix. Nothing here ever raises into the workload once a request has started: a failure is
counted in `errors` and the step is skipped.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import warnings

import numpy as np

from llmobs.publisher import labels as request_labels
from llmobs.publisher import traceparent as w3c
from llmobs.shm import layout
from llmobs.shm.hashing import trace_id, trace_words
from llmobs.shm.writer import get_writer

_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmobs_tenant", default=None)
_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmobs_session", default=None)
_active: contextvars.ContextVar[Request | None] = contextvars.ContextVar("llmobs_request", default=None)
# The caller's W3C trace context (parsed): requests started under it join the caller's trace.
_traceparent: contextvars.ContextVar[w3c.TraceParent | None] = contextvars.ContextVar(
    "llmobs_traceparent", default=None
)
# The variant and labels (validated, merged over the outer context's) and the prompt text an intent
# fingerprint is derived from (llmobs.publisher.intent; the text itself never leaves the process)
_labels: contextvars.ContextVar[request_labels.Labels] = contextvars.ContextVar("llmobs_labels", default=())
_intent_text: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmobs_intent_text", default=None)
errors = 0  # steps skipped because publishing failed (the workload went on)
recorder = None  # the flight recorder (llmobs.publisher.recorder.FlightRecorder) when one is installed
shadow_hook = None  # the shadow scorer (llmobs.publisher.shadow) once llmobs.shadow() was called
_warned = False


def _count_error(exc: BaseException) -> None:
    global errors, _warned
    errors += 1
    if not _warned:
        _warned = True
        warnings.warn(f"llmobs: a token step could not be published ({exc!r}); continuing", stacklevel=3)


@contextlib.contextmanager
def context(
    tenant: str | None = None,
    session: str | None = None,
    traceparent: str | None = None,
    *,
    variant: str | None = None,
    labels: dict | None = None,
    intent_text: str | None = None,
):
    """Set the tenant and session for requests started inside this block (this thread/task only).

    `traceparent`: the caller's W3C traceparent; requests started inside carry the caller's trace id and
    their llmobs request span becomes a child of the caller's span. A malformed one is ignored (the
    requests keep their prompt-hash trace id), counted in llmobs.publisher.traceparent.malformed and
    warned about once; it never raises.

    `variant` and `labels` ({key: value}): stored with every request started inside (merged over an
    outer context's; bad ones dropped and counted, llmobs.publisher.labels). `intent_text`: the user's
    prompt text, from which each request started inside gets its intent fingerprint (in process; only
    ids and hashes are published, llmobs.publisher.intent)."""
    t1 = _tenant.set(tenant) if tenant is not None else None
    t2 = _session.set(session) if session is not None else None
    t3 = None
    if traceparent is not None:
        t3 = _traceparent.set(w3c.parse(traceparent))  # malformed: None, i.e. no caller trace in here
    t4 = None
    if variant is not None or labels is not None:
        t4 = _labels.set(request_labels.merge(_labels.get(), variant, labels))
    t5 = _intent_text.set(intent_text) if intent_text is not None else None
    try:
        yield
    finally:
        if t5 is not None:
            _intent_text.reset(t5)
        if t4 is not None:
            _labels.reset(t4)
        if t3 is not None:
            _traceparent.reset(t3)
        if t2 is not None:
            _session.reset(t2)
        if t1 is not None:
            _tenant.reset(t1)


def active_request() -> Request | None:
    return _active.get()


def prompt_rows(input_ids, attention_mask=None) -> list[np.ndarray]:
    """The prompt tokens of each batch row on the host (padding removed where a mask says so)."""
    ids = input_ids.detach().cpu().numpy() if hasattr(input_ids, "detach") else np.asarray(input_ids)
    ids = ids.reshape(1, -1) if ids.ndim <= 1 else ids.reshape(ids.shape[0], -1)
    if attention_mask is None:
        return [row for row in ids.astype(np.int64)]
    mask = attention_mask.detach().cpu().numpy() if hasattr(attention_mask, "detach") else attention_mask
    mask = np.asarray(mask).reshape(ids.shape).astype(bool)
    return [row[m].astype(np.int64) for row, m in zip(ids, mask, strict=True)]


class Request:
    """One request (a batch of prompts): its trace ids and the running step index."""

    def __init__(self, input_ids, *, tenant=None, session=None, model_id=None, attention_mask=None,
                 traceparent: str | None = None, variant: str | None = None, labels: dict | None = None,
                 intent_text: str | list[str] | None = None):  # fmt: skip
        self.writer = get_writer()
        rows = prompt_rows(input_ids, attention_mask)
        words = [trace_words(trace_id(r)) for r in rows]
        caller = w3c.parse(traceparent) if traceparent is not None else _traceparent.get()
        self.request_seqs = np.zeros(len(rows), dtype=np.int64)  # 0: no request record
        self.labels = _labels.get()
        if variant is not None or labels is not None:
            self.labels = request_labels.merge(self.labels, variant, labels)
        intents = _intents(intent_text if intent_text is not None else _intent_text.get(), len(rows))
        self._tagged = ()  # (request_seq, labels, intent record) to publish again if the ring overwrote them
        self._name_pos = self.writer.names_head
        if caller is not None:
            words = self._join_caller(caller, words)
        if self.labels or intents:  # a labelled request is a request of its own: request_seq, REQUEST_END
            self._tag(intents)
        self.trace_ids = [f"{hi:016x}{lo:016x}" for hi, lo in words]
        self.trace_hi = np.array([w[0] for w in words], dtype=np.uint64)
        self.trace_lo = np.array([w[1] for w in words], dtype=np.uint64)
        self._hi_list = [w[0] for w in words]
        self._lo_list = [w[1] for w in words]
        self.batch = len(rows)
        self.prompt_lens = np.array([len(r) for r in rows], dtype=np.int64)
        self.batch_rows = np.arange(self.batch, dtype=np.int64)
        w = self.writer
        self.tenant = tenant if tenant is not None else _tenant.get()
        self.session = session if session is not None else _session.get()
        self.tenant_hash = w.name(layout.NAME_TENANT, self.tenant)
        self.session_hash = w.name(layout.NAME_SESSION, self.session)
        self.model_hash = w.name(layout.NAME_MODEL, model_id)
        self.step_index = 0
        self._t_arrival = time.monotonic_ns()
        self._t_first_step = self._t_first_token = self._t_last_token = 0
        self._step_seq = 0  # set by begin_step, cleared by step
        self._t_start = 0
        self._kv_len = -1
        self._token = None
        self._recording = None  # what the flight recorder keeps of this request (None: no recorder)
        if recorder is not None:
            try:
                self._recording = recorder.open(rows, self.trace_ids, self.batch)
            except Exception as exc:
                _count_error(exc)
        self._shadow = None  # what llmobs.shadow keeps of this request to score it at its end
        if shadow_hook is not None:
            try:
                self._shadow = shadow_hook.open(self, model_id, rows)
            except Exception as exc:
                _count_error(exc)

    # --- context-manager use -----------------------------------------------------------------------
    def __enter__(self) -> Request:
        self._token = _active.set(self)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._token is not None:
            _active.reset(self._token)
            self._token = None
        self.end(failed=exc_type is not None)

    def end(self, failed: bool = False) -> None:
        """The request is over: the context cell goes back to "untracked", and on a GPU the request's
        last steps are committed (one wait per request, never per step). A request in its caller's
        trace also gets its request-end record per row (what its request span is made from)."""
        with contextlib.suppress(Exception):
            self.writer.clear_context()
            if self.writer._pending or self.writer._pending_layers:
                self.writer.poll_pending(wait=True)
        if self._recording is not None:
            self._recording.end()
        if self._shadow is not None:  # handed to the shadow thread (a bounded queue: never waits)
            state, self._shadow = self._shadow, None
            try:
                state.scorer.ended(self, state, failed)
            except Exception as exc:
                _count_error(exc)
        if self.request_seqs.any():
            try:
                self._publish_ends(layout.FINISH_ERROR if failed else layout.FINISH_UNKNOWN)
            except Exception as exc:
                _count_error(exc)
            self.request_seqs[:] = 0  # once

    def _join_caller(self, caller: w3c.TraceParent, words: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Every row joins the caller's trace; each row is a request of its own (request_seq) whose
        NAME_TRACE_CONTEXT record keeps the parent span and the row's prompt hash."""
        w = self.writer
        for i, (hi, lo) in enumerate(words):
            seq = w.next_request_seq()
            self.request_seqs[i] = seq
            w.name_trace_context(seq, f"{caller.text()} {hi:016x}{lo:016x}")
        return [(caller.trace_hi, caller.trace_lo)] * len(words)

    def _tag(self, intents: list[bytes | None]) -> None:
        """Each row's labels and intent record, under its request_seq (drawn now if it has none)."""
        w = self.writer
        tagged = []
        for i in range(len(self.request_seqs)):
            if not self.request_seqs[i]:
                self.request_seqs[i] = w.next_request_seq()
            seq = int(self.request_seqs[i])
            record = intents[i] if intents else None
            request_labels.publish(w, seq, self.labels)
            if record is not None:
                w.name_request_intent(seq, record)
            tagged.append((seq, record))
        self._tagged = tuple(tagged)

    def _publish_ends(self, reason: int) -> None:
        now = time.monotonic_ns()
        w = self.writer
        if self._tagged and w.names_head - self._name_pos >= w.names_capacity:  # overwritten: again
            for seq, record in self._tagged:
                request_labels.publish(w, seq, self.labels)
                if record is not None:
                    w.name_request_intent(seq, record)
        for i, seq in enumerate(self.request_seqs.tolist()):
            self.writer.publish_request_event(
                kind=layout.REQUEST_END, request_seq=seq, trace_hi=self._hi_list[i],
                trace_lo=self._lo_list[i], tenant_hash=self.tenant_hash, session_hash=self.session_hash,
                model_hash=self.model_hash,
                t_start=self._t_arrival, t_scheduled=self._t_first_step, t_first_token=self._t_first_token,
                t_last_token=self._t_last_token, t_end=now, prompt_tokens=int(self.prompt_lens[i]),
                prefill_tokens=int(self.prompt_lens[i]), decoded_tokens=self.step_index,
                finish_reason=reason,
            )  # fmt: skip

    # --- steps -------------------------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        return self._step_seq != 0

    def begin_step(self, kv_len: int = -1) -> int:
        """Call before the forward pass of a token step: stamps the context cell with a new step_seq."""
        self._t_start = time.monotonic_ns()
        self._t_first_step = self._t_first_step or self._t_start
        self._kv_len = kv_len
        self._step_seq = self.writer.begin_step(self._hi_list[0], self._lo_list[0], self.tenant_hash,
                                                self.session_hash)  # fmt: skip
        return self._step_seq

    def step(
        self,
        logits,
        target_ids=None,
        *,
        token_ids=None,
        all_valid: bool = False,
        flags: int = 0,
        tokens_in_pass=0,
    ) -> None:
        """Publish one token step: logits [B, V] (or [V], or [B, 1, V], or device_math.prepare(logits))
        and the targets [B] if known. `tokens_in_pass`: the tokens each row processed in this forward
        pass (an int or one per row; 0 = unknown), the weights its compute is shared by."""
        targets = tokens = None
        try:
            from llmobs.publisher.device_math import Prepared, device_block

            if not self._step_seq:
                self.begin_step()
            if isinstance(logits, Prepared):
                like = logits.x
            else:
                if logits.dim() == 1:
                    logits = logits.unsqueeze(0)
                elif logits.dim() == 3:
                    logits = logits[:, -1]
                like = logits
            targets = _as_tensor(target_ids, like)
            tokens = _as_tensor(token_ids, like)
            block = device_block(logits, targets, tokens, all_valid=all_valid)
            if targets is not None:
                flags |= layout.FLAG_HAS_TARGET
            n = block.shape[0]
            w = self.writer
            seqs = self.request_seqs
            if n == self.batch:
                hi, lo, rows, plen = self._hi_list, self._lo_list, self.batch_rows, self.prompt_lens
            else:  # logits rows that are not the request's rows: attribute them all to row 0
                hi, lo = [self._hi_list[0]] * n, [self._lo_list[0]] * n
                rows, plen = np.arange(n), np.full(n, self.prompt_lens[0])
                seqs = np.full(n, seqs[0])
                if np.ndim(tokens_in_pass):
                    tokens_in_pass = 0
            w.publish_steps(
                block, step_seq=self._step_seq, t_start=self._t_start, t_end=time.monotonic_ns(),
                trace_hi=hi, trace_lo=lo, tenant_hash=self.tenant_hash, session_hash=self.session_hash,
                model_hash=self.model_hash, step=self.step_index, position=plen + self.step_index,
                batch_row=rows, kv_len=self._kv_len, flags=flags, tokens_in_pass=tokens_in_pass,
                request_seq=seqs if seqs.any() else 0,
            )  # fmt: skip
            self._t_last_token = time.monotonic_ns()
            self._t_first_token = self._t_first_token or self._t_last_token
        except Exception as exc:  # never break the workload
            _count_error(exc)
        finally:
            if self._recording is not None:  # the token the sequence goes on with: emitted, else target
                self._recording.token_step(self._step_seq, tokens if tokens is not None else targets)
            elif self._shadow is not None:  # the recorder keeps them otherwise: the shadow reads its buffer
                self._shadow.tokens.append(tokens if tokens is not None else targets)
            self.step_index += 1
            self._step_seq = 0


def _as_tensor(values, like):
    if values is None:
        return None
    import torch

    if isinstance(values, torch.Tensor):
        return values.to(like.device, non_blocking=True).reshape(-1)
    return torch.as_tensor(values, device=like.device).reshape(-1)


def _intents(text, rows: int) -> list[bytes | None]:
    """Each row's packed intent fingerprint ([] when there is no text): one text for every row, or one
    per row. Never raises (a failure is counted: the request goes on without its fingerprint)."""
    if text is None:
        return []
    try:
        from llmobs.publisher.intent import fingerprint

        texts = [text] * rows if isinstance(text, str) else list(text)[:rows]
        records = [fingerprint(t).pack() if isinstance(t, str) and t else None for t in texts]
        return records + [None] * (rows - len(records))
    except Exception as exc:
        _count_error(exc)
        return []


def request(input_ids, *, tenant: str | None = None, session: str | None = None, model_id: str | None = None,
            attention_mask=None, traceparent: str | None = None, variant: str | None = None,
            labels: dict | None = None, intent_text: str | list[str] | None = None) -> Request:  # fmt: skip
    """Start a request: `with llmobs.request(input_ids, tenant="a", session="s1") as req: ...`.
    `traceparent` (else the one of llmobs.context): the request's rows join the caller's trace.
    `variant`, `labels`: merged over llmobs.context's; `intent_text` (else llmobs.context's): the prompt
    text its intent fingerprint is derived from (one for all rows or one per row)."""
    return Request(
        input_ids,
        tenant=tenant,
        session=session,
        model_id=model_id,
        attention_mask=attention_mask,
        traceparent=traceparent,
        variant=variant,
        labels=labels,
        intent_text=intent_text,
    )
