"""The ServingAdapter for Hugging Face transformers' continuous batching (transformers 5.x).

No source file of transformers is changed: methods of the manager's own objects are wrapped at run time.

- the manager's input queue `put` (client thread, inside add_request/add_requests): request_arrived,
  with the client's llmobs.context (tenant, session) and the RequestState's prompt and id;
- ContinuousBatchProcessor.prepare_next_batch (engine thread): once a batch is scheduled, its rows come
  from the IO object's `requests_in_batch` (FutureRequestState: state, query_length, has_new_token;
  the state's position_offset already counts the query) -> pass_begin, before the forward;
- a forward hook on the model: the logits at `logits_indices` (the rows that produce a token) ->
  pass_logits;
- ContinuousBatchProcessor.update_batch: which rows' states gained a generated token -> pass_end
  (in the asynchronous mode the update of pass N runs after pass N+1 was launched: passes are queued);
  published when the update hands its outputs to the OutputRouter (deliver / deliver_batch), before any
  client can see a token of the pass, else when the update returns: a client that received its last
  token finds all its token steps and its end record in the map already (published after the delivery,
  the last pass raced the client, and an agent stopped right then missed its steps);
- Scheduler.finish_request, Scheduler.clear_cancelled_requests and OutputRouter.fail_and_deliver: the
  request's end (stop | length | cancelled | error) with the KV-cache blocks it held -> request_finished.

A wrapper never lets an exception of ours reach the engine (counted, warned once) and always calls the
engine's own method exactly once with its own arguments.
"""

from __future__ import annotations

import collections
import functools

from llmobs.publisher import request as publisher
from llmobs.publisher.replay_thread import in_replay_thread
from llmobs.publisher.serving import Row, ServingAdapter, ServingPublisher

__all__ = ["instrument_manager", "TransformersAdapter", "ServingAdapter", "ServingPublisher", "Row"]
MAX_PASSES_IN_FLIGHT = 4  # passes begun but not updated yet (the async mode has 2); older ones are dropped


def _safe(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # never into the engine
            publisher._count_error(exc)
            return None

    return wrapped


def instrument_manager(manager, *, model_id: str | None = None) -> TransformersAdapter:
    """Publish every request's token steps from a transformers ContinuousBatchingManager (the object
    `model.init_continuous_batching()` returns; `generate_batch` and `transformers serve` use one).
    `llmobs.instrument(model)` does this for every manager the model hands out. Idempotent; returns the
    adapter (its .publisher holds the counters; .remove() undoes it). Public as llmobs.serving."""
    return TransformersAdapter.attach(manager, model_id=model_id)


class TransformersAdapter:
    """Installs the publisher on one ContinuousBatchingManager; .remove() undoes every wrapper."""

    def __init__(self, manager, publisher_: ServingPublisher):
        self.manager = manager
        self.publisher = publisher_
        self._undo: list[tuple[object, str, object]] = []  # (object, attribute, what it had in __dict__)
        self._inflight: collections.deque = collections.deque()
        self._ending: list[tuple[str, str, int]] = []  # (request id, reason, kv blocks) awaiting the update
        self._in_update = False
        self._updating = None  # the in-flight entry of the running update, until its steps are published
        self._busy = False  # a pass was begun since the context cell was last cleared
        self._processors: set[int] = set()
        self._hook = None

    @classmethod
    def attach(cls, manager, *, model_id: str | None = None) -> TransformersAdapter:
        existing = getattr(manager, "_llmobs_serving", None)
        if existing is not None:
            return existing
        if model_id is None:
            config = getattr(getattr(manager, "model", None), "config", None)
            model_id = (
                getattr(config, "_name_or_path", "") or type(getattr(manager, "model", manager)).__name__
            )
        adapter = cls(manager, ServingPublisher(model_id))
        adapter.install()
        manager._llmobs_serving = adapter
        return adapter

    # --- installing ----------------------------------------------------------------------------------
    def _wrap(self, obj, name: str, make) -> None:
        original = getattr(obj, name)
        self._undo.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, make(original))

    def install(self) -> None:
        m = self.manager
        self._wrap(m.input_queue, "put", self._wrap_put)
        self._wrap(m, "_create_batch_processor", self._wrap_create)
        self._wrap(m.output_router, "fail_and_deliver", self._wrap_fail)
        self._wrap(m.output_router, "deliver", self._wrap_deliver)
        self._wrap(m.output_router, "deliver_batch", self._wrap_deliver)
        self._hook = m.model.register_forward_hook(self._forward_hook, with_kwargs=True)
        if getattr(m, "batch_processor", None) is not None:  # warmed up (or kept) before we came
            self._instrument_processor(m.batch_processor)

    def remove(self) -> None:
        for obj, name, had in reversed(self._undo):
            if had is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, had)
        self._undo.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.manager.__dict__.pop("_llmobs_serving", None)
        self.publisher.close()

    def _instrument_processor(self, bp) -> None:
        if bp is None or id(bp) in self._processors:
            return
        self._processors.add(id(bp))
        self._wrap(bp, "prepare_next_batch", self._wrap_prepare(bp))
        self._wrap(bp, "update_batch", self._wrap_update)
        self._wrap(bp.scheduler, "finish_request", self._wrap_finish(bp))
        self._wrap(bp.scheduler, "clear_cancelled_requests", self._wrap_cancel(bp))

    # --- the wrappers ----------------------------------------------------------------------------------
    def _wrap_put(self, put):
        def wrapped(item, *args, **kwargs):
            self._arrived(item)
            return put(item, *args, **kwargs)

        return wrapped

    @_safe
    def _arrived(self, state) -> None:
        request_id = getattr(state, "request_id", None)
        prompt = getattr(state, "initial_tokens", None)
        if request_id is not None and prompt is not None:
            self.publisher.request_arrived(request_id, prompt)

    def _wrap_create(self, create):
        def wrapped(*args, **kwargs):
            bp = create(*args, **kwargs)
            _safe(self._instrument_processor)(bp)
            return bp

        return wrapped

    def _wrap_prepare(self, bp):
        def wrap(prepare):
            def wrapped(*args, **kwargs):
                scheduled = prepare(*args, **kwargs)
                if scheduled:
                    self._begin(bp)
                elif self._busy:  # the engine went idle: its idle work is no pass's
                    self._idle()
                return scheduled

            return wrapped

        return wrap

    @_safe
    def _begin(self, bp) -> None:
        io = bp.inputs_and_outputs
        pairs = getattr(io, "io_pairs", None)
        if pairs is not None:  # the asynchronous IOs: the batch just prepared is the current pair's
            io = pairs[io.current_pair].host_io
        states, before, rows = [], [], []
        for fs in io.requests_in_batch:
            state = fs.state
            past = state.position_offset - fs.query_length  # prepare_batch_tensors already added the query
            prompt = None
            if state.request_id not in self.publisher._requests:
                prompt = state.initial_tokens[: state._true_initial_tokens or None]
            rows.append(Row(state.request_id, fs.query_length, past, bool(fs.has_new_token), prompt))
            states.append(state)
            before.append(len(state.generated_tokens))
        p = self.publisher.pass_begin(rows)
        self._busy = True
        self._inflight.append((p, states, before))
        while len(self._inflight) > MAX_PASSES_IN_FLIGHT:  # a pass that never got its update (an error)
            self._inflight.popleft()

    @_safe
    def _idle(self) -> None:
        self._busy = False
        self.publisher.writer.clear_context()

    def _forward_hook(self, module, args, kwargs, output):
        if self.publisher.current is None or in_replay_thread():  # not a pass we began (warmup, a replay)
            return None
        self._logits(kwargs, output)
        return None

    @_safe
    def _logits(self, kwargs, output) -> None:
        indices = kwargs.get("logits_indices")
        logits = getattr(output, "logits", None)
        if indices is None or logits is None:
            return
        logits = logits[0] if "logits_to_keep" in kwargs else logits[0, indices]  # [n, V]
        self.publisher.pass_logits(logits)

    def _wrap_update(self, update):
        def wrapped(*args, **kwargs):
            self._updating = self._inflight.popleft() if self._inflight else None
            self._in_update = True
            try:
                return update(*args, **kwargs)
            finally:
                self._in_update = False
                self._publish_update()  # if no delivery did (a pass of prefill chunks only delivers nothing)

        return wrapped

    def _wrap_deliver(self, deliver):
        def wrapped(*args, **kwargs):
            self._before_delivery()
            return deliver(*args, **kwargs)

        return wrapped

    @_safe
    def _before_delivery(self) -> None:
        """What a client will see must be in the map first. In an update the engine has committed every
        token of the pass when it delivers: its token steps, then the ends of the requests it finished;
        outside one (a failed request) the end record it is owed."""
        if self._in_update:
            self._publish_update()
        elif self._ending:
            self._flush_endings()

    def _publish_update(self) -> None:
        """The running update's token steps, then the request ends it collected; once per update."""
        entry, self._updating = self._updating, None
        self._end(entry)
        self._flush_endings()

    @_safe
    def _end(self, entry) -> None:
        if entry is None:
            return
        p, states, before = entry
        tokens = [
            state.generated_tokens[-1] if len(state.generated_tokens) > n else None
            for state, n in zip(states, before, strict=True)
        ]
        self.publisher.pass_end(p, tokens)

    def _wrap_finish(self, bp):
        def wrap(finish):
            def wrapped(request_id, *args, **kwargs):
                ending = _safe(self._ending_of)(bp, request_id)
                result = finish(request_id, *args, **kwargs)
                if ending is not None:
                    self._ending.append(ending)
                    if not self._in_update:  # an error path: no token of this pass will come
                        self._flush_endings()
                return result

            return wrapped

        return wrap

    def _ending_of(self, bp, request_id) -> tuple[str, str, int]:
        state = bp.scheduler.active_requests.get(request_id)
        return request_id, _finish_reason(state), _blocks_held(bp.cache, request_id)

    def _wrap_cancel(self, bp):
        def wrap(clear):
            def wrapped(*args, **kwargs):
                held = _safe(self._cancel_blocks)(bp) or {}
                cancelled = clear(*args, **kwargs)
                _safe(self._cancelled)(cancelled, held)
                return cancelled

            return wrapped

        return wrap

    def _cancel_blocks(self, bp) -> dict[str, int]:
        pending = bp.scheduler._requests_to_cancel
        return {rid: _blocks_held(bp.cache, rid) for rid in list(pending)[:1024]} if pending else {}

    def _cancelled(self, states, held: dict[str, int]) -> None:
        for state in states or ():
            self.publisher.request_finished(state.request_id, "cancelled", held.get(state.request_id, 0))

    def _wrap_fail(self, fail):
        def wrapped(state, error, *args, **kwargs):
            kv = _safe(self._blocks_anywhere)(state.request_id) or 0
            self._ending.append((state.request_id, "error", kv))  # published by its delivery, in `fail`
            result = fail(state, error, *args, **kwargs)
            if not self._in_update:
                self._flush_endings()
            return result

        return wrapped

    def _blocks_anywhere(self, request_id) -> int:
        bp = getattr(self.manager, "batch_processor", None)
        return _blocks_held(bp.cache, request_id) if bp is not None else 0

    @_safe
    def _flush_endings(self) -> None:
        endings, self._ending = self._ending, []
        for request_id, reason, kv in endings:
            self.publisher.request_finished(request_id, reason, kv)


_MISSING = object()


def _finish_reason(state) -> str:
    if state is None:
        return "error"
    status = int(getattr(state, "status", 0))
    if status >= 4 or getattr(state, "error", None):  # RequestStatus.FAILED
        return "error"
    tokens = state.generated_tokens
    if tokens and tokens[-1] in state._eos_token_ids:
        return "stop"
    return "length"


def _blocks_held(cache, request_id) -> int:
    """The KV-cache blocks a request holds, over the cache's allocators (its block tables)."""
    total = 0
    for allocator in getattr(cache, "cache_allocators", {}).values():
        table = getattr(allocator, "block_table", None)
        if isinstance(table, dict):
            total += len(table.get(request_id, ()))
    return total
