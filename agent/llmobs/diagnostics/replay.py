"""The verdict of a flight-recorder replay (issue 17), from its result file and the recorded token steps.

Pure: numpy over the result's arrays (the file `publisher/replay.py`'s ReplayResult.to_arrays writes,
docs/replay.md) and a `Recorded` the store side fills in (llmobs.pipeline.replay_ingest). No torch.

Verdicts, in the order they are decided:
- failed: the workload could not replay (status != "ok": the prompt is gone, the replay raised).
- graph_changed: the replay ran another operator graph than before: its graph_hash differs from the
  earlier replays of the same model in the store, or its F.linear calls per pass differ from the live
  `linear` probe's exact hits on the target's forward pass.
- drift: the repeats of the replay differ (nondeterminism: the first diverging layer is the first layer
  whose output fingerprint differs, in the first pass that differs), or they agree with each other but
  the target's replayed loss is more than LOSS_TOLERANCE from the recorded one (the cause: a live pass
  batched with other requests, `live_batch_size` > 1, runs other floating-point reductions than the
  replay of the request alone).
- reproduced: repeats bit-identical and the target's loss within LOSS_TOLERANCE of the recorded one.

Root cause from the replay's full per-head streams (`replay_root_cause`): the target pass's robust z of
every (layer, head) attention entropy and every layer's MLP output variance against the window's other
passes. Among the streams within UPSTREAM_SHARE of the largest |z| (at least MIN_Z), the earliest layer
whose MLP output variance is one of them names the cause (else the earliest layer of any of them): a
fault propagates downstream, and single heads deviate by chance. llmobs.diagnostics.rootcause uses it
when the store holds a replay of the step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

FORMAT = "llmobs-replay/1"
LOSS_TOLERANCE = 1e-4  # nats: a reproduced token's replayed loss is within this of the recorded one
MAD_TO_Z = 0.6745
# Fewer passes beside the target: no root cause from the replay (a median and MAD of 4 values name a
# "deviating" stream among a model's hundreds on almost any token). The default window (8 either side)
# gives 16; `--window 4` the least that is enough.
MIN_OTHER_PASSES = 8
MIN_MAD_REL = 1e-3  # the MAD floor, relative to |median| (a flat stream must not give an infinite z)
MIN_Z = 3.5  # below this no stream of the replay is unusual enough to name
UPSTREAM_SHARE = 0.5  # streams within this share of the largest |z| compete on layer order
KIND_ATTENTION_ENTROPY = 1  # the layer_streams kinds (shm layout LLMOBS_LAYER_*)
KIND_MLP_VARIANCE = 2

# key -> (dtype, rank); r repeats, n passes, L layers, H heads (docs/replay.md, "the result file")
ARRAY_SPEC: dict[str, tuple[str, int]] = {
    "positions": ("int64", 1), "step_index": ("int32", 1), "step_seq": ("int64", 1),
    "loss": ("float32", 2), "entropy": ("float32", 2), "top5_ids": ("int64", 3), "top5_probs": ("float32", 3),
    "attn_entropy": ("float32", 4), "mlp_var": ("float32", 3), "fingerprint": ("uint64", 3),
    "layer_maxdiff": ("float32", 2), "op_hash": ("uint64", 2), "graph_hash": ("uint64", 2),
    "linear_calls": ("int32", 2),
}  # fmt: skip


class BadResult(ValueError):
    """The file is not a replay result this agent can read (its message says what is wrong)."""


@dataclass(frozen=True)
class ReplayFile:
    """A replay result: the meta JSON and the arrays, checked against the contract."""

    meta: dict
    arrays: dict[str, np.ndarray]
    ops: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.meta.get("status") == "ok"

    @property
    def repeats(self) -> int:
        return int(self.arrays["loss"].shape[0]) if "loss" in self.arrays else 0

    @property
    def passes(self) -> int:
        return int(self.arrays["positions"].shape[0]) if "positions" in self.arrays else 0

    def target_pass(self) -> int | None:
        """Which replayed pass is the target token step: the one whose step_seq is the meta's
        target_step_seq, else whose token step index is its target_index; None when neither is there."""
        if not self.passes:
            return None
        for key, column in (("target_step_seq", "step_seq"), ("target_index", "step_index")):
            value = self.meta.get(key)
            if value is None:
                continue
            hits = np.flatnonzero(self.arrays[column] == int(value))
            if len(hits):
                return int(hits[0])
        return None


def from_arrays(data) -> ReplayFile:
    """A ReplayFile from the .npz's mapping (np.load's result or a dict); BadResult names what is wrong."""
    if "meta" not in data:
        raise BadResult("no `meta` entry")
    try:
        meta = json.loads(str(np.asarray(data["meta"])[()]))
    except ValueError as exc:
        raise BadResult(f"`meta` is not JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise BadResult(f"format {meta.get('format') if isinstance(meta, dict) else None!r}, not {FORMAT!r}")
    if meta.get("status") != "ok":
        return ReplayFile(meta, {})
    arrays = {}
    for key, (dtype, rank) in ARRAY_SPEC.items():
        if key not in data:
            raise BadResult(f"no `{key}` array")
        value = np.asarray(data[key])
        if value.ndim != rank or value.dtype != np.dtype(dtype):
            raise BadResult(f"`{key}` is {value.dtype}{list(value.shape)}, not {dtype} of rank {rank}")
        arrays[key] = value
    r, n = arrays["loss"].shape
    layers = arrays["fingerprint"].shape[2]
    expected = {
        "positions": (n,), "step_index": (n,), "step_seq": (n,), "entropy": (r, n), "top5_ids": (r, n, 5),
        "top5_probs": (r, n, 5), "mlp_var": (r, n, layers), "fingerprint": (r, n, layers),
        "layer_maxdiff": (n, layers), "op_hash": (r, n), "graph_hash": (r, n), "linear_calls": (r, n),
    }  # fmt: skip
    for key, shape in expected.items():
        if arrays[key].shape != shape:
            raise BadResult(f"`{key}` has shape {list(arrays[key].shape)}, not {list(shape)}")
    if arrays["attn_entropy"].shape[:3] != (r, n, layers):
        raise BadResult(f"`attn_entropy` has shape {list(arrays['attn_entropy'].shape)}")
    ops = tuple(str(op) for op in np.asarray(data["ops"]).tolist()) if "ops" in data else ()
    return ReplayFile(meta, arrays, ops)


@dataclass(frozen=True)
class Recorded:
    """What the store recorded about the replayed steps."""

    losses: dict[int, float]  # token step index -> its recorded loss
    live_linear_calls: int | None = None  # the live `linear` probe's exact hits on the target's pass
    earlier_graph_hashes: tuple[int, ...] = ()  # of earlier ok replays of the same model


@dataclass(frozen=True)
class ReplayRootCause:
    kind: int
    layer: int
    head: int  # -1: a layer-wide stream (MLP output variance)
    z: float
    value: float
    median: float
    mad: float
    others: int  # passes of the window it was compared with
    runners_up: tuple[tuple[int, int, int, float], ...] = ()  # (kind, layer, head, z)


@dataclass
class Verdict:
    verdict: str  # reproduced | drift | graph_changed | failed
    detail: str
    target_pass: int | None = None
    first_diverging_layer: int | None = None
    diverging_pass: int | None = None
    cause: str | None = None  # nondeterminism | batch_composition | numerics | graph | linear_calls
    recorded_loss: float | None = None
    replay_loss: float | None = None
    loss_diff: float | None = None
    op_hash: int | None = None
    graph_hash: int | None = None
    linear_calls: int | None = None
    findings: list[str] = field(default_factory=list)
    root: ReplayRootCause | None = None


def repeats_divergence(fingerprint: np.ndarray, loss: np.ndarray) -> tuple[int | None, int | None]:
    """(first pass, first layer) where a repeat's layer output differs from repeat 0's; (pass, None)
    when only the loss differs (after the last decoder layer: the final norm or the head); (None, None)
    when the repeats are identical."""
    if fingerprint.shape[0] < 2:
        return None, None
    layer_differs = (fingerprint[1:] != fingerprint[0]).any(axis=0)  # [n, L]
    loss_differs = (loss[1:].view(np.uint32) != loss[0].view(np.uint32)).any(axis=0)  # bitwise: NaN too
    passes = np.flatnonzero(layer_differs.any(axis=1) | loss_differs)
    if not len(passes):
        return None, None
    first = int(passes[0])
    layers = np.flatnonzero(layer_differs[first])
    return first, (int(layers[0]) if len(layers) else None)


def decide(result: ReplayFile, recorded: Recorded) -> Verdict:
    """The verdict of one replay (the module docstring has the rules)."""
    meta = result.meta
    if not result.ok:
        status = meta.get("status")
        why = meta.get("reason") or status
        return Verdict("failed", f"the workload could not replay the step ({status}: {why})")
    a = result.arrays
    t = result.target_pass()
    if t is None:
        return Verdict("failed", "the result holds no pass of the target token step")
    v = Verdict("reproduced", "", target_pass=t)
    v.op_hash, v.graph_hash = int(a["op_hash"][0, t]), int(a["graph_hash"][0, t])
    v.linear_calls = int(a["linear_calls"][0, t])
    v.replay_loss = float(a["loss"][0, t])
    step = int(a["step_index"][t])
    recorded_loss = recorded.losses.get(step)
    if recorded_loss is not None and np.isfinite(recorded_loss):
        v.recorded_loss = float(recorded_loss)
        v.loss_diff = abs(v.replay_loss - v.recorded_loss)
    graph = _graph_findings(a, recorded, v)
    v.diverging_pass, v.first_diverging_layer = repeats_divergence(a["fingerprint"], a["loss"])
    drift = []
    if v.diverging_pass is not None:
        drift.append(_nondeterminism(result, v))
        v.cause = "nondeterminism"
    elif v.loss_diff is not None and not v.loss_diff <= LOSS_TOLERANCE:
        batch = int(meta.get("live_batch_size") or 1)
        off = (
            f"repeats identical, but the replayed loss {v.replay_loss:.6f} is {v.loss_diff:.2e} from the"
            f" recorded {v.recorded_loss:.6f}"
        )
        if batch > 1:
            v.cause = "batch_composition"
            drift.append(
                f"{off}: the live pass ran in a batch of {batch} and the replay runs the request alone;"
                " batch composition changes floating-point results"
            )
        else:
            v.cause = "numerics"
            drift.append(
                f"{off} at batch size 1: the live pass computed it differently (another kernel, dtype or"
                " model state than the replay's)"
            )
    if graph:
        v.verdict, v.cause = "graph_changed", v.cause or graph[0][0]
    elif drift:
        v.verdict = "drift"
    v.findings = [text for _, text in graph] + drift
    if v.verdict == "reproduced":
        if v.loss_diff is not None:
            loss = (
                f"replayed loss {v.replay_loss:.6f} vs recorded {v.recorded_loss:.6f}"
                f" (|diff| {v.loss_diff:.1e} <= {LOSS_TOLERANCE:g})"
            )
        else:
            loss = f"replayed loss {v.replay_loss:.6f} (no recorded loss to compare)"
        v.findings.insert(0, f"{loss}; the {result.repeats} repeats are bit-identical")
    v.detail = "; ".join(v.findings)
    v.root = replay_root_cause(a, t)
    return v


def _nondeterminism(result: ReplayFile, v: Verdict) -> str:
    a = result.arrays
    where = (
        f"layer {v.first_diverging_layer}"
        if v.first_diverging_layer is not None
        else "after the last layer (final norm or head)"
    )
    position = int(a["positions"][v.diverging_pass])
    return (
        f"the {result.repeats} repeats differ: first at position {position}, {where}"
        f" (max |diff| {_maxdiff(a, v)}): the forward pass is not deterministic"
    )


def _maxdiff(a: dict, v: Verdict) -> str:
    if v.first_diverging_layer is None:
        return "n/a"
    return f"{float(a['layer_maxdiff'][v.diverging_pass, v.first_diverging_layer]):.3g}"


def _graph_findings(a: dict, recorded: Recorded, v: Verdict) -> list[tuple[str, str]]:
    out = []
    earlier = {int(h) for h in recorded.earlier_graph_hashes}
    if earlier and v.graph_hash not in earlier:
        shown = ", ".join(f"{h:016x}" for h in sorted(earlier)[:3])
        out.append(("graph", f"op graph {v.graph_hash:016x} differs from the earlier replays of this model "
                             f"({shown}): the model runs other operators than before"))  # fmt: skip
    live = recorded.live_linear_calls
    if live is not None and live != v.linear_calls:
        out.append(("linear_calls", f"{v.linear_calls} F.linear calls in the replayed pass, {live} live (the "
                                    "`linear` probe's exact count on the target's pass)"))  # fmt: skip
    return out


def _robust_z(x: float, others: np.ndarray) -> tuple[float, float, float]:
    median = float(np.median(others))
    mad = float(np.median(np.abs(others - median)))
    floor = max(mad, MIN_MAD_REL * abs(median), 1e-12)
    return MAD_TO_Z * (x - median) / floor, median, mad


Stream = tuple[float, int, int, int, float, float, float]  # z, kind, layer, head, value, median, MAD


def stream_zs(arrays: dict, target: int, repeat: int = 0) -> list[Stream]:
    """(z, kind, layer, head, value, median, MAD) of every stream of the target pass that has a finite
    value and at least MIN_OTHER_PASSES finite values on the window's other passes."""
    attn = np.asarray(arrays["attn_entropy"][repeat], np.float64)  # [n, L, H]
    mlp = np.asarray(arrays["mlp_var"][repeat], np.float64)  # [n, L]
    n = attn.shape[0]
    others = np.arange(n) != target
    streams = [(KIND_ATTENTION_ENTROPY, layer, head, attn[:, layer, head])
               for layer in range(attn.shape[1]) for head in range(attn.shape[2])]  # fmt: skip
    streams += [(KIND_MLP_VARIANCE, layer, -1, mlp[:, layer]) for layer in range(mlp.shape[1])]
    out = []
    for kind, layer, head, series in streams:
        x, rest = series[target], series[others]
        rest = rest[np.isfinite(rest)]
        if not np.isfinite(x) or len(rest) < MIN_OTHER_PASSES:
            continue
        z, median, mad = _robust_z(float(x), rest)
        out.append((z, kind, layer, head, float(x), median, mad))
    return out


def replay_root_cause(arrays: dict, target: int, repeat: int = 0) -> ReplayRootCause | None:
    """The stream (kind, layer, head) of the target pass that names the cause (the module docstring's
    rule: robust z against the window's other passes, |z| >= MIN_Z), or None: too few passes, or
    nothing deviates. The runners-up follow by |z|."""
    scored = sorted(stream_zs(arrays, target, repeat), key=lambda s: -abs(s[0]))
    if not scored or abs(scored[0][0]) < MIN_Z:
        return None
    # A fault propagates downstream, and a later layer's stream often deviates more than the faulty
    # layer's own once the residual stream has grown; single heads deviate by chance too (a head's
    # entropy can jump on one token). A layer's MLP output variance sums the whole layer, so the layer
    # named is the earliest whose MLP variance is among the streams within UPSTREAM_SHARE of the largest
    # |z| (else the earliest layer among them of any kind), and its strongest stream is reported.
    floor = max(MIN_Z, UPSTREAM_SHARE * abs(scored[0][0]))
    near = [s for s in scored if abs(s[0]) >= floor]
    layers = [s[2] for s in near if s[1] == KIND_MLP_VARIANCE] or [s[2] for s in near]
    first = min(layers)
    named = next(s for s in scored if s[2] == first)  # scored is by |z|: the layer's strongest stream
    scored.remove(named)
    scored.insert(0, named)
    z, kind, layer, head, value, median, mad = scored[0]
    others = int(np.isfinite(np.asarray(arrays["loss"][repeat])).sum()) - 1
    runners = tuple((s[1], s[2], s[3], float(s[0])) for s in scored[1:4] if abs(s[0]) >= MIN_Z)
    return ReplayRootCause(kind, layer, head, float(z), value, median, mad, others, runners)
