"""A/B comparison of two sets of requests (`llmobs-agent compare`): selectors, pairing, paired bootstrap.

Two selectors (docs/compare.md) each pick requests of a store. Requests are paired one to one: a shadow
request with its primary (its `shadow_of` label), else by prompt (the prompt-hash trace id, or
request_events.prompt_hash when the trace id came from a caller), else (`by_intent`) by intent. Within
a pair, tokens pair on (step, position) with the same target token: then per-token loss compares the
same tokens. Every metric is computed in DuckDB down to per-pair sums and counts; the interval is a
cluster bootstrap over request *pairs* (tokens of a request are correlated: resampling tokens would
give intervals too narrow), run as one multinomial weight matrix (resamples x pairs) times those
per-pair columns, so 1 M paired token steps cost one SQL pass and a few matrix products.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path

import duckdb
import numpy as np

from llmobs.errors import NoMatch, NoPairs, StoreError, UsageError

SELECTOR_KINDS = ("variant", "model", "label", "time", "store")
SELECTOR_HINT = "SEL: variant:NAME | model:ID | label:KEY=VALUE | time:START..END | store:PATH, joined by ','"
COMPARE_VERSION = 13  # request_labels, token_steps.shadow (store migration 13)


def request_key(t: str = "") -> str:
    """llmobs.store.views.REQUEST_KEY over the columns of table alias `t` ("t." or ""): a generate()
    request is its first pass (step_seq - step), one with a request_seq that number, negated."""
    return (
        f"CASE WHEN coalesce({t}request_seq, 0) <> 0 THEN -{t}request_seq"
        f" ELSE {t}step_seq - coalesce({t}step, 0) END"
    )


KEY = request_key()


# ---- selectors --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selector:
    text: str
    store: str | None = None
    variant: str | None = None
    model: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    time: tuple[str, str] | None = None


def parse_selector(text: str) -> Selector:
    """`variant:q4,label:template=v3` -> Selector; a malformed one is a UsageError naming the part."""
    fields: dict = {"labels": []}
    for part in [p.strip() for p in text.split(",")]:
        kind, sep, value = part.partition(":")
        if not sep or kind not in SELECTOR_KINDS or not value:
            raise UsageError(f"selector {text!r}: {part!r} is not KIND:VALUE", hint=SELECTOR_HINT)
        if kind == "label":
            key, eq, label_value = value.partition("=")
            if not eq or not key:
                raise UsageError(
                    f"selector {text!r}: label needs KEY=VALUE, not {value!r}", hint=SELECTOR_HINT
                )
            fields["labels"].append((key, label_value))
            continue
        if kind == "time":
            start, dots, end = value.partition("..")
            if not dots:
                raise UsageError(
                    f"selector {text!r}: time needs START..END, not {value!r}",
                    hint="e.g. time:-30m..-10m, time:2026-12-01T10:00.., time:-5m..",
                )
            value = (start.strip(), end.strip())
        if kind in fields:
            raise UsageError(f"selector {text!r} names {kind} twice", hint=SELECTOR_HINT)
        fields[kind] = value
    fields["labels"] = tuple(fields["labels"])
    return Selector(text=text, **fields)


_RELATIVE = re.compile(r"^-(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_NS = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": 86400 * 10**9}


def _time_bound(conn, catalog: str, text: str, newest_ns: int) -> int | None:
    """A time selector bound as the store's CLOCK_MONOTONIC ns: '' open, -10m relative to the store's
    newest request end (the store's own 'now': it may be read long after), an integer as monotonic ns,
    else an ISO time converted with the store's recorded realtime offset (clock_fits)."""
    from datetime import datetime

    if not text:
        return None
    match = _RELATIVE.match(text)
    if match:
        return newest_ns - int(float(match.group(1)) * _UNIT_NS[match.group(2)])
    if re.fullmatch(r"\d+", text):
        return int(text)
    try:
        wall = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"time bound {text!r} is not -N(ms|s|m|h|d), ISO or monotonic ns",
            hint="e.g. time:-30m..-10m or time:2026-12-01T10:00:00..",
        ) from None
    if wall.tzinfo is None:
        wall = wall.replace(tzinfo=UTC)
    rows = conn.execute(
        f"SELECT offset_ns FROM {catalog}.clock_fits WHERE clock = 'realtime' ORDER BY ts_ns DESC LIMIT 1"
    ).fetchall()
    if not rows:
        raise UsageError(
            f"the store {catalog} has no realtime clock fit to place {text!r}",
            hint="use a relative bound (time:-30m..) or monotonic ns",
        )
    return int(wall.timestamp() * 1e9) - int(rows[0][0])


# ---- the stores -------------------------------------------------------------------------------------


def attach_stores(
    default_db: Path | str, selectors: list[Selector]
) -> tuple[duckdb.DuckDBPyConnection, list[str]]:
    """An in-memory connection with each distinct store attached read-only (s0, s1); the catalog of each
    selector's store."""
    conn = duckdb.connect()
    catalogs: dict[str, str] = {}
    out = []
    for sel in selectors:
        path = str(Path(sel.store or default_db).expanduser().resolve())
        if path not in catalogs:
            if not Path(path).exists():
                raise StoreError(
                    f"no store at {path}", hint="give the agent's store with --db PATH (or store:PATH)"
                )
            alias = f"s{len(catalogs)}"
            try:
                conn.execute(f"ATTACH '{path.replace(chr(39), chr(39) * 2)}' AS {alias} (READ_ONLY)")
            except duckdb.Error as exc:
                raise StoreError(f"cannot open {path}: {str(exc).strip().splitlines()[0]}") from None
            version = conn.execute(f"SELECT max(version) FROM {alias}.schema_migrations").fetchall()[0][0]
            if (version or 0) < COMPARE_VERSION:
                raise StoreError(
                    f"the store {path} is at schema {version}: compare needs {COMPARE_VERSION}",
                    hint="open it once with a current agent (it migrates)",
                )
            catalogs[path] = alias
        out.append(catalogs[path])
    return conn, out


def _requests_sql(catalog: str) -> str:
    """Every request of a store, one row each: its identity, variant, prompt key, and its per-request
    sums (loss, decode latency, TTFT, time per output token, finish, work from pass_shares)."""
    p = f"{catalog}."
    return f"""
    WITH sums AS (  -- no FILTER clauses and no strings on the 1 M-row pass: 2x cheaper
        SELECT pid, {KEY} AS rkey, min(t_start_ns) AS t0, count(*) AS tokens, max(step) AS max_step,
            sum(CASE WHEN isfinite(loss) THEN loss ELSE 0 END) AS loss_sum,
            sum(isfinite(loss)::INTEGER) AS loss_n, sum(latency_ns) AS latency_ns,
            sum((step = 0)::INTEGER) AS firsts, max(shadow::INTEGER) = 1 AS shadow
        FROM {p}token_steps GROUP BY ALL
    ),
    first AS (  -- the request's first token: its identity and its latency (the prefill)
        SELECT pid, {KEY} AS rkey, any_value(trace_id) AS trace_id, any_value(model_id) AS model_id,
            any_value(tenant) AS tenant, min(latency_ns) AS first_ns
        FROM {p}token_steps WHERE step = 0 GROUP BY ALL
    ),
    tok AS (
        SELECT s.*, CASE WHEN s.rkey < 0 THEN -s.rkey ELSE 0 END AS request_seq,  -- the key's inverse
            f.trace_id, f.model_id, f.tenant, f.first_ns,
            CASE WHEN s.firsts = 1 THEN s.latency_ns - f.first_ns END AS decode_ns, s.tokens - 1 AS decode_n
        FROM sums s LEFT JOIN first f USING (pid, rkey)
    ),
    ends AS (
        SELECT pid, -request_seq AS rkey, request_seq, trace_id, model_id, tenant, t_start_ns, ttft_ns,
            tpot_ns, finish_reason,
            CASE WHEN trace_from_caller AND prompt_hash <> '' THEN prompt_hash END AS ph
        FROM {p}request_events WHERE kind = 'end' AND request_seq <> 0
        QUALIFY row_number() OVER (PARTITION BY pid, request_seq ORDER BY t_end_ns DESC) = 1
    ),
    work AS (
        SELECT pid, {KEY} AS rkey, sum(allocations) AS allocations, sum(compute_ns) AS compute_ns,
            sum(gpu_ns) AS gpu_ns, count(gpu_ns) AS gpu_rows, count(*) AS share_rows
        FROM {p}pass_shares GROUP BY ALL
    ),
    r AS (
        SELECT coalesce(t.pid, e.pid) AS pid, coalesce(t.rkey, e.rkey) AS rkey,
            coalesce(t.request_seq, e.request_seq, 0) AS request_seq,
            coalesce(t.trace_id, e.trace_id) AS trace_id, coalesce(t.model_id, e.model_id) AS model_id,
            coalesce(t.tenant, e.tenant) AS tenant, coalesce(e.t_start_ns, t.t0) AS t0, t.max_step,
            coalesce(e.ph, t.trace_id, e.trace_id) AS prompt_key, coalesce(t.tokens, 0) AS tokens,
            t.loss_sum, coalesce(t.loss_n, 0) AS loss_n,
            -- a shadow's latency is its scoring pass (queued after the primary, one teacher-forced
            -- pass for all its tokens), not a served latency: none
            CASE WHEN coalesce(t.shadow, false) THEN NULL WHEN e.ttft_ns >= 0 THEN e.ttft_ns
                 WHEN e.pid IS NULL THEN t.first_ns END AS ttft_ns,
            CASE WHEN coalesce(t.shadow, false) THEN NULL WHEN e.tpot_ns >= 0 THEN e.tpot_ns::DOUBLE
                 WHEN e.pid IS NULL AND t.decode_n > 0 THEN t.decode_ns / t.decode_n END AS tpot_ns,
            e.finish_reason, coalesce(t.shadow, false) AS shadow
        FROM tok t FULL JOIN ends e ON t.pid = e.pid AND t.rkey = e.rkey
    )
    SELECT r.*, coalesce(v.value, r.model_id) AS variant, TRY_CAST(so.value AS BIGINT) AS shadow_of,
        w.allocations, w.compute_ns, w.gpu_ns, coalesce(w.gpu_rows, 0) AS gpu_rows,
        coalesce(w.share_rows, 0) AS share_rows
    FROM r
    -- the variant rule of llmobs.store.views.request_variants (its label, else the model id), joined
    -- here on the requests already aggregated: the view would scan token_steps a second time
    LEFT JOIN {p}request_labels v ON v.pid = r.pid AND v.request_seq = r.request_seq
        AND r.request_seq <> 0 AND v.key = 'variant'
    LEFT JOIN {p}request_labels so ON so.pid = r.pid AND so.request_seq = r.request_seq
        AND r.request_seq <> 0 AND so.key = 'shadow_of'
    LEFT JOIN work w ON w.pid = r.pid AND w.rkey = r.rkey
    """


def _where(conn, catalog: str, sel: Selector) -> tuple[str, list]:
    clauses, params = ["true"], []
    if sel.variant is not None:
        clauses.append("variant = ?")
        params.append(sel.variant)
    if sel.model is not None:
        clauses.append("model_id = ?")
        params.append(sel.model)
    for key, value in sel.labels:
        clauses.append(f"""request_seq <> 0 AND EXISTS (SELECT 1 FROM {catalog}.request_labels l
            WHERE l.pid = q.pid AND l.request_seq = q.request_seq AND l.key = ? AND l.value = ?)""")
        params += [key, value]
    if sel.time is not None:
        newest = (
            conn.execute(f"""SELECT greatest((SELECT max(t_end_ns) FROM {catalog}.token_steps),
            (SELECT max(t_end_ns) FROM {catalog}.request_events))""").fetchall()[0][0]
            or 0
        )
        start, end = (_time_bound(conn, catalog, b, newest) for b in sel.time)
        if start is not None:
            clauses.append("t0 >= ?")
            params.append(start)
        if end is not None:
            clauses.append("t0 < ?")
            params.append(end)
    return " AND ".join(clauses), params


# ---- metrics ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    name: str
    label: str
    unit: str
    group: str  # the --metric name that selects it


METRICS = (
    MetricSpec("loss", "per-token loss", "nats", "loss"),
    MetricSpec("ttft", "TTFT", "ms", "ttft"),
    MetricSpec("tpot_p50", "time per token p50", "ms", "tpot"),
    MetricSpec("tpot_p95", "time per token p95", "ms", "tpot"),
    MetricSpec("tpot_p99", "time per token p99", "ms", "tpot"),
    MetricSpec("error_rate", "error rate", "", "errors"),
    MetricSpec("cancel_rate", "cancel rate", "", "errors"),
    MetricSpec("allocations_per_token", "allocations per token", "", "allocations"),
    MetricSpec("compute_per_token", "compute per token", "ms", "compute"),
    MetricSpec("gpu_per_token", "GPU time per token", "ms", "gpu"),
)
METRIC_GROUPS = tuple(dict.fromkeys(m.group for m in METRICS))


@dataclass
class MetricResult:
    name: str
    label: str
    unit: str
    a: float | None
    b: float | None
    diff: float | None
    rel: float | None
    ci: tuple[float, float] | None
    p: float | None
    pairs: int
    flagged: bool
    basis: str


@dataclass
class Comparison:
    a: dict
    b: dict
    pairs: dict
    bootstrap: dict
    metrics: list[MetricResult]
    steps: list[dict] = field(default_factory=list)  # per step index: mean B-A loss and its interval


# Poisson(1) by inverse CDF on 16-bit uniforms: count = how many of these thresholds u reaches (8 at most:
# P(X >= 8) = 1e-5 is lumped into 8).
_POISSON_CUTS = np.round(
    np.cumsum([np.exp(-1.0) / np.prod(np.arange(1, k + 1)) for k in range(8)]) * 65536
).astype(np.uint16)


def bootstrap_weights(n: int, resamples: int, seed: int) -> np.ndarray:
    """(n x resamples) uint8 weights: how often each pair is drawn in each resample, independently
    Poisson(1) per pair (the Poisson bootstrap: the multinomial bootstrap's standard large-n form, each
    resample's size n +- sqrt(n)); 3x cheaper than drawing n indices and counting them. Pairs are rows,
    so a quantile's cumulative counts run down contiguous rows."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 65536, size=(n, resamples), dtype=np.uint16)
    w = np.zeros((n, resamples), np.uint8)
    for cut in _POISSON_CUTS:
        w += u >= cut
    return w


def _ratios(w: np.ndarray, columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """sum(column) for each column, and per resample: one (resamples x pairs) x (pairs x columns) product
    for every ratio metric at once. float32 holds the counts exactly; its sums carry a relative error
    of ~1e-6, far below any interval's width, at half the cost of float64."""
    m = np.stack(columns, axis=1)
    return m.sum(axis=0), w.T.astype(np.float32) @ m.astype(np.float32)


def _weighted_quantiles(
    values: np.ndarray, w: np.ndarray, qs: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Inverted-CDF quantiles of `values` (one per pair) with every pair once (point) and under each
    resample's counts (replicates). The q-quantile of a resample is the first row (in value order) where
    its cumulative count reaches q x its total: that row lies within a few sqrt(n) of q n, so the counts
    above a window around it are summed (a plain reduction) and only the window is accumulated row by
    row; a resample whose quantile falls outside the window is recomputed over all rows."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    ws = w[order]
    n = len(v)
    total = ws.sum(axis=0, dtype=np.int32)
    points = np.array([v[min(n - 1, max(0, int(np.ceil(q * n)) - 1))] for q in qs])
    reps = np.empty((len(qs), w.shape[1]))
    half = int(8 * np.sqrt(n)) + 16
    base, done = np.zeros(w.shape[1], np.int32), 0  # counts of the rows above `done`, grown in q order
    for i in sorted(range(len(qs)), key=lambda j: qs[j]):
        q = qs[i]
        target = q * total
        lo, hi = max(done, int(q * n) - half), min(n, int(q * n) + half)
        base += ws[done:lo].sum(axis=0, dtype=np.int32)
        done = lo
        cum = base + np.cumsum(ws[lo:hi], axis=0, dtype=np.int32)
        k = lo + (cum < target[None, :]).sum(axis=0)
        outside = (base >= target) | ((k >= hi) & (hi < n))
        if outside.any():
            full = np.cumsum(ws[:, outside], axis=0, dtype=np.int32)
            k[outside] = (full < target[outside][None, :]).sum(axis=0)
        reps[i] = v[np.minimum(k, n - 1)]
    return points, reps


def _interval(
    point_diff: float, reps: np.ndarray, alpha: float
) -> tuple[tuple[float, float] | None, float | None]:
    """Percentile interval at 1 - alpha and a two-sided bootstrap p-value (share of replicates on the far
    side of 0, doubled) of the B - A difference."""
    reps = reps[np.isfinite(reps)]
    if not len(reps) or not np.isfinite(point_diff):
        return None, None
    lo, hi = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    p = min(1.0, 2 * min(np.mean(reps <= 0), np.mean(reps >= 0)))
    return (float(lo), float(hi)), float(p)


def _result(spec: MetricSpec, a, b, reps_diff, pairs, alpha, threshold, basis, scale=1.0) -> MetricResult:
    if pairs == 0 or a is None or b is None or not (np.isfinite(a) and np.isfinite(b)):
        return MetricResult(
            spec.name, spec.label, spec.unit, None, None, None, None, None, None, pairs, False, basis
        )
    diff = b - a
    ci, p = _interval(diff, reps_diff, alpha)
    rel = diff / a if a != 0 else (0.0 if diff == 0 else float("inf") if diff > 0 else float("-inf"))
    significant = ci is not None and (ci[0] > 0 or ci[1] < 0)
    flagged = bool(significant and abs(rel) >= threshold)
    ci_scaled = None if ci is None else (ci[0] * scale, ci[1] * scale)
    return MetricResult(
        spec.name,
        spec.label,
        spec.unit,
        a * scale,
        b * scale,
        diff * scale,
        rel,
        ci_scaled,
        p,
        int(pairs),
        flagged,
        basis,
    )


# ---- the comparison ---------------------------------------------------------------------------------


def arrow_numpy(column) -> np.ndarray:
    """A primitive Arrow column as a numpy array from its buffers (NULL -> NaN, as float64). pyarrow's
    own to_numpy() imports pandas on its first call (~0.5 s of a 1 s budget), and so does DuckDB's
    fetchnumpy(); the buffers need neither."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = arr.type
    if pa.types.is_floating(kind):
        dtype = {16: np.float16, 32: np.float32, 64: np.float64}[kind.bit_width]
    elif pa.types.is_integer(kind):
        dtype = np.dtype(f"{'i' if pa.types.is_signed_integer(kind) else 'u'}{kind.bit_width // 8}")
    else:
        raise TypeError(f"not a numeric column: {kind}")
    n, off = len(arr), arr.offset
    values = np.frombuffer(arr.buffers()[1], dtype=dtype, count=off + n)[off:]
    if not arr.null_count:
        return values
    valid = np.unpackbits(np.frombuffer(arr.buffers()[0], np.uint8), bitorder="little")[off : off + n]
    return np.where(valid.astype(bool), values.astype(np.float64), np.nan)


def _numeric_columns(conn, sql: str) -> dict[str, np.ndarray]:
    """{column: float64 array, NULL -> NaN} of a query's result."""
    table = conn.sql(sql).to_arrow_table()
    return {name: arrow_numpy(table[name].cast("double")) for name in table.column_names}


def compare(
    default_db: Path | str,
    sel_a: Selector,
    sel_b: Selector,
    *,
    metrics: tuple[str, ...] = METRIC_GROUPS,
    alpha: float = 0.05,
    threshold: float = 0.03,
    resamples: int = 2000,
    seed: int = 0,
    by_intent: bool = False,
    per_step: bool = False,
) -> Comparison:
    conn, (cat_a, cat_b) = attach_stores(default_db, [sel_a, sel_b])
    try:
        return _compare(
            conn, cat_a, cat_b, sel_a, sel_b, metrics, alpha, threshold, resamples, seed, by_intent, per_step
        )
    finally:
        conn.close()


def _compare(
    conn, cat_a, cat_b, sel_a, sel_b, metrics, alpha, threshold, resamples, seed, by_intent, per_step
):
    for cat in dict.fromkeys((cat_a, cat_b)):
        conn.execute(f"CREATE TEMP TABLE req_{cat} AS {_requests_sql(cat)}")
    counts = {}
    for side, cat, sel in (("a", cat_a, sel_a), ("b", cat_b, sel_b)):
        where, params = _where(conn, cat, sel)
        conn.execute(f"CREATE TEMP TABLE side_{side} AS SELECT * FROM req_{cat} q WHERE {where}", params)
        counts[side] = conn.execute(f"SELECT count(*) FROM side_{side}").fetchall()[0][0]
    if not counts["a"] or not counts["b"]:
        empty = [f"{s.upper()} ({sel.text})" for s, sel in (("a", sel_a), ("b", sel_b)) if not counts[s]]
        raise NoMatch(
            f"no request matches {' and '.join(empty)}: A {sel_a.text!r} matched {counts['a']}"
            f" request(s), B {sel_b.text!r} matched {counts['b']}"
        )
    same = cat_a == cat_b
    _pair(conn, same, by_intent, cat_a, cat_b)
    kinds = dict(conn.execute("SELECT kind, count(*) FROM pairs GROUP BY kind").fetchall())
    n = sum(kinds.values())
    if n == 0:
        raise NoPairs(
            f"A {sel_a.text!r} matched {counts['a']} request(s) and B {sel_b.text!r} matched"
            f" {counts['b']}, but none of A pairs with one of B (no common prompt"
            f"{', intent' if by_intent else ''} or shadow)"
        )
    tp = _token_pairs(conn, cat_a, cat_b, n)
    cols = _numeric_columns(
        conn,
        """
        SELECT p.pair, a.loss_sum AS a_ls, a.loss_n AS a_ln, b.loss_sum AS b_ls, b.loss_n AS b_ln,
            a.ttft_ns AS a_ttft, b.ttft_ns AS b_ttft, a.tpot_ns AS a_tpot, b.tpot_ns AS b_tpot,
            (a.finish_reason IS NOT NULL AND b.finish_reason IS NOT NULL)::DOUBLE AS fin,
            (a.finish_reason = 'error')::DOUBLE AS a_error, (b.finish_reason = 'error')::DOUBLE AS b_error,
            (a.finish_reason = 'cancelled')::DOUBLE AS a_cancel,
            (b.finish_reason = 'cancelled')::DOUBLE AS b_cancel,
            a.tokens AS a_tok, b.tokens AS b_tok,
            a.allocations AS a_alloc, b.allocations AS b_alloc,
            a.compute_ns AS a_comp, b.compute_ns AS b_comp,
            a.gpu_ns AS a_gpu, b.gpu_ns AS b_gpu, a.gpu_rows AS a_gr, b.gpu_rows AS b_gr,
            a.share_rows AS a_sr, b.share_rows AS b_sr
        FROM pairs p JOIN side_a a ON a.rid = p.a_rid JOIN side_b b ON b.rid = p.b_rid
        ORDER BY p.pair""",
    )
    cols.update({"t_n": tp.n, "t_a": tp.a_sum, "t_b": tp.b_sum})
    token_pairs = int(tp.n.sum())
    clusters, n_clusters = _prompt_clusters(conn, n)
    w = bootstrap_weights(n_clusters, resamples, seed)
    if n_clusters < n:  # the pairs of one prompt are drawn together: one weight per prompt
        w = w[clusters]
    specs = [m for m in METRICS if m.group in metrics]

    def f(name):
        return np.asarray(cols[name], dtype=np.float64)

    ratio_specs = []  # (spec, [a_num, a_den, b_num, b_den], pairs, basis, scale); computed together
    for spec in specs:
        if spec.group == "loss":
            if token_pairs:
                has = f("t_n") > 0
                an, ad = np.where(has, f("t_a"), 0), np.where(has, f("t_n"), 0)
                bn, bd = np.where(has, f("t_b"), 0), ad
                basis = f"{token_pairs} paired tokens in {int(has.sum())} pairs"
            else:
                has = (f("a_ln") > 0) & (f("b_ln") > 0)
                an = np.where(has, f("a_ls") / np.where(has, f("a_ln"), 1), 0)
                bn = np.where(has, f("b_ls") / np.where(has, f("b_ln"), 1), 0)
                ad = bd = has.astype(np.float64)
                basis = f"per-request mean loss, {int(has.sum())} pairs by prompt (no common tokens)"
            ratio_specs.append((spec, [an, ad, bn, bd], has, basis, 1.0))
        elif spec.name == "ttft":
            av, bv = f("a_ttft"), f("b_ttft")
            has = np.isfinite(av) & np.isfinite(bv)
            ratio_specs.append(
                (
                    spec,
                    [np.where(has, av, 0), has * 1.0, np.where(has, bv, 0), has * 1.0],
                    has,
                    "mean over pairs (served: request_events ttft; else the first token)",
                    1e-6,
                )
            )
        elif spec.group == "errors":
            reason = spec.name.split("_")[0]
            has = f("fin") > 0
            ae, be = np.nan_to_num(f(f"a_{reason}")) * has, np.nan_to_num(f(f"b_{reason}")) * has
            ratio_specs.append(
                (spec, [ae, has * 1.0, be, has * 1.0], has, "request_events finish_reason", 1.0)
            )
        elif spec.group != "tpot":  # the three quantiles share one sort: below
            num, scale, what = {
                "allocations": ("alloc", 1.0, "pass_shares allocations"),
                "compute": ("comp", 1e-6, "pass_shares compute_ns"),
                "gpu": ("gpu", 1e-6, "pass_shares gpu_ns"),
            }[spec.group]
            rows = "gr" if spec.group == "gpu" else "sr"
            has = (f(f"a_{rows}") > 0) & (f(f"b_{rows}") > 0) & (f("a_tok") > 0) & (f("b_tok") > 0)
            an, bn = (
                np.nan_to_num(np.where(has, f(f"a_{num}"), 0)),
                np.nan_to_num(np.where(has, f(f"b_{num}"), 0)),
            )
            ad, bd = np.where(has, f("a_tok"), 0), np.where(has, f("b_tok"), 0)
            ratio_specs.append((spec, [an, ad, bn, bd], has, what, scale))
    results = []
    if ratio_specs:
        totals, reps = _ratios(w, [c for r in ratio_specs for c in r[1]])
        with np.errstate(invalid="ignore", divide="ignore"):
            for i, (spec, _c, has, basis, scale) in enumerate(ratio_specs):
                t, r = totals[4 * i : 4 * i + 4], reps[:, 4 * i : 4 * i + 4].astype(np.float64)
                a, b = t[0] / t[1], t[2] / t[3]
                diff_reps = r[:, 2] / r[:, 3] - r[:, 0] / r[:, 1]
                results.append(_result(spec, a, b, diff_reps, int(has.sum()), alpha, threshold, basis, scale))
    tpot_specs = [m for m in specs if m.group == "tpot"]
    if tpot_specs:
        results += _tpot(tpot_specs, f("a_tpot"), f("b_tpot"), w, alpha, threshold)
        order = {m.name: i for i, m in enumerate(METRICS)}
        results.sort(key=lambda r: order[r.name])
    steps = _per_step(tp, alpha) if per_step and token_pairs else []
    return Comparison(
        a={"selector": sel_a.text, "requests": int(counts["a"])},
        b={"selector": sel_b.text, "requests": int(counts["b"])},
        pairs={"pairs": n, "by": {k: int(v) for k, v in sorted(kinds.items())}, "token_pairs": token_pairs},
        bootstrap={
            "resamples": resamples,
            "method": "percentile; Poisson bootstrap over prompts (each prompt's pairs together)",
            "clusters": n_clusters,
            "seed": seed,
            "alpha": alpha,
            "threshold": threshold,
        },
        metrics=results,
        steps=steps,
    )


def _prompt_clusters(conn, n: int) -> tuple[np.ndarray, int]:
    """(each pair's prompt cluster index, in order of the pairs; how many clusters): pairs of the same
    prompt (a prompt sent twice, or with two template labels that change nothing) are not independent -
    under greedy decoding they are the same tokens - so the bootstrap resamples prompts, each with all
    its pairs. Indices follow the pairs' order, so with every prompt once they are 0..n-1."""
    rows = conn.execute("""SELECT coalesce(a.prompt_key, b.prompt_key) FROM pairs p
        JOIN side_a a ON a.rid = p.a_rid JOIN side_b b ON b.rid = p.b_rid ORDER BY p.pair""").fetchall()
    index: dict = {}
    clusters = np.fromiter(
        (index.setdefault(("pair", i) if key is None else key, len(index)) for i, (key,) in enumerate(rows)),
        np.int64, n,
    )  # fmt: skip
    return clusters, len(index)


def _tpot(specs, av, bv, w, alpha, threshold) -> list[MetricResult]:
    has = np.isfinite(av) & np.isfinite(bv)
    k = int(has.sum())
    basis = "quantile over pairs of each request's time per output token (served: request_events tpot)"
    if k == 0:
        return [_result(s, None, None, None, 0, alpha, threshold, basis) for s in specs]
    qs = tuple(float(s.name[-2:]) / 100 for s in specs)
    wv = w[has]
    pa_, ra = _weighted_quantiles(av[has], wv, qs)
    pb_, rb = _weighted_quantiles(bv[has], wv, qs)
    return [
        _result(s, pa_[i], pb_[i], rb[i] - ra[i], k, alpha, threshold, basis, scale=1e-6)
        for i, s in enumerate(specs)
    ]


def _pair(conn, same: bool, by_intent: bool, cat_a: str, cat_b: str) -> None:
    """pairs(pair, a_rid, b_rid, kind): one to one, shadow first, then by prompt (the n-th request of a
    prompt in A with the n-th in B, by start time), then (by_intent) by intent key."""
    for side in ("a", "b"):
        conn.execute(f"ALTER TABLE side_{side} ADD COLUMN rid BIGINT")
        conn.execute(f"""UPDATE side_{side} SET rid = s.rid FROM (SELECT pid AS p, rkey AS k,
            row_number() OVER (ORDER BY t0, pid, rkey) AS rid FROM side_{side}) s
            WHERE pid = s.p AND rkey = s.k""")
    not_self = "NOT (a.pid = b.pid AND a.rkey = b.rkey)" if same else "true"
    # a shadow names its primary (shadow_of = the primary's request_seq, same process): two equality
    # joins (an OR of them is a nested loop), then one to one
    shadow = (
        f"""WITH c AS (
                SELECT a.rid AS a_rid, b.rid AS b_rid FROM side_a a JOIN side_b b
                    ON a.pid = b.pid AND b.shadow_of = a.request_seq WHERE a.request_seq <> 0 AND {not_self}
                UNION
                SELECT a.rid, b.rid FROM side_a a JOIN side_b b
                    ON a.pid = b.pid AND a.shadow_of = b.request_seq WHERE b.request_seq <> 0 AND {not_self})
            SELECT a_rid, b_rid, 'shadow' AS kind FROM c
            QUALIFY row_number() OVER (PARTITION BY a_rid ORDER BY b_rid) = 1
                AND row_number() OVER (PARTITION BY b_rid ORDER BY a_rid) = 1"""
        if same
        else "SELECT NULL::BIGINT AS a_rid, NULL::BIGINT AS b_rid, 'shadow' AS kind WHERE false"
    )
    conn.execute(f"CREATE TEMP TABLE pairs0 AS {shadow}")
    conn.execute(f"""INSERT INTO pairs0
        WITH ra AS (SELECT rid, pid, rkey, prompt_key,
                        row_number() OVER (PARTITION BY prompt_key ORDER BY t0, rid) AS n
                    FROM side_a WHERE rid NOT IN (SELECT a_rid FROM pairs0) AND prompt_key IS NOT NULL),
             rb AS (SELECT rid, pid, rkey, prompt_key,
                        row_number() OVER (PARTITION BY prompt_key ORDER BY t0, rid) AS n
                    FROM side_b WHERE rid NOT IN (SELECT b_rid FROM pairs0) AND prompt_key IS NOT NULL)
        SELECT a.rid, b.rid, 'prompt' FROM ra a JOIN rb b USING (prompt_key, n)
        WHERE {not_self}""")
    if by_intent:
        _pair_by_intent(conn, cat_a, cat_b, not_self)
    conn.execute("""CREATE TEMP TABLE pairs AS SELECT row_number() OVER (ORDER BY a_rid) - 1 AS pair, a_rid,
        b_rid, kind FROM pairs0""")


def _pair_by_intent(conn, cat_a: str, cat_b: str, not_self: str) -> None:
    """Requests left unpaired pair by intent cluster (llmobs.diagnostics.intent_cluster, weighted Jaccard
    over the slots and the MinHash signature), the n-th of a cluster in A with the n-th in B. Both
    stores' intents are clustered together, so a cluster means the same on both sides."""
    from llmobs.diagnostics import intent_cluster

    found = []
    for cat in dict.fromkeys((cat_a, cat_b)):
        conn.execute(f"USE {cat}")  # intent_cluster.load reads `request_intents` unqualified
        try:
            found += [(cat, fp) for fp in intent_cluster.load(conn)]
        finally:
            conn.execute("USE memory")
    clusters = intent_cluster.cluster([fp for _, fp in found])
    catalog_of = {id(fp): cat for cat, fp in found}
    rows = [(catalog_of[id(m)], m.pid, m.request_seq, c.cluster) for c in clusters for m in c.members]
    conn.execute(
        "CREATE TEMP TABLE intent_map (cat VARCHAR, pid INTEGER, request_seq BIGINT, cluster BIGINT)"
    )
    if rows:
        conn.executemany("INSERT INTO intent_map VALUES (?, ?, ?, ?)", rows)
    sides = {}
    for side, cat in (("a", cat_a), ("b", cat_b)):
        sides[side] = f"""SELECT s.rid, s.t0, s.pid, s.rkey, i.cluster FROM side_{side} s JOIN intent_map i
            ON i.cat = '{cat}' AND i.pid = s.pid AND i.request_seq = s.request_seq AND s.request_seq <> 0
            WHERE s.rid NOT IN (SELECT {side}_rid FROM pairs0)"""
    conn.execute(f"""INSERT INTO pairs0
        WITH ra AS (SELECT *, row_number() OVER (PARTITION BY cluster ORDER BY t0, rid) AS n
                    FROM ({sides["a"]})),
             rb AS (SELECT *, row_number() OVER (PARTITION BY cluster ORDER BY t0, rid) AS n
                    FROM ({sides["b"]}))
        SELECT a.rid, b.rid, 'intent' FROM ra a JOIN rb b USING (cluster, n) WHERE {not_self}""")


@dataclass
class TokenPairs:
    """Paired tokens: the pair of each, its step index and both losses; per pair their count and sums."""

    pair: np.ndarray
    step: np.ndarray
    a_loss: np.ndarray
    b_loss: np.ndarray
    n: np.ndarray  # per pair
    a_sum: np.ndarray
    b_sum: np.ndarray


def _token_pairs(conn, cat_a: str, cat_b: str, pairs: int) -> TokenPairs:
    """A pair's tokens at the same (step, position) with the same target token (target_id, else the
    token itself where the target is -1, unknown), both with a loss. One scan of each store's
    token_steps joined to the small request -> (pair, side) map; the matching is done here on a dense
    grid (a cell per pair and step index, each pair's cells after the previous pair's): two scatters,
    where a group-by or a hash join of the two sides' million rows in DuckDB costs 3-5x as much."""
    conn.execute("""CREATE TEMP TABLE pair_span AS
        SELECT p.pair, p.a_rid, p.b_rid,
            1 + greatest(coalesce(a.max_step, -1), coalesce(b.max_step, -1), -1) AS width
        FROM pairs p JOIN side_a a ON a.rid = p.a_rid JOIN side_b b ON b.rid = p.b_rid""")
    conn.execute("""CREATE TEMP TABLE pair_map AS
        WITH o AS (SELECT *,
                (sum(width) OVER (ORDER BY pair ROWS UNBOUNDED PRECEDING) - width)::BIGINT AS offset
                   FROM pair_span)
        SELECT s.pid, s.rkey, o.offset, 0 AS side FROM o JOIN side_a s ON s.rid = o.a_rid
        UNION ALL SELECT s.pid, s.rkey, o.offset, 1 FROM o JOIN side_b s ON s.rid = o.b_rid""")
    width = _numeric_columns(conn, "SELECT width FROM pair_span ORDER BY pair")["width"].astype(np.int64)
    offset = np.concatenate(([0], np.cumsum(width)))
    cells = int(offset[-1])
    scans = []
    for cat, side in ((cat_a, 0), (cat_b, 1)) if cat_a != cat_b else ((cat_a, None),):
        which = "" if side is None else f" AND m.side = {side}"
        # the cell (pair, step) and the token's (position, target) packed in one integer to compare
        scans.append(f"""SELECT m.side::UTINYINT AS side, m.offset + t.step AS cell,
            (t.position::BIGINT << 32) | (CASE WHEN t.target_id >= 0 THEN t.target_id ELSE t.token_id END
                ::BIGINT & 4294967295) AS tok,
            t.loss FROM {cat}.token_steps t JOIN pair_map m ON m.pid = t.pid AND m.rkey = {request_key("t.")}
            {which} WHERE isfinite(t.loss) AND t.step >= 0""")
    rows = conn.sql(" UNION ALL ".join(scans)).to_arrow_table()
    side = arrow_numpy(rows["side"])
    cell = arrow_numpy(rows["cell"])
    tok = arrow_numpy(rows["tok"])
    loss = arrow_numpy(rows["loss"]).astype(np.float64)
    grids = []
    for k in (0, 1):
        mine = side == k
        c = cell[mine]
        grid = {
            "count": np.bincount(c, minlength=cells),
            "tok": np.full(cells, -1, np.int64),
            "loss": np.zeros(cells),
        }
        grid["tok"][c] = tok[mine]
        grid["loss"][c] = loss[mine]
        grids.append(grid)
    a, b = grids
    ok = (a["count"] == 1) & (b["count"] == 1) & (a["tok"] == b["tok"])
    where = np.flatnonzero(ok)
    cell_pair = np.repeat(np.arange(pairs), width)[where]
    cell_step = where - offset[cell_pair]
    al, bl = a["loss"][where], b["loss"][where]
    counts = np.bincount(cell_pair, minlength=pairs).astype(np.float64)
    a_sums, b_sums = np.bincount(cell_pair, al, minlength=pairs), np.bincount(cell_pair, bl, minlength=pairs)
    return TokenPairs(cell_pair, cell_step, al, bl, counts, a_sums, b_sums)


def _per_step(tp: TokenPairs, alpha: float) -> list[dict]:
    """Per token index: the mean B - A loss over the pairs that have that token paired, with a normal
    interval of that mean (the PNG's band: pairs are independent, so the spread across them is honest)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - alpha / 2)
    d = tp.b_loss - tp.a_loss
    n = np.bincount(tp.step)
    keep = np.flatnonzero(n)
    mean = np.bincount(tp.step, d)[keep] / n[keep]
    sq = np.bincount(tp.step, d * d)[keep]
    k = n[keep]
    var = np.where(k > 1, (sq - k * mean**2) / np.maximum(k - 1, 1), 0.0)
    half = z * np.sqrt(np.maximum(var, 0) / k)
    return [
        {"step": int(s_), "pairs": int(c), "mean": float(m), "lo": float(m - h), "hi": float(m + h)}
        for s_, c, m, h in zip(keep, k, mean, half, strict=True)
    ]
