"""Token steps of a continuously batching server: one forward pass = one step_seq, rows of many requests.

The engine-neutral half. An engine adapter (llmobs.publisher.hf_serving for transformers' continuous
batching; vLLM and SGLang would follow, docs/serving.md) turns the engine's own bookkeeping into five
calls on a ServingPublisher:

    request_arrived(request_id, prompt_ids)   client thread: tenant/session/traceparent from llmobs.context
    pass_begin(rows) -> Pass                  engine thread, before the forward: stamps the context cell
    pass_logits(logits)                       the forward's logits of the rows that produce a token
    pass_end(pass_, tokens)                   the tokens the engine committed: token steps + prefill chunks
    request_finished(request_id, reason, kv_blocks)   the request-end record (queue time, TTFT, TPOT, ...)

Each request keeps its own step index (0, 1, 2, ... per token it generated) however passes interleave.
Nothing here raises into the engine: a failure is counted in llmobs.publisher.request.errors and warned
once. The work per pass is bounded by its rows; the registry of live requests is bounded too.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from llmobs.publisher import request as publisher
from llmobs.shm import layout
from llmobs.shm.hashing import trace_id, trace_words
from llmobs.shm.writer import ShmWriter, get_writer

MAX_LIVE_REQUESTS = 1 << 16  # requests the publisher tracks at once; past it the oldest is dropped, counted
REASONS = {"stop": layout.FINISH_STOP, "length": layout.FINISH_LENGTH, "cancelled": layout.FINISH_CANCELLED,
           "error": layout.FINISH_ERROR}  # fmt: skip


@dataclass
class Row:
    """One row of a pass, as the engine scheduled it: `tokens` tokens of request `request_id`, the first
    at position `past` (the tokens of it already in the KV cache); `produces_token` when the pass's
    logits at its last token choose the request's next token (a decode, or a prompt's last chunk)."""

    request_id: str
    tokens: int
    past: int
    produces_token: bool
    prompt_ids: list[int] | None = None  # for a request the publisher was never told of (a fork)


@dataclass
class ServingRequest:
    """A request's identity (fixed when it arrived) and its running figures."""

    request_seq: int
    request_id: str
    trace_hi: int
    trace_lo: int
    tenant_hash: int
    session_hash: int
    model_hash: int
    prompt_tokens: int
    t_arrival: int
    name_pos: int = 0  # names-ring position its request id was published at
    trace_context: str = ""  # NAME_TRACE_CONTEXT text when it joined its caller's trace, else ""
    labels: tuple = ()  # its variant and labels (llmobs.publisher.labels.Labels), from llmobs.context
    intent: bytes | None = None  # its packed intent fingerprint (llmobs.context(intent_text=...))
    t_scheduled: int = 0
    t_first_token: int = 0
    t_last_token: int = 0
    last_step_seq: int = 0
    steps: int = 0  # token steps published: the index of its next one
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    recording: object = None  # the flight recorder's token ids of it (replayed from the prompt), or None
    shadow: object = None  # what llmobs.shadow keeps of it to score at its end (publisher/shadow.py), or None


@dataclass
class Pass:
    """One forward pass in flight: its rows (their requests resolved) and, once seen, its logits."""

    step_seq: int
    t_start: int
    rows: list[Row]
    requests: list[ServingRequest | None]
    token_rows: list[int]  # indexes of the rows that produce a token, in logits order
    prepared: object = None  # device_math.prepare(logits of token_rows), set by pass_logits
    done: bool = field(default=False)


class ServingAdapter(Protocol):
    """The engine-facing part: installs itself on an engine object and reports its bookkeeping to a
    ServingPublisher (the five calls above). It must never raise into the engine or slow it beyond a
    bounded amount of work per pass."""

    def install(self) -> None: ...

    def remove(self) -> None: ...


class ServingPublisher:
    """Turns an engine's batch bookkeeping into map records. Thread-safe for one engine thread plus any
    number of client threads calling request_arrived."""

    def __init__(self, model_id: str | None = None, writer: ShmWriter | None = None):
        self.writer = writer or get_writer()
        self.model_id = model_id
        self.model_hash = self.writer.name(layout.NAME_MODEL, model_id) if model_id else 0
        self._requests: OrderedDict[str, ServingRequest] = OrderedDict()
        self._lock = threading.Lock()
        self._seq = 0
        self.current: Pass | None = None  # the pass whose forward is running (its logits are awaited)
        self.evicted = 0  # requests dropped from the registry unfinished (the bound)
        self.passes = 0
        self.steps = 0
        self.cpu_ns = 0  # with measure=True: this publisher's own CPU time (benchmarks)
        self.measure = False

    # --- client side ---------------------------------------------------------------------------------
    def request_arrived(self, request_id: str, prompt_ids, *, tenant: str | None = None,
                        session: str | None = None, t_arrival: int | None = None) -> None:  # fmt: skip
        """A client added a request. Tenant, session, the caller's traceparent, the variant and labels and
        the intent text come from llmobs.context() of the calling thread or task (the client's, not the
        engine's)."""
        t0 = time.thread_time_ns() if self.measure else 0
        try:
            tenant = tenant if tenant is not None else publisher._tenant.get()
            session = session if session is not None else publisher._session.get()
            intent = publisher._intents(publisher._intent_text.get(), 1)
            self._register(request_id, prompt_ids, tenant, session, t_arrival, publisher._traceparent.get(),
                           publisher._labels.get(), intent[0] if intent else None)  # fmt: skip
        except Exception as exc:  # never raise into the client's call
            publisher._count_error(exc)
        if self.measure:
            self.cpu_ns += time.thread_time_ns() - t0

    def _register(self, request_id, prompt_ids, tenant, session, t_arrival=None, caller=None, labels=(),
                  intent=None) -> ServingRequest:  # fmt: skip
        w = self.writer
        ids = np.asarray(list(prompt_ids), dtype=np.int64)
        hi, lo = trace_words(trace_id(ids))
        context = ""
        if caller is not None:  # the caller's trace: its id on every record, the prompt hash kept aside
            context = f"{caller.text()} {hi:016x}{lo:016x}"
            hi, lo = caller.trace_hi, caller.trace_lo
        with self._lock:
            self._seq += 1
            seq = w.next_request_seq()  # u32, never 0 (0 means none); one counter per map
            req = ServingRequest(
                seq, str(request_id), hi, lo, w.name(layout.NAME_TENANT, tenant),
                w.name(layout.NAME_SESSION, session), self.model_hash, len(ids),
                t_arrival if t_arrival is not None else time.monotonic_ns(),
            )  # fmt: skip
            req.name_pos = w.names_head
            req.trace_context = context
            req.labels, req.intent = labels, intent
            if publisher.recorder is not None:  # token ids only: the engine's paged KV is not snapshotted
                req.recording = publisher.recorder.open([ids], [f"{hi:016x}{lo:016x}"], 1, per_step_rows=True)
            if publisher.shadow_hook is not None:
                req.shadow = publisher.shadow_hook.open_served(self.model_id, ids)
            w.name_trace_context(seq, context)  # before its id and steps: the reader knows it first
            w.name_request(seq, req.request_id)
            self._tag(req)
            self._requests[req.request_id] = req
            while len(self._requests) > MAX_LIVE_REQUESTS:
                self._requests.popitem(last=False)
                self.evicted += 1
        return req

    # --- engine side: one pass -------------------------------------------------------------------------
    def pass_begin(self, rows: list[Row]) -> Pass | None:
        """Before the forward pass of `rows`: a new step_seq in the context cell (for a pass of several
        requests trace id 0 and LLMOBS_CTX_MIXED; the tenant/session only when all rows share it)."""
        t0 = time.thread_time_ns() if self.measure else 0
        try:
            return self._begin(rows)
        except Exception as exc:
            publisher._count_error(exc)
            return None
        finally:
            if self.measure:
                self.cpu_ns += time.thread_time_ns() - t0

    def _begin(self, rows: list[Row]) -> Pass:
        now = time.monotonic_ns()
        reqs: list[ServingRequest | None] = []
        with self._lock:
            for row in rows:
                req = self._requests.get(row.request_id)
                if req is None:
                    req = self._adopt(row)
                reqs.append(req)
        first = reqs[0] if reqs else None
        hi = lo = tenant = session = 0
        flags = 0
        if first is not None:
            hi, lo, tenant, session = first.trace_hi, first.trace_lo, first.tenant_hash, first.session_hash
        for r in reqs[1:]:
            if r is not first:
                flags |= layout.CTX_MIXED
                if r is None or r.tenant_hash != tenant or r.session_hash != session:
                    flags |= layout.CTX_TENANTS_MIXED
        if flags & layout.CTX_MIXED:
            hi = lo = 0  # no single trace: the pass's work belongs to its rows (their token steps)
        if flags & layout.CTX_TENANTS_MIXED:
            tenant = session = 0
        tokens = sum(r.tokens for r in rows)
        seq = self.writer.begin_step(hi, lo, tenant, session, rows=len(rows), flags=flags,
                                     tokens=min(tokens, 0xFFFFFFFF))  # fmt: skip
        for row, req in zip(rows, reqs, strict=True):
            if req is None:
                continue
            if not req.t_scheduled:
                req.t_scheduled = now
                req.prefix_hit_tokens = row.past  # a new request's cached prefix: KV it did not compute
            if not req.t_first_token:
                req.prefill_tokens += row.tokens
        p = Pass(seq, now, rows, reqs, [i for i, row in enumerate(rows) if row.produces_token])
        self.current = p
        self.passes += 1
        return p

    def _adopt(self, row: Row) -> ServingRequest | None:
        """A request seen first in a pass (the engine forked it, or it was added before we were
        installed): registered now, with the engine thread's context."""
        if row.prompt_ids is None:
            return None
        return self._register(
            row.request_id, row.prompt_ids, publisher._tenant.get(), publisher._session.get(),
            labels=publisher._labels.get(),
        )  # fmt: skip

    def pass_logits(self, logits) -> None:
        """The forward's logits [n, V] (n >= the rows that produce a token, in their order): the
        target-independent metric passes run now, while they are hot in cache."""
        p = self.current
        if p is None or p.prepared is not None:
            return
        t0 = time.thread_time_ns() if self.measure else 0
        try:
            from llmobs.publisher.device_math import prepare

            n = len(p.token_rows)
            if n and logits.shape[0] >= n:
                p.prepared = prepare(logits[:n].detach())
        except Exception as exc:
            publisher._count_error(exc)
        finally:
            self.current = None
            if self.measure:
                self.cpu_ns += time.thread_time_ns() - t0

    def pass_end(self, p: Pass | None, tokens: list[int | None]) -> None:
        """The engine committed `tokens[i]` for row i (None: no token, e.g. a prefill chunk, or a token
        the engine dropped): one token step per committed token, one CHUNK event per token-less row."""
        if p is None or p.done:
            return
        t0 = time.thread_time_ns() if self.measure else 0
        try:
            self._end(p, tokens)
        except Exception as exc:
            publisher._count_error(exc)
        finally:
            p.done = True
            if self.current is p:
                self.current = None
            if self.measure:
                self.cpu_ns += time.thread_time_ns() - t0

    def _end(self, p: Pass, tokens: list[int | None]) -> None:
        now = time.monotonic_ns()
        w = self.writer
        keep, chosen = [], []  # logits-order indexes of committed tokens, and those tokens
        for j, i in enumerate(p.token_rows):
            token = tokens[i] if i < len(tokens) else None
            if token is not None and p.requests[i] is not None:
                keep.append(j)
                chosen.append(int(token))
        for i, row in enumerate(p.rows):
            req = p.requests[i]
            if req is not None and not row.produces_token:
                w.publish_request_event(
                    kind=layout.REQUEST_CHUNK, request_seq=req.request_seq, step_seq=p.step_seq,
                    trace_hi=req.trace_hi, trace_lo=req.trace_lo, tenant_hash=req.tenant_hash,
                    session_hash=req.session_hash, model_hash=req.model_hash, t_start=p.t_start,
                    t_scheduled=p.t_start, t_end=now, prompt_tokens=req.prompt_tokens,
                    prefill_tokens=row.tokens, finish_reason=row.past,
                )  # fmt: skip
        if not keep:
            return
        rows = [p.token_rows[j] for j in keep]
        reqs = [p.requests[i] for i in rows]
        block = self._block(p, keep, chosen)
        flags = np.array([layout.FLAG_GENERATE | (layout.FLAG_PREFILL if r.steps == 0 else 0) for r in reqs],
                         np.uint32)  # fmt: skip
        if p.prepared is not None:
            flags |= layout.FLAG_HAS_TARGET
        w.publish_steps(
            block, step_seq=p.step_seq, t_start=p.t_start, t_end=now,
            trace_hi=[r.trace_hi for r in reqs], trace_lo=[r.trace_lo for r in reqs],
            tenant_hash=np.array([r.tenant_hash for r in reqs], np.uint64),
            session_hash=np.array([r.session_hash for r in reqs], np.uint64),
            model_hash=np.array([r.model_hash for r in reqs], np.uint64),
            step=np.array([r.steps for r in reqs], np.int64),
            position=np.array([p.rows[i].past + p.rows[i].tokens for i in rows], np.int64),
            batch_row=np.array(rows, np.int64), kv_len=np.array([p.rows[i].past for i in rows], np.int64),
            flags=flags, tokens_in_pass=np.array([p.rows[i].tokens for i in rows], np.int64),
            request_seq=np.array([r.request_seq for r in reqs], np.int64),
        )  # fmt: skip
        for r, i, token in zip(reqs, rows, chosen, strict=True):
            if r.recording is not None:
                r.recording.host_step(p.step_seq, token, batch_row=i, live_batch=len(p.rows))
            elif r.shadow is not None:  # the recorder keeps them otherwise: the shadow reads its ids
                r.shadow.tokens.append(token)
        for r in reqs:
            r.steps += 1
            r.last_step_seq = p.step_seq
            r.t_last_token = now
            if not r.t_first_token:
                r.t_first_token = now
        self.steps += len(reqs)

    @staticmethod
    def _block(p: Pass, keep: list[int], chosen: list[int]):
        import torch

        from llmobs.publisher.device_math import Prepared, device_block

        if p.prepared is None:  # no logits were seen (e.g. a replayed CUDA graph): the tokens, no metrics
            n = len(chosen)
            nan = torch.full((n, 4), float("nan"))
            ints = torch.tensor([[-1, t, t] for t in chosen], dtype=torch.int32)
            return torch.cat([nan, ints.view(torch.float32)], -1)
        prep = p.prepared
        if len(keep) != prep.x.shape[0]:
            index = torch.tensor(keep, device=prep.x.device)
            prep = Prepared(*(t.index_select(0, index) for t in prep))
        targets = torch.tensor(chosen, device=prep.x.device)
        return device_block(prep, targets, all_valid=True)

    # --- engine side: the end of a request ---------------------------------------------------------------
    def request_finished(self, request_id: str, reason: str, kv_blocks: int = 0) -> None:
        """The request finished ("stop", "length"), failed ("error") or was cancelled ("cancelled"): its
        request-end record. Its committed token steps stay. Unknown or already ended ids are ignored."""
        t0 = time.thread_time_ns() if self.measure else 0
        try:
            with self._lock:
                req = self._requests.pop(str(request_id), None)
            if req is None:
                return
            if req.recording is not None:
                req.recording.end()
            if req.shadow is not None:
                req.shadow.scorer.ended_served(req, reason)  # a bounded queue: never waits
            w = self.writer
            if w.names_head - req.name_pos >= w.names_capacity:  # the names ring overwrote its id
                w.name_trace_context(req.request_seq, req.trace_context)
                w.name_request(req.request_seq, req.request_id)
                self._tag(req)
            w.publish_request_event(
                kind=layout.REQUEST_END, request_seq=req.request_seq, step_seq=req.last_step_seq,
                trace_hi=req.trace_hi, trace_lo=req.trace_lo, tenant_hash=req.tenant_hash,
                session_hash=req.session_hash, model_hash=req.model_hash, t_start=req.t_arrival,
                t_scheduled=req.t_scheduled, t_first_token=req.t_first_token, t_last_token=req.t_last_token,
                t_end=time.monotonic_ns(), prompt_tokens=req.prompt_tokens,
                prefill_tokens=req.prefill_tokens, decoded_tokens=req.steps,
                kv_blocks=max(0, int(kv_blocks)), prefix_hit_tokens=req.prefix_hit_tokens,
                finish_reason=REASONS.get(reason, layout.FINISH_UNKNOWN),
            )  # fmt: skip
        except Exception as exc:
            publisher._count_error(exc)
        finally:
            if self.measure:
                self.cpu_ns += time.thread_time_ns() - t0

    def _tag(self, req: ServingRequest) -> None:
        """Its labels and intent records (NAME_REQUEST_LABEL / NAME_REQUEST_INTENT, hash = request_seq)."""
        publisher.request_labels.publish(self.writer, req.request_seq, req.labels)
        if req.intent is not None:
            self.writer.name_request_intent(req.request_seq, req.intent)

    def live_requests(self) -> int:
        return len(self._requests)

    def close(self) -> None:
        """The engine stopped: requests it never finished are dropped (no end record; their steps stay),
        and the context cell says "untracked" again."""
        with self._lock:
            self._requests.clear()
        self.current = None
        try:
            self.writer.clear_context()
        except Exception as exc:
            publisher._count_error(exc)
