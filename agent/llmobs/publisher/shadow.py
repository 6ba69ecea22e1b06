"""Shadow scoring: a second model scores every request of the primary, teacher-forced on its tokens.

    llmobs.shadow(primary, jittered, variant="int4-jitter3", labels={"quant": "int4-pc-j0.03"})

After each request of the primary ends (generate() through llmobs.instrument, a `with
llmobs.request(...)` loop, or a request the continuous-batching publisher serves, serving.py), its rows'
token ids (prompt, then each step's token: the chosen one, else
the target) go to a bounded queue; one background thread `llmobs-shadow` (nice 10) runs ONE forward pass
of the shadow model over prompt + tokens per request (the rows right-padded into one batch) and publishes,
per token step of the primary, the shadow's loss, entropy, target_prob, rank and top-1 probability
(device_math.device_block, the live path's own math) as ordinary step records:
- flags FLAG_SHADOW | FLAG_TEACHER_FORCED | FLAG_HAS_TARGET; target_id = the primary's token;
- the primary row's trace id, step index and position (so each shadow step pairs with the primary's
  token step on (trace_id, step, position)), its tenant and session;
- model_hash = the shadow's model id; step_seq = the pass's own (writer.side_step_seq: the pass is a
  forward of its own, so its eBPF costs are tagged with it through the thread's OTEP 4947 record, where
  the thread-context library is loaded; the process cell stays the live thread's);
- request_seq = the shadow request's own, one per row, whose labels (llmobs.publisher.labels) are the
  primary's, then the shadow's `variant` and `labels` over them, plus `shadow_of` = the primary row's
  request_seq (decimal); then a REQUEST_END record of it.
A primary request with a shadow always has a request_seq of its own (drawn here when it has none), so
the two pair at the request level too.

Requests of the primary: those whose model id (Request's model_id: instrument's for generate(); the
serving publisher's) is the primary's (with or without active adapters), and those of `llmobs.request`
loops that name no model.

Off the critical path: the live thread only keeps references to the token tensors (no host copy, no
sync) and enqueues at the request's end; a full queue drops the request (counted in `dropped`), never
waits. Where the flight recorder records the request (llmobs.Recorder), its device token buffer is used
as is. The shadow's forward runs inside replay_thread.replaying(), so the live hooks (hf.py, the layer
samplers) skip it even when the shadow is the primary itself or an instrumented model. Nothing here
raises into the workload: failures are counted (`failed`, `last_error`) and warned about once.
Bounded: `queue` requests waiting, MAX_STEPS token steps per row, MAX_POSITIONS scored positions per
request (rows past it are not scored, counted in `truncated`).
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_module
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np

from llmobs.publisher import labels as request_labels
from llmobs.publisher import request as publisher
from llmobs.publisher.replay_thread import replaying
from llmobs.shm import layout, thread_ctx

SHADOW_FLAGS = layout.FLAG_SHADOW | layout.FLAG_TEACHER_FORCED | layout.FLAG_HAS_TARGET
MAX_STEPS = 4096  # token steps of a row kept for its shadow score; later steps are not scored
MAX_POSITIONS = 8192  # positions (rows x kept logits) one shadow forward scores: bounds its logits' memory
DEFAULT_QUEUE = 64


@dataclass
class _Job:
    """One ended primary request, as the shadow thread needs it (references only: taken at the end)."""

    shadows: list
    prompts: list  # per row: the prompt's token ids (np.int64, padding removed)
    tokens: object  # torch [rows, >= n] (the recorder's buffer), a list of n tensors [rows], or np [1, n]
    n: int  # token steps of the request
    trace_hi: list
    trace_lo: list
    tenant_hash: int
    session_hash: int
    request_seqs: list
    labels: tuple
    t_end: int


class _Tokens:
    """A primary request's token per step, kept by Request.step when the flight recorder does not."""

    __slots__ = ("steps", "capped")

    def __init__(self):
        self.steps: list = []
        self.capped = False

    def append(self, token) -> None:
        if len(self.steps) < MAX_STEPS:
            self.steps.append(token)
        else:
            self.capped = True


class Shadow:
    """One shadow of one primary model (llmobs.shadow's handle). `.remove()` stops scoring new requests."""

    def __init__(self, scorer: _Scorer, primary_id: str, model, variant: str, labels, model_id: str,
                 tokenizer=None, factors: dict | None = None):  # fmt: skip
        self.scorer = scorer
        self.primary_id = primary_id
        self.model = model
        self.variant = variant
        self.model_id = model_id
        # the shadow's own labels, validated once: the variant, then the user's
        self.labels = request_labels.merge((), variant, labels)
        self.model_hash = 0
        self.factors = None  # its model factors (llmobs.publisher.factors), published with its steps
        try:
            from llmobs.publisher.factors import ModelFactors

            self.factors = ModelFactors(model, tokenizer, factors)
        except Exception as exc:  # no factors: the scores still go out
            publisher._count_error(exc)
        self.requests = 0  # primary requests scored (each a shadow request per row)
        self.steps = 0  # shadow step records published
        self.truncated = 0  # rows left unscored: past MAX_POSITIONS
        self.wall_ns = 0  # time spent in this shadow's passes (forward + metrics + publish)
        self.last_wall_ns = 0

    def scores(self, model_id: str | None) -> bool:
        if model_id is None:
            return True
        return model_id == self.primary_id or model_id.startswith(self.primary_id + "+")

    def remove(self) -> None:
        self.scorer.remove(self)

    # counters of the shared queue, per handle for convenience
    @property
    def dropped(self) -> int:
        return self.scorer.dropped

    @property
    def failed(self) -> int:
        return self.scorer.failed

    def wait_idle(self, timeout: float = 30.0) -> bool:
        return self.scorer.wait_idle(timeout)


class _Scorer:
    """The process's shadow scorer: the registered shadows, the bounded queue and its thread. Request
    calls open() at its start and ended() at its end (llmobs.publisher.request.shadow_hook)."""

    def __init__(self, size: int = DEFAULT_QUEUE):
        self.shadows: list[Shadow] = []
        self._queue: queue_module.Queue = queue_module.Queue(maxsize=size)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.enqueued = 0
        self.dropped = 0  # requests not scored: the queue was full
        self.failed = 0  # shadow passes that raised (last_error says why)
        self.skipped = 0  # ended requests with nothing to score (failed, no step, a step without a token)
        self.capped = 0  # requests longer than MAX_STEPS token steps: their first MAX_STEPS are scored
        self.last_error: str | None = None
        self._warned = False

    # --- the live thread -----------------------------------------------------------------------------
    def open(self, req, model_id: str | None, prompts: list):
        """At a Request's start: the shadows that score it, its rows' prompts and a token list (filled
        only where the flight recorder does not record the request); None when no shadow scores it.
        Draws the rows' request_seqs when they have none."""
        shadows = [s for s in self.shadows if s.scores(model_id)]
        if not shadows:
            return None
        seqs = req.request_seqs
        for i in range(len(seqs)):
            if not seqs[i]:
                seqs[i] = req.writer.next_request_seq()
        return _State(self, shadows, list(prompts), _Tokens())

    def ended(self, req, state: _State, failed: bool) -> None:
        """At a Request's end (before its REQUEST_END): hand its tokens to the shadow thread."""
        if failed or req.step_index == 0:
            self.skipped += 1
            return
        if state.tokens.capped or req.step_index > MAX_STEPS:
            self.capped += 1  # scored up to MAX_STEPS
        rec = req._recording
        if rec is not None and not state.tokens.steps and rec.tokens is not None:
            tokens, n = rec.tokens, min(rec.n, MAX_STEPS)  # the recorder's device buffer, as is
        else:
            tokens, n = state.tokens.steps, len(state.tokens.steps)
        self._submit(_Job(
            state.shadows, state.prompts, tokens, n, list(req._hi_list), list(req._lo_list),
            req.tenant_hash, req.session_hash, req.request_seqs.tolist(), tuple(req.labels or ()),
            time.monotonic_ns(),
        ))  # fmt: skip

    def open_served(self, model_id: str | None, prompt) -> _State | None:
        """A served request arrived (publisher/serving.py): the shadows that score it, or None. Its
        tokens come one host int per committed step (the engine thread)."""
        shadows = [s for s in self.shadows if s.scores(model_id)]
        return _State(self, shadows, [np.asarray(prompt, np.int64)], _Tokens()) if shadows else None

    def ended_served(self, req, reason: str) -> None:
        """A served request (serving.ServingRequest) finished: its tokens to the shadow thread. A failed
        one is not scored; a cancelled one is, up to its last committed token."""
        state = req.shadow
        if reason == "error" or not req.steps:
            self.skipped += 1
            return
        rec = req.recording
        if rec is not None and rec.tokens is not None and not state.tokens.steps:
            tokens = np.asarray(rec.tokens[:, : min(rec.n, MAX_STEPS)], np.int64)  # the recorder's host ids
        else:
            tokens = np.asarray(state.tokens.steps, np.int64).reshape(1, -1)
        self._submit(_Job(
            state.shadows, state.prompts, tokens, tokens.shape[1], [req.trace_hi], [req.trace_lo],
            req.tenant_hash, req.session_hash, [req.request_seq], tuple(getattr(req, "labels", ()) or ()),
            time.monotonic_ns(),
        ))  # fmt: skip

    def _submit(self, job: _Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue_module.Full:
            self.dropped += 1
            return
        self.enqueued += 1
        if self._thread is None or not self._thread.is_alive():
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            thread = threading.Thread(target=self._serve, name="llmobs-shadow", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # interpreter shutdown: what is queued stays unscored
                return
            self._thread = thread

    def remove(self, shadow: Shadow) -> None:
        with self._lock:
            self.shadows = [s for s in self.shadows if s is not shadow]
            if not self.shadows and publisher.shadow_hook is self:  # requests cost nothing again
                publisher.shadow_hook = None

    def wait_idle(self, timeout: float) -> bool:
        """Until every queued request is scored (tests, benchmarks); False on timeout. The queue's own
        count of unfinished jobs: a job is counted from its put to its task_done, taken or not."""
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    # --- the shadow thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # below the workload's threads
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while True:
            job = self._queue.get()
            try:
                for shadow in job.shadows:
                    try:
                        _score(shadow, job)
                    except Exception as exc:  # e.g. out of memory, a broken model: counted, never raised
                        self._fail(exc)
            finally:
                self._queue.task_done()

    def _fail(self, exc: BaseException) -> None:
        self.failed += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:500]
        if not self._warned:
            self._warned = True
            warnings.warn(f"llmobs: a shadow score failed ({self.last_error}); the workload goes on, "
                          "further failures are only counted", stacklevel=2)  # fmt: skip


@dataclass
class _State:
    """What a request keeps for its shadows from its start to its end (its scorer: the one that opened it,
    even if the last shadow is removed meanwhile)."""

    scorer: _Scorer
    shadows: list
    prompts: list
    tokens: _Tokens


def _host_tokens(job: _Job):
    """[rows, n] int64 on the host: the rows' token per step (-1 where a step had none). The device to
    host copy waits for the live stream's work: on this thread, never the live one."""
    import torch

    rows = len(job.prompts)
    if isinstance(job.tokens, np.ndarray):  # a served request's host ids
        return job.tokens[:, : job.n]
    if isinstance(job.tokens, list):
        cols = []
        for t in job.tokens[: job.n]:
            if t is None or t.numel() != rows:  # a step whose tokens are not the rows': stop there
                break
            cols.append(t.reshape(rows).to(torch.int64))
        if not cols:
            return np.zeros((rows, 0), np.int64)
        devices = {c.device for c in cols}  # one copy to the host, not one per step
        stacked = torch.stack(cols, 1) if len(devices) == 1 else torch.stack([c.cpu() for c in cols], 1)
        return stacked.cpu().numpy()
    return job.tokens[:, : job.n].to("cpu", torch.int64).numpy()


def _score(shadow: Shadow, job: _Job) -> None:
    import torch

    from llmobs.publisher.device_math import device_block

    t0 = time.monotonic_ns()
    tokens = _host_tokens(job)
    w = publisher.get_writer()
    rows = []  # (row, sequence, prompt length, steps scored)
    for r, prompt in enumerate(job.prompts):
        known = tokens[r]
        bad = np.flatnonzero(known < 0)
        n = int(bad[0]) if len(bad) else len(known)  # a step without a token ends what is known
        if n == 0 or len(prompt) == 0:
            continue
        rows.append((r, np.concatenate([prompt, known[:n]]), len(prompt), n))
    if not rows:
        shadow.scorer.skipped += 1
        return
    first = min(p for _, _, p, _ in rows) - 1  # the first position whose logits are scored
    width = max(len(s) for _, s, _, _ in rows)
    keep = width - first
    while rows and len(rows) * keep > MAX_POSITIONS:
        rows.pop()  # the last rows go first: the request's first rows stay scored
        shadow.truncated += 1
        if rows:
            first = min(p for _, _, p, _ in rows) - 1
            width = max(len(s) for _, s, _, _ in rows)
            keep = width - first
    if not rows:
        return
    device = _device_of(shadow.model)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (_, seq, _, _) in enumerate(rows):  # right padding: a causal row never sees its padding
        ids[i, : len(seq)] = torch.from_numpy(seq)
        mask[i, : len(seq)] = 1
    hi0, lo0 = job.trace_hi[rows[0][0]], job.trace_lo[rows[0][0]]
    step_seq = w.side_step_seq()
    thread_ctx.attach(w.pid, hi0, lo0, step_seq, job.tenant_hash)  # this thread's work: the shadow pass
    t_start = time.monotonic_ns()
    try:
        with replaying(), torch.inference_mode():
            logits = _forward(shadow.model, ids.to(device), mask.to(device), keep)
            blocks = []
            for i, (_, seq, plen, n) in enumerate(rows):
                # logits at position p predict the token at p + 1: step k's target sits at plen + k
                at = plen - 1 - (width - logits.shape[1])
                lg = logits[i, at : at + n]
                targets = torch.as_tensor(seq[plen : plen + n], device=lg.device)
                blocks.append(device_block(lg, targets, all_valid=True))
            block = torch.cat(blocks).cpu()  # host records: the map's CPU path, no pending device copies
    finally:
        thread_ctx.detach()
    t_end = time.monotonic_ns()
    shadow.model_hash = w.name(layout.NAME_MODEL, shadow.model_id)
    if shadow.factors is not None:
        shadow.factors.publish(w, shadow.model_hash, [])  # records only when one changed or was overwritten
    seqs, steps, positions, batch_rows, hi, lo, rseq = [], [], [], [], [], [], []
    for r, _, plen, n in rows:
        own = w.next_request_seq()
        seqs.append((r, own, plen, n))
        primary_seq = int(job.request_seqs[r])
        merged = request_labels.merge(job.labels, shadow.variant, dict(shadow.labels[1:]))
        merged = request_labels.merge(merged, None, {"shadow_of": str(primary_seq)})
        request_labels.publish(w, own, merged)  # before its steps: the reader knows them first
        k = np.arange(n, dtype=np.int64)
        steps.append(k)
        positions.append(plen + k)
        batch_rows.append(np.full(n, r, np.int64))
        hi += [job.trace_hi[r]] * n
        lo += [job.trace_lo[r]] * n
        rseq.append(np.full(n, own, np.int64))
    total = sum(len(s) for s in steps)
    w.publish_steps(
        block, step_seq=step_seq, t_start=t_start, t_end=t_end, trace_hi=np.array(hi, np.uint64),
        trace_lo=np.array(lo, np.uint64),
        tenant_hash=job.tenant_hash, session_hash=job.session_hash, model_hash=shadow.model_hash,
        step=np.concatenate(steps), position=np.concatenate(positions), batch_row=np.concatenate(batch_rows),
        kv_len=np.full(total, -1, np.int64), flags=SHADOW_FLAGS, tokens_in_pass=1,
        request_seq=np.concatenate(rseq),
    )  # fmt: skip
    now = time.monotonic_ns()
    for r, own, plen, n in seqs:
        w.publish_request_event(
            kind=layout.REQUEST_END, request_seq=own, step_seq=step_seq, trace_hi=job.trace_hi[r],
            trace_lo=job.trace_lo[r], tenant_hash=job.tenant_hash, session_hash=job.session_hash,
            model_hash=shadow.model_hash, t_start=job.t_end, t_scheduled=t_start, t_first_token=t_end,
            t_last_token=t_end, t_end=now, prompt_tokens=plen, prefill_tokens=plen + n, decoded_tokens=n,
            finish_reason=layout.FINISH_UNKNOWN,
        )  # fmt: skip
    shadow.requests += 1
    shadow.steps += total
    shadow.last_wall_ns = time.monotonic_ns() - t0
    shadow.wall_ns += shadow.last_wall_ns


def _forward(model, ids, mask, keep: int):
    """The shadow's logits [rows, <= width, V] of the last `keep` positions (all, if the model does not
    take logits_to_keep: older transformers or a plain module)."""
    try:
        out = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep, use_cache=False)
    except TypeError:
        out = model(input_ids=ids, attention_mask=mask)
    logits = out.logits if hasattr(out, "logits") else out
    return logits[:, -keep:] if logits.shape[1] > keep else logits


def _device_of(model):
    import torch

    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


_scorer: _Scorer | None = None
_scorer_lock = threading.Lock()


def _model_name(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "_name_or_path", "") or type(model).__name__


def shadow(primary_model, shadow_model, *, variant: str, labels: dict | None = None,
           model_id: str | None = None, factors: dict | None = None,
           queue: int = DEFAULT_QUEUE) -> Shadow:  # fmt: skip
    """Score every request of `primary_model` with `shadow_model`, teacher-forced on the primary's tokens
    (module docstring). `variant`: the shadow's variant label (what compare selects with variant:NAME);
    `labels`: more labels of the shadow's requests (over the primary's); `model_id`: the shadow's model id
    (default "<primary's model id>@<variant>" for a variant of the same base model: the same
    model object or config name; else the shadow's config name); `queue`: requests
    waiting to be scored at most (the first call's value holds for the process); `factors`: the
    shadow model's own factors over the automatic ones (as instrument's: {"quant": "int4-pc-j0.03"};
    its tokenizer is the primary's, whose tokens it scores). The primary is
    instrumented (llmobs.instrument) if it is not yet. Returns the handle: .remove(), counters."""
    global _scorer
    if not isinstance(variant, str) or not request_labels.merge((), variant, None):
        raise ValueError(f"llmobs.shadow: variant must be a label value (1..64 utf-8 bytes), not {variant!r}")
    if queue < 1:
        raise ValueError(f"llmobs.shadow: queue must be >= 1, not {queue}")
    from llmobs.publisher.hf import instrument

    inst = primary_model.__dict__.get("_llmobs_instrumented") or instrument(primary_model)
    primary_id = inst.model_id
    if model_id is None:  # a variant of the same base model (a copy, a quantization): named after the primary
        name = _model_name(shadow_model)
        same = shadow_model is primary_model or name in (primary_id, _model_name(primary_model))
        model_id = f"{primary_id}@{variant}" if same else name
    with _scorer_lock:
        if _scorer is None:
            _scorer = _Scorer(queue)
        scorer = _scorer
    tokenizer = getattr(inst, "tokenizer", None)
    handle = Shadow(scorer, primary_id, shadow_model, variant, labels, model_id, tokenizer, factors)
    with scorer._lock:
        scorer.shadows = [*scorer.shadows, handle]
    publisher.shadow_hook = scorer
    return handle


def scorer() -> _Scorer | None:
    """The process's shadow scorer (None before the first llmobs.shadow): counters, wait_idle."""
    return _scorer


def _after_fork_in_child() -> None:
    # The child has no shadow thread; what the parent had queued is the parent's to score.
    if _scorer is not None:
        _scorer._queue = queue_module.Queue(maxsize=_scorer._queue.maxsize)
        _scorer._thread = None
        _scorer._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
