"""`llmobs.instrument(model)`: token steps from a Hugging Face causal LM without changing the loop.

Two forward hooks on the model and a wrapper around its `generate`:
- generate(): each forward pass is one token step. The pre-hook stamps the context cell (so eBPF
  tags the forward's work with the new step_seq) and, from that forward's input_ids, learns which
  token the previous step chose: that step is published then (the last one when generate returns).
- forward with labels: every target token of the batch is published (HF shift: logits[:, t]
  predicts labels[:, t+1]; label -100 = no target, published with NaN loss). The model's loss comes
  from the metrics' own log-softmax, to the bit (shared_loss.py): one log-softmax a pass, not two.
- inside `with llmobs.request(...)`: the pre-hook begins the request's step, `req.step` publishes.
With attention_entropy=AttentionEntropy(every=N) (llmobs.publisher.attention), every N-th forward pass
also publishes each layer's attention entropy to the map's layer-stream ring; mlp_variance=MlpVariance(N)
each layer's MLP output variance, layer_streams=LayerStreams(every=N) both (llmobs.publisher.layers).
All off by default. training=True (llmobs.publisher.training) keeps dL/dE of training steps on the device;
recorder=llmobs.Recorder(...) (llmobs.publisher.recorder) keeps what a replay of a token step needs.
The hooks return at once on a replay's thread (replay_thread.in_replay_thread): a replay publishes nothing.
Each request's model has its factors published (llmobs.publisher.factors; factors={...} adds to them);
intent=True fingerprints each generate() row's decoded prompt (llmobs.publisher.intent).
Hooks never raise into the workload: failures are counted (llmobs.publisher.request.errors).
"""

from __future__ import annotations

import contextvars
import functools
import time

import numpy as np

from llmobs.publisher import labels as request_labels
from llmobs.publisher import request as publisher
from llmobs.publisher import shared_loss
from llmobs.publisher.replay_thread import in_replay_thread
from llmobs.shm import layout
from llmobs.shm.hashing import trace_id, trace_words

_generating: contextvars.ContextVar[_Generation | None] = contextvars.ContextVar("llmobs_gen", default=None)


class _Generation:
    """State of one generate() call: its request and the step whose token is not chosen yet."""

    def __init__(self, req: publisher.Request):
        self.req = req
        self.pending = None  # prepare(logits) of the step awaiting its chosen token

    def finish(self, chosen) -> None:
        if self.pending is not None:
            logits, self.pending = self.pending, None
            req = self.req
            # the first forward processes each row's prompt, every later one the token chosen before
            first = req.step_index == 0
            req.step(logits, chosen.reshape(-1), all_valid=True,
                     flags=layout.FLAG_GENERATE | (layout.FLAG_PREFILL if first else 0),
                     tokens_in_pass=req.prompt_lens if first else 1)  # fmt: skip


def _kv_len(kwargs) -> int:
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = kwargs.get("cache")  # transformers 5.x names it `cache`
    if cache is None:
        return -1
    try:
        return int(cache.get_seq_length())
    except Exception:
        return -1


def active_adapters(model) -> list[str]:
    """Names of the LoRA/PEFT adapters active on `model` (transformers' PEFT integration or a
    peft.PeftModel); [] when none or when the model has no adapter support."""
    try:
        if getattr(model, "_hf_peft_config_loaded", False):
            names = model.active_adapters()
        elif hasattr(model, "peft_config") and hasattr(model, "active_adapters"):
            names = model.active_adapters
            names = names() if callable(names) else names
        else:
            return []
        return [names] if isinstance(names, str) else [str(n) for n in names]
    except Exception:
        return []


def _input_ids(args, kwargs):
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    return ids


class Instrumented:
    """Handle returned by instrument(); .remove() undoes it."""

    def __init__(self, model, model_id: str, labels: bool, measure: bool = False, attention_entropy=None,
                 mlp_variance=None, layer_streams=None, training=None, recorder=None, tokenizer=None,
                 factors: dict | None = None, intent: bool = False):  # fmt: skip
        from llmobs.publisher.factors import ModelFactors
        from llmobs.publisher.layers import build_samplers

        self.factors = ModelFactors(model, tokenizer, factors)
        self.tokenizer = tokenizer
        self.intent = bool(intent) and tokenizer is not None  # the prompt's text comes from its tokens

        # self.attention: the attention sampler alone (or None); self.layers drives every layer stream
        self.attention, self.layers = build_samplers(model, attention_entropy, mlp_variance, layer_streams)
        self.training = None
        if training:
            from llmobs.publisher.training import TrainingRecorder

            self.training = TrainingRecorder.for_model(model, training)
        self.recorder = None
        if recorder is not None:
            from llmobs.publisher import recorder as flight

            self.recorder = flight.install(model, recorder)
        self.model = model
        self.model_id = model_id
        self.labels = labels
        self._labels_state = contextvars.ContextVar("llmobs_labels", default=None)
        # a labelled pass's metrics block, computed by the model's loss function (shared_loss.py)
        self._shared_block = contextvars.ContextVar("llmobs_shared_block", default=None)
        charge = self._charge if measure else None
        self._shared_loss = (
            shared_loss.install(model, self._labels_state, self._shared_block, charge) if labels else None
        )
        self.cpu_ns = 0  # with measure=True: this thread's CPU time spent in the hooks (benchmarks)
        pre, post = (self._timed(self._pre), self._timed(self._post)) if measure else (self._pre, self._post)
        self._measure = measure
        self._handles = [
            model.register_forward_pre_hook(pre, with_kwargs=True),
            model.register_forward_hook(post, with_kwargs=True),
        ]
        self._orig_generate = model.__dict__.get("generate")
        if hasattr(model, "generate"):
            model.generate = self._wrap_generate(model.generate)
        # continuous batching (generate_batch, `transformers serve`): every manager the model hands out
        # publishes its requests' token steps (llmobs.publisher.hf_serving)
        self._orig_init_cb = model.__dict__.get("init_continuous_batching")
        if hasattr(model, "init_continuous_batching"):
            model.init_continuous_batching = self._wrap_init_cb(model.init_continuous_batching)
        model._llmobs_instrumented = self

    def remove(self) -> None:
        if self.layers is not None:
            self.layers.abort()
        if self.training is not None:
            self.training.remove()
        if self.recorder is not None:
            from llmobs.publisher import recorder as flight

            flight.uninstall(self.recorder)
        for h in self._handles:
            h.remove()
        if self._shared_loss is not None:
            shared_loss.uninstall(self.model, self._shared_loss)
        if self._orig_generate is None:
            self.model.__dict__.pop("generate", None)
        else:
            self.model.generate = self._orig_generate
        if self._orig_init_cb is None:
            self.model.__dict__.pop("init_continuous_batching", None)
        else:
            self.model.init_continuous_batching = self._orig_init_cb
        self.model.__dict__.pop("_llmobs_instrumented", None)

    def request_model_id(self) -> str:
        """The model id a request is recorded under: with active adapters, "<model>+<a>,<b>"."""
        adapters = active_adapters(self.model)
        return f"{self.model_id}+{','.join(adapters)}" if adapters else self.model_id

    def publish_factors(self, writer, model_hash: int) -> None:
        """The model's factors (adapters, dtype, quant, tokenizer, vocab, the user's) under `model_hash`:
        new records only where a value changed or the names ring overwrote it. Never raises."""
        try:
            self.factors.publish(writer, model_hash, active_adapters(self.model))
        except Exception as exc:
            publisher._count_error(exc)

    def prompt_texts(self, ids, attention_mask) -> list[str] | None:
        """intent=True: each row's prompt text, decoded by the tokenizer (the last user turn of a chat
        template where it has one). None when intent is off or llmobs.context gave the text."""
        if not self.intent or publisher._intent_text.get() is not None:
            return None
        try:
            from llmobs.publisher.intent import user_text

            rows = publisher.prompt_rows(ids, attention_mask)
            lists = [r.tolist() for r in rows]
            batch = getattr(self.tokenizer, "batch_decode", None)
            decoded = (batch(lists, skip_special_tokens=False) if batch is not None
                       else [self.tokenizer.decode(r, skip_special_tokens=False) for r in lists])  # fmt: skip
            return [user_text(t, getattr(self.tokenizer, "all_special_tokens", ())) for t in decoded]
        except Exception as exc:
            publisher._count_error(exc)
            return None

    def _charge(self, ns: int) -> None:
        self.cpu_ns += ns

    def _timed(self, fn):
        def timed(*args):
            t0 = time.thread_time_ns()
            try:
                return fn(*args)
            finally:
                self.cpu_ns += time.thread_time_ns() - t0

        return timed

    # --- generate --------------------------------------------------------------------------------
    def _wrap_generate(self, generate):
        @functools.wraps(generate)
        def wrapped(*args, **kwargs):
            gen = None
            t0 = time.thread_time_ns() if self._measure else 0
            try:
                ids = kwargs.get("input_ids", kwargs.get("inputs"))
                if ids is None and args:
                    ids = args[0]
                if ids is not None:
                    mask = kwargs.get("attention_mask")
                    req = publisher.Request(ids, model_id=self.request_model_id(), attention_mask=mask,
                                            intent_text=self.prompt_texts(ids, mask))  # fmt: skip
                    self.publish_factors(req.writer, req.model_hash)
                    gen = _Generation(req)
                    if req._recording is not None and self.recorder is not publisher.recorder:
                        publisher.recorder.discard(req._recording)  # the recorder replays another model
                        req._recording = None
            except Exception as exc:
                publisher._count_error(exc)
            if self._measure:
                self.cpu_ns += time.thread_time_ns() - t0
            token = _generating.set(gen)
            try:
                out = generate(*args, **kwargs)
            finally:
                _generating.reset(token)
            t0 = time.thread_time_ns() if self._measure else 0
            if gen is not None:
                try:
                    seqs = out if hasattr(out, "dim") else out.sequences
                    gen.finish(seqs[:, -1])
                    gen.req.end()
                except Exception as exc:
                    publisher._count_error(exc)
            if self._measure:
                self.cpu_ns += time.thread_time_ns() - t0
            return out

        return wrapped

    def _wrap_init_cb(self, init_cb):
        @functools.wraps(init_cb)
        def wrapped(*args, **kwargs):
            manager = init_cb(*args, **kwargs)
            try:
                from llmobs.publisher.hf_serving import instrument_manager

                adapter = instrument_manager(manager, model_id=self.request_model_id())
                self.publish_factors(adapter.publisher.writer, adapter.publisher.model_hash)
            except Exception as exc:  # the engine runs on uninstrumented
                publisher._count_error(exc)
            return manager

        return wrapped

    # --- hooks -----------------------------------------------------------------------------------
    def _pre(self, module, args, kwargs):
        if in_replay_thread():  # the flight recorder's replay: not a token step of the workload
            return None
        try:
            gen = _generating.get()
            if gen is not None:
                ids = _input_ids(args, kwargs)
                if gen.pending is not None and ids is not None:
                    gen.finish(ids[:, -1])  # this forward's input is the token the previous step chose
                seq = gen.req.begin_step(kv_len=_kv_len(kwargs))
                if self.layers is not None:
                    self.layers.begin(seq, gen.req._hi_list, gen.req._lo_list)
                return None
            req = publisher.active_request()
            if req is not None:
                if not req.in_step:
                    req.begin_step(kv_len=_kv_len(kwargs))
                if self.layers is not None:
                    self.layers.begin(req._step_seq, req._hi_list, req._lo_list)
                return None
            if self.labels and kwargs.get("labels") is not None:
                self._begin_labels(args, kwargs)
        except Exception as exc:
            publisher._count_error(exc)
        return None

    def _post(self, module, args, kwargs, output):
        if in_replay_thread():
            return None
        try:
            if self.layers is not None:
                self.layers.end(publisher.get_writer())
            gen = _generating.get()
            if self.recorder is not None:
                req = gen.req if gen is not None else publisher.active_request()
                if req is not None and req._recording is not None:
                    ids = _input_ids(args, kwargs)
                    req._recording.after_forward(output, kwargs, ids.shape[-1] if ids is not None else -1)
            if gen is not None:  # the target-free passes now, while the logits are hot in cache
                from llmobs.publisher.device_math import prepare

                gen.pending = prepare(output.logits[:, -1, :])
                return None
            state = self._labels_state.get()
            if state is not None:
                self._labels_state.set(None)
                self._publish_labels(state, output.logits)
        except Exception as exc:
            publisher._count_error(exc)
        return None

    # --- forward with labels ---------------------------------------------------------------------
    def _begin_labels(self, args, kwargs) -> None:
        ids = _input_ids(args, kwargs)
        labels = kwargs["labels"]
        host = publisher.prompt_rows(ids)  # the trace id of a row is the hash of its input_ids
        words = [trace_words(trace_id(r)) for r in host]
        w = publisher.get_writer()
        tenant_h = w.name(layout.NAME_TENANT, publisher._tenant.get())
        session_h = w.name(layout.NAME_SESSION, publisher._session.get())
        model_h = w.name(layout.NAME_MODEL, self.request_model_id())
        self.publish_factors(w, model_h)
        seqs = None
        tags = publisher._labels.get()
        if tags:  # under llmobs.context(variant=/labels=): each row a request of its own, with its labels
            seqs = [w.next_request_seq() for _ in host]
            for request_seq in seqs:
                request_labels.publish(w, request_seq, tags)
        t0 = time.monotonic_ns()
        seq = w.begin_step(words[0][0], words[0][1], tenant_h, session_h)
        if self.layers is not None:
            self.layers.begin(seq, [x[0] for x in words], [x[1] for x in words])
        self._shared_block.set(None)
        self._labels_state.set((seq, t0, ids, labels, words, tenant_h, session_h, model_h, seqs))

    def _publish_labels(self, state, logits) -> None:
        from llmobs.publisher.device_math import device_block

        seq, t0, ids, labels, words, tenant_h, session_h, model_h, seqs = state
        b, t, v = logits.shape
        if t < 2:
            return
        block = shared_loss.block_for(self._shared_block, logits)  # the model's loss computed it
        if block is not None:
            block = block.view(b, t, -1)[:, :-1].reshape(-1, block.shape[-1])  # each row's last: no target
        else:
            lg = logits.detach()[:, :-1].reshape(-1, v)  # training: the metrics stay out of autograd
            targets = labels[:, 1:].reshape(-1).to(lg.device)
            tokens = ids[:, 1:].reshape(-1).to(lg.device)
            block = device_block(lg, targets, tokens)
        n = b * (t - 1)
        hi = np.repeat(np.array([x[0] for x in words], dtype=np.uint64), t - 1)
        lo = np.repeat(np.array([x[1] for x in words], dtype=np.uint64), t - 1)
        steps = np.tile(np.arange(t - 1, dtype=np.int64), b)
        w = publisher.get_writer()
        w.publish_steps(
            block, step_seq=seq, t_start=t0, t_end=time.monotonic_ns(), trace_hi=hi, trace_lo=lo,
            tenant_hash=tenant_h, session_hash=session_h, model_hash=model_h, step=steps,
            position=steps + 1, batch_row=np.repeat(np.arange(b, dtype=np.int64), t - 1),
            kv_len=np.full(n, -1, np.int64), flags=layout.FLAG_TEACHER_FORCED | layout.FLAG_HAS_TARGET,
            tokens_in_pass=1,  # one record per target position: each is one token of the pass
            request_seq=np.repeat(np.asarray(seqs, np.int64), t - 1) if seqs else 0,
        )  # fmt: skip
        if seqs:  # a labelled pass's rows end with it: their REQUEST_END records carry the labels out
            t_end = time.monotonic_ns()
            for (hi_w, lo_w), request_seq in zip(words, seqs, strict=True):
                w.publish_request_event(
                    kind=layout.REQUEST_END, request_seq=request_seq, step_seq=seq, trace_hi=hi_w,
                    trace_lo=lo_w, tenant_hash=tenant_h, session_hash=session_h, model_hash=model_h,
                    t_start=t0, t_scheduled=t0, t_first_token=t_end, t_last_token=t_end, t_end=t_end,
                    prompt_tokens=t, prefill_tokens=t, decoded_tokens=t - 1,
                )  # fmt: skip
        w.clear_context()


def instrument(
    model,
    tokenizer=None,
    *,
    model_id: str | None = None,
    labels: bool = True,
    measure: bool = False,
    attention_entropy=None,
    mlp_variance=None,
    layer_streams=None,
    training=False,
    recorder=None,
    factors: dict | None = None,
    intent: bool = False,
) -> Instrumented:
    """Publish every token step of a Hugging Face causal LM (generate() and forward with labels).

    model_id defaults to the model's config name_or_path. `tokenizer` names the model when the config has
    no name, and gives the tokenizer and vocab factors and intent=True its prompt text. measure=True adds
    up the CPU time the hooks take in `.cpu_ns` (for benchmarks).
    attention_entropy=llmobs.AttentionEntropy(every=N, per_head=False) or an int N publishes each layer's
    attention entropy on every N-th forward pass (off
    by default: nothing is installed). mlp_variance=llmobs.MlpVariance(every=N) (or N) publishes each layer's
    MLP output variance likewise; layer_streams=llmobs.LayerStreams(every=N, attention=True, mlp=True,
    per_head=False) switches both on together. training=True (or llmobs.TrainingOptions) keeps the gradient of
    the loss w.r.t. the input embeddings of every training step in a device ring (llmobs.publisher.training).
    recorder=llmobs.Recorder(every=64, budget_mb=512, repeats=2) (or True) keeps each request's token ids
    and chunked KV snapshots so the agent can replay a token step (CMD_REPLAY, llmobs.publisher.recorder).
    Each request's model also gets its factors (llmobs.publisher.factors: adapters, dtype, quant,
    tokenizer, vocab); `factors={"quant": "int4-pc", ...}` adds or overrides them. intent=True (with a
    `tokenizer`) fingerprints each generate() row's decoded prompt (llmobs.publisher.intent; only ids and
    hashes are published; llmobs.context(intent_text=...) takes precedence). Idempotent per model."""
    existing = model.__dict__.get("_llmobs_instrumented")
    if existing is not None:
        return existing
    if model_id is None:
        config = getattr(model, "config", None)
        model_id = getattr(config, "_name_or_path", "") or getattr(tokenizer, "name_or_path", "") or ""
        model_id = model_id or type(model).__name__
    from llmobs.shm.otel_ctx import publish_process_context
    from llmobs.shm.writer import get_writer

    get_writer().set_model(model_id)  # the map exists from now on: an agent can attach before any token
    from llmobs.publisher.recorder import as_recorder

    inst = Instrumented(model, model_id, labels, measure, attention_entropy, mlp_variance, layer_streams,
                        training, as_recorder(recorder), tokenizer, factors, intent)  # fmt: skip
    publish_process_context(model_id=model_id)
    from llmobs.cupti import install as install_cupti

    install_cupti()  # where torch sees a GPU: the CUPTI collector, idle until `llmobs-agent trace` asks
    return inst
