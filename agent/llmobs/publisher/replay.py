"""Deterministic replay of a window of one request's token steps: a pure function over a model (no map).

    result = replay_window(model, tokens, first_pos, last_pos, snapshot=KvSnapshot(...), repeats=2)
    np.savez(path, **result.to_arrays())               # the flight recorder writes the file
    result = ReplayResult.from_arrays(np.load(path))   # (the agent reads it: diagnostics/replay.py)

"Replaying position p" is a forward pass whose newest position is p, scoring tokens[p + 1] (a request's
token step i publishes tokens[P + i], P = prompt length, from the pass whose newest position is P + i - 1).

Per repeat: a fresh cache is built from the snapshot (its tensors are never written), one prefill pass
covers positions [snapshot.length, first_pos) without capture, then one forward pass per position p in
[first_pos, last_pos], one new token each like live decoding, with capture. The outputs come from the
model's own attention implementation (SDPA by default, so the numerics are the live path's); the
attention probabilities for the entropy are computed on the side from the same query, keys and mask.

Concurrency: the live workload may run forward passes on the same model on another thread meanwhile.
Everything installed here (replay_capture.py) acts on the replay's thread only and is removed in
`finally`:
- the attention wrapper is put in transformers' AttentionInterface under the model's implementation
  name and calls the original untouched for every other thread;
- the MLP and decoder-layer forward hooks return at once on other threads;
- the operator recorder (TorchDispatchMode) lives on a mode stack that is thread-local in PyTorch, and
  inference_mode (which the passes run under) is thread-local too.
The live publisher's own hooks skip the replay's passes: replay_window marks its thread
(replay_thread.replaying) and `in_replay_thread()` (re-exported here) says so to hf.py, the layer
samplers and the serving adapter.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import numpy as np

from llmobs.publisher.replay_capture import Capture
from llmobs.publisher.replay_thread import in_replay_thread, replaying

__all__ = ["ARRAY_DTYPES", "ARRAY_KEYS", "KvSnapshot", "ReplayResult", "in_replay_thread", "replay_window"]

FORMAT = "llmobs-replay/1"
STATUS_OK = "ok"
STATUS_PROMPT_GONE = "prompt_gone"
STATUS_FAILED = "failed"
SOURCE_SNAPSHOT = "snapshot"
SOURCE_PROMPT = "prompt"
TOP_K = 5

# The .npz keys and their dtypes (r = repeats, n = replayed passes, L = layers, H = attention heads).
ARRAY_DTYPES = {
    "positions": np.int64,  # [n]
    "step_index": np.int32,  # [n] (the recorder fills it; -1 unknown)
    "step_seq": np.int64,  # [n] (the recorder fills it; -1 unknown)
    "loss": np.float32,  # [r, n]
    "entropy": np.float32,  # [r, n]
    "top5_ids": np.int64,  # [r, n, 5]
    "top5_probs": np.float32,  # [r, n, 5]
    "attn_entropy": np.float32,  # [r, n, L, H] (NaN where unavailable)
    "mlp_var": np.float32,  # [r, n, L]
    "fingerprint": np.uint64,  # [r, n, L]
    "layer_maxdiff": np.float32,  # [n, L] (repeat 0 vs repeat 1; NaN with one repeat)
    "op_hash": np.uint64,  # [r, n]
    "graph_hash": np.uint64,  # [r, n]
    "linear_calls": np.int32,  # [r, n]
}
ARRAY_KEYS = ("meta", *ARRAY_DTYPES, "ops")


@dataclass(frozen=True)
class KvSnapshot:
    """One request's keys/values of positions [0, length): per layer (keys, values), each
    [1, kv_heads, length, head_dim] on the model's device. replay_window never writes into them."""

    length: int
    layers: list = field(default_factory=list)


@dataclass
class ReplayResult:
    """What a replay measured; `to_arrays()` is the .npz contract (see ARRAY_DTYPES and `meta`).

    meta (JSON in the file): format, status ("ok" | "prompt_gone" | "failed"), reason, source
    ("snapshot" | "prompt"), snapshot_len, snapshot_dropped, model, layers, heads, repeats, wall_ms,
    prefill_ms, t_start_ns, t_end_ns (CLOCK_MONOTONIC), attn_implementations (what the passes ran);
    the recorder adds pid, trace_id, target_step_seq, target_batch_row, target_index, window,
    live_batch_size, recorder, cupti (llmobs.cupti.replay_activity's per-pass summary, or why not)."""

    meta: dict
    positions: np.ndarray
    step_index: np.ndarray
    step_seq: np.ndarray
    loss: np.ndarray
    entropy: np.ndarray
    top5_ids: np.ndarray
    top5_probs: np.ndarray
    attn_entropy: np.ndarray
    mlp_var: np.ndarray
    fingerprint: np.ndarray
    layer_maxdiff: np.ndarray
    op_hash: np.ndarray
    graph_hash: np.ndarray
    linear_calls: np.ndarray
    ops: list[str]

    @property
    def status(self) -> str:
        return self.meta.get("status", STATUS_FAILED)

    @classmethod
    def empty(cls, status: str, reason: str, repeats: int = 0, layers: int = 0, heads: int = 0, **meta):
        """A result with no replayed pass (status "failed" or "prompt_gone" and why), same keys."""
        r, n, L, H = repeats, 0, layers, heads
        full = {
            "format": FORMAT, "status": status, "reason": reason, "source": meta.pop("source", SOURCE_PROMPT),
            "snapshot_len": 0, "snapshot_dropped": False, "model": "", "layers": L, "heads": H, "repeats": r,
            "wall_ms": 0.0, "prefill_ms": 0.0, "t_start_ns": 0, "t_end_ns": 0, "attn_implementations": [],
        }  # fmt: skip
        full.update(meta)
        return cls(meta=full, ops=[], **_blank_arrays(r, n, L, H))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The .npz contents: `meta` a 0-d str array of JSON, every array with its contract dtype,
        `ops` a 1-D str array (np.load reads it back without allow_pickle)."""
        out = {"meta": np.array(json.dumps(self.meta, sort_keys=True))}
        for key, dtype in ARRAY_DTYPES.items():
            out[key] = np.ascontiguousarray(getattr(self, key), dtype=dtype)
        out["ops"] = np.array(list(self.ops), dtype=str) if self.ops else np.zeros(0, dtype="<U1")
        return out

    @classmethod
    def from_arrays(cls, arrays) -> ReplayResult:
        """Back from to_arrays() or an np.load(...) of the file (any mapping of those keys)."""
        meta = json.loads(str(np.asarray(arrays["meta"])[()]))
        fields = {key: np.asarray(arrays[key], dtype=dtype) for key, dtype in ARRAY_DTYPES.items()}
        return cls(meta=meta, ops=[str(op) for op in np.asarray(arrays["ops"]).tolist()], **fields)


def _blank_arrays(r: int, n: int, L: int, H: int) -> dict[str, np.ndarray]:
    return {
        "positions": np.zeros(n, np.int64),
        "step_index": np.full(n, -1, np.int32),
        "step_seq": np.full(n, -1, np.int64),
        "loss": np.full((r, n), np.nan, np.float32),
        "entropy": np.full((r, n), np.nan, np.float32),
        "top5_ids": np.full((r, n, TOP_K), -1, np.int64),
        "top5_probs": np.full((r, n, TOP_K), np.nan, np.float32),
        "attn_entropy": np.full((r, n, L, H), np.nan, np.float32),
        "mlp_var": np.full((r, n, L), np.nan, np.float32),
        "fingerprint": np.zeros((r, n, L), np.uint64),
        "layer_maxdiff": np.full((n, L), np.nan, np.float32),
        "op_hash": np.zeros((r, n), np.uint64),
        "graph_hash": np.zeros((r, n), np.uint64),
        "linear_calls": np.zeros((r, n), np.int32),
    }


# One replay at a time per process: the AttentionInterface entry it installs is process-wide (the
# entry itself dispatches on the thread, so the live threads are untouched by it).
_lock = threading.Lock()


def replay_window(model, tokens, first_pos: int, last_pos: int, snapshot: KvSnapshot | None = None,
                  repeats: int = 2, activity=None, pace=None) -> ReplayResult:  # fmt: skip
    """Replay positions [first_pos, last_pos] of one request `repeats` times; see the module docstring.

    tokens: 1-D LongTensor (or int sequence) of the whole known sequence (no padding); snapshot: the
    keys/values of positions [0, snapshot.length) with length <= first_pos, or None (from position 0).
    The loss at p is NaN when tokens[p + 1] is not known. Bad arguments raise ValueError (the caller,
    recorder.py's replay thread, turns any exception into a "failed" result file). `prefill_ms` in the
    meta is the prefill time of all repeats together (wall_ms - prefill_ms: the replayed passes).
    activity: a started ReplayActivity (llmobs.cupti.replay_activity) or None; replayed pass k of repeat
    rep is bracketed as pass rep * n + k (n passes a repeat), the capture's own ops left outside.
    pace: None or a callable given the seconds each prefill and each pass took, after it (the recorder
    waits there to keep within its replay_share); its waits are not in prefill_ms."""
    import torch

    ids = _token_ids(tokens)
    _check_window(ids, first_pos, last_pos, snapshot, repeats)
    with _lock:
        capture = Capture(model)
        capture.activity = activity
        if snapshot is not None and snapshot.length and len(snapshot.layers) != capture.n_layers:
            raise ValueError(f"replay_window: the snapshot has {len(snapshot.layers)} layers, the model "
                             f"{capture.n_layers}")  # fmt: skip
        stream = _side_stream(model)
        try:
            capture.install()
            with replaying(), torch.inference_mode(), _stream_context(stream):
                return _replay(model, ids, first_pos, last_pos, snapshot, repeats, capture, pace)
        finally:
            capture.remove()
            if stream is not None:
                stream.synchronize()


def _token_ids(tokens):
    import torch

    ids = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    if ids.dim() != 1:
        raise ValueError(f"replay_window: tokens must be 1-D (one request, no padding): {tuple(ids.shape)}")
    return ids.long()


def _check_window(ids, first_pos: int, last_pos: int, snapshot: KvSnapshot | None, repeats: int) -> None:
    n = int(ids.shape[0])
    if not 0 <= first_pos <= last_pos < n:
        raise ValueError(f"replay_window: need 0 <= first_pos {first_pos} <= last_pos {last_pos} < {n}")
    if repeats < 1:
        raise ValueError(f"replay_window: repeats must be >= 1, got {repeats}")
    if snapshot is not None:
        if not 0 <= snapshot.length <= first_pos:
            raise ValueError(f"replay_window: snapshot length {snapshot.length} > first_pos {first_pos}")
        for k, v in snapshot.layers:
            if k.shape[-2] != snapshot.length or v.shape[-2] != snapshot.length:
                raise ValueError(
                    f"replay_window: a snapshot layer holds {k.shape[-2]} positions, not {snapshot.length}"
                )


def _side_stream(model):
    """On CUDA the replay runs on a stream of its own (the current stream is per thread), so the live
    thread's default stream never waits behind it; it first waits for what was queued before it (the
    snapshot copies)."""
    import torch

    device = _model_device(model)
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _stream_context(stream):
    import contextlib

    import torch

    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _model_device(model):
    import torch

    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _forward_params(model) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _cache_keyword(params: set[str]) -> str:
    """transformers 5.24 names the cache argument `cache` (`past_key_values` deprecated until 5.40); older
    and other models take `past_key_values`."""
    return "cache" if "cache" in params else "past_key_values"


def _fresh_cache(model, snapshot: KvSnapshot | None):
    """A new DynamicCache holding a copy of the snapshot (its update() concatenates into new tensors, so
    the snapshot's own tensors are only read)."""
    from transformers import DynamicCache

    if snapshot is None or snapshot.length == 0:
        return DynamicCache(config=model.config)
    return DynamicCache(ddp_cache_data=[(k, v) for k, v in snapshot.layers], config=model.config)


def _forward(model, cache_kw: str, ids, cache, keep_one: bool):
    kwargs = {"input_ids": ids.view(1, -1), cache_kw: cache, "use_cache": True}
    if keep_one:
        kwargs["logits_to_keep"] = 1  # the prefill needs no logits (a vocabulary-wide lm_head per position)
    return model(**kwargs)


def _replay(model, ids, first_pos, last_pos, snapshot, repeats, capture, pace=None) -> ReplayResult:
    import time

    import torch

    from llmobs.publisher.device_math import prepare

    t_start = time.monotonic_ns()
    device = _model_device(model)
    ids = ids.to(device)
    params = _forward_params(model)
    cache_kw = _cache_keyword(params)
    keep_one = "logits_to_keep" in params
    positions = np.arange(first_pos, last_pos + 1, dtype=np.int64)
    r, n, L, H = repeats, len(positions), capture.n_layers, capture.heads
    arrays = _blank_arrays(r, n, L, H)
    arrays["positions"] = positions
    ops_text: list[str] = []
    outputs = [[None] * n for _ in range(min(r, 2))]  # layer outputs [L, numel] of repeats 0 and 1, host
    length = 0 if snapshot is None else snapshot.length
    prefill_ns = 0
    for rep in range(r):
        cache = _fresh_cache(model, snapshot)
        if first_pos > length:
            t0 = time.monotonic_ns()
            _forward(model, cache_kw, ids[length:first_pos], cache, keep_one)
            _sync(device)
            prefill_ns += time.monotonic_ns() - t0
            if pace is not None:
                pace((time.monotonic_ns() - t0) / 1e9)
        for j, p in enumerate(positions.tolist()):
            t_pass = time.monotonic_ns()
            capture.begin_pass()
            activity = capture.activity
            if activity is not None:
                activity.pass_begin(rep * n + j)
            try:
                with capture.ops:
                    out = _forward(model, cache_kw, ids[p : p + 1], cache, False)
            finally:
                capture.on = False
                if activity is not None:
                    activity.pass_end()
            # the recorder is off the stack here (it is entered around the forward only)
            prepared = prepare(out.logits[:, -1])  # Request.step's definitions (device_math)
            lp = prepared.lp[0]
            loss = -lp[ids[p + 1]] if p + 1 < len(ids) else torch.full((), float("nan"), device=device)
            entropy = -prepared.neg_entropy[0, 0]
            top = lp.topk(TOP_K)
            head = torch.stack([loss.float(), entropy.float()]).cpu().numpy()
            arrays["loss"][rep, j], arrays["entropy"][rep, j] = head
            arrays["top5_ids"][rep, j] = top.indices.cpu().numpy()
            arrays["top5_probs"][rep, j] = top.values.exp().cpu().numpy()
            attn, mlp, layer_bytes, layer_float = capture.end_pass()
            arrays["attn_entropy"][rep, j] = attn
            arrays["mlp_var"][rep, j] = mlp
            arrays["fingerprint"][rep, j] = [_fingerprint(row) for row in layer_bytes]
            if rep < 2:
                outputs[rep][j] = layer_float
            op_text, graph_text, linear = capture.take_ops()
            arrays["op_hash"][rep, j] = _hash64("\n".join(op_text).encode())
            arrays["graph_hash"][rep, j] = _hash64("\n".join(graph_text).encode())
            arrays["linear_calls"][rep, j] = linear
            if rep == 0 and j == 0:
                ops_text = op_text
            if pace is not None:
                pace((time.monotonic_ns() - t_pass) / 1e9)
        del cache
    if r >= 2:
        for j in range(n):
            a, b = outputs[0][j], outputs[1][j]
            arrays["layer_maxdiff"][j] = np.abs(a.astype(np.float64) - b.astype(np.float64)).max(axis=1)
    t_end = time.monotonic_ns()
    meta = {
        "format": FORMAT, "status": STATUS_OK, "reason": "",
        "source": SOURCE_SNAPSHOT if length else SOURCE_PROMPT,
        "snapshot_len": length, "snapshot_dropped": False, "model": _model_name(model), "layers": L,
        "heads": H, "repeats": r, "wall_ms": (t_end - t_start) / 1e6, "prefill_ms": prefill_ns / 1e6,
        "t_start_ns": t_start, "t_end_ns": t_end, "attn_implementations": sorted(capture.impls),
    }  # fmt: skip
    return ReplayResult(meta=meta, ops=ops_text, **arrays)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _model_name(model) -> str:
    config = getattr(model, "config", None)
    name = getattr(config, "name_or_path", "") or getattr(config, "model_type", "")
    return str(name or type(model).__name__)


def _hash64(data: bytes) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _fingerprint(raw: np.ndarray) -> int:
    """Exact: blake2b-64 of the output's bytes, so any bit that changes changes it."""
    return _hash64(raw.tobytes())
