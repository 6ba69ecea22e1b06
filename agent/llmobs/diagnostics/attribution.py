"""The attribution matrix (`llmobs-agent query --attribution`): which factor moves loss, anomalies, latency.

Units are requests (their tokens are correlated). Per request: the metric (mean per-token loss, anomaly
rows per token, or mean decode time per token) and its factor levels: its labels (template, variant,
...; `shadow_of` is an id, not a factor), its variant (the label, else its model id), its model's
factors (model_factors: quant, dtype, tokenizer, adapters, vocab), its tenant, and its intent slots
(action, output format) where request_intents has rows. Factors with 2..MAX_LEVELS levels enter; two
factors that split the requests identically are one factor (named by both: their effects cannot be
told apart).

Model: least squares with main effects of every factor (treatment coding, reference = the most
frequent level; ties: the one with the lowest mean metric) and interaction terms for every pair of
factors. All regressors are categorical, so
the fit only needs per-cell counts and means (a cell = one combination of levels): the bootstrap
reweights requests (Poisson(1) weights, fixed seed), sums them per cell and refits every resample in
one batched pseudo-inverse.

A factor's effect is its largest level contrast in metric units: level l vs the reference, with every
other factor kept as it is in the data (the model's prediction with the factor set to l, minus with
it set to the reference, averaged over the requests). A contrast is reported only when the data
identify it (its vector lies in the row space of the design); otherwise the factor is listed as not
separable (e.g. nested in another). Factors rank by |effect|; an interaction (F x G) is the
difference-in-differences coefficient of its largest identified level pair. Intervals: percentile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

from llmobs.diagnostics.compare import bootstrap_weights, request_key

METRICS = {
    "loss": ("per-token loss", "nats"),
    "anomaly": ("anomaly rows per token", ""),
    "latency": ("decode time per token", "ms"),
}
MAX_LEVELS = 16
MIN_REQUESTS = 8
NOT_FACTORS = frozenset({"shadow_of"})  # labels that identify a request rather than describe it


@dataclass
class FactorEffect:
    factor: str
    levels: list[str]
    level: str | None
    reference: str
    effect: float | None
    ci: tuple[float, float] | None
    significant: bool
    note: str = ""
    rank: int = 0


@dataclass
class Interaction:
    factors: tuple[str, str]
    levels: tuple[str, str] | None
    references: tuple[str, str]
    effect: float | None
    ci: tuple[float, float] | None
    significant: bool
    note: str = ""


@dataclass
class Attribution:
    metric: str
    label: str
    unit: str
    requests: int
    cells: int
    r2: float | None
    resamples: int
    alpha: float
    factors: list[FactorEffect] = field(default_factory=list)
    interactions: list[Interaction] = field(default_factory=list)
    skipped: dict = field(default_factory=dict)  # factor -> why it is not in the model
    levels_of: dict = field(default_factory=dict)  # (pid, request key) -> {factor: level}, for explain


_ANY = "any_value(request_seq) AS request_seq, any_value(model_id) AS model_id, any_value(tenant) AS tenant"


def _metric_sql(metric: str, live: str = "true") -> str:
    """`live`: the condition on token_steps that keeps live rows (a shadow's rows are its scoring pass:
    their latency is not a served latency, and the anomaly lane does not score them)."""
    k = request_key()
    if metric == "loss":
        return f"""SELECT pid, {k} AS rkey, {_ANY}, avg(loss) FILTER (isfinite(loss)) AS y
            FROM token_steps GROUP BY ALL"""
    if metric == "latency":
        return f"""SELECT pid, {k} AS rkey, {_ANY}, avg(latency_ns) FILTER (step > 0) / 1e6 AS y
            FROM token_steps WHERE {live} GROUP BY ALL"""
    if metric == "anomaly":
        return f"""WITH t AS (SELECT pid, {k} AS rkey, step_seq, coalesce(batch_row, 0) AS row, step,
                request_seq, model_id, tenant, trace_id FROM token_steps WHERE {live}),
            a AS (SELECT pid, step_seq, coalesce(batch_row, 0) AS row, step, trace_id, count(*) AS n
                  FROM anomalies GROUP BY ALL)
            SELECT t.pid, t.rkey, any_value(t.request_seq) AS request_seq, any_value(t.model_id) AS model_id,
                any_value(t.tenant) AS tenant, coalesce(sum(a.n), 0) / count(*) AS y
            FROM t LEFT JOIN a ON a.pid = t.pid AND a.step_seq = t.step_seq AND a.row = t.row
                AND (a.step IS NULL OR a.step = t.step) AND (a.trace_id IS NULL OR a.trace_id = t.trace_id)
            GROUP BY t.pid, t.rkey"""
    raise ValueError(metric)


def _tables(conn) -> set[str]:
    return {r[0] for r in conn.execute("SELECT table_name FROM duckdb_tables()").fetchall()}


def request_factors(conn, metric: str) -> tuple[list[tuple], np.ndarray, dict[str, list]]:
    """(request keys, y, {factor: level per request}) for every request with a finite metric."""
    shadow_column = conn.execute(
        "SELECT count(*) FROM duckdb_columns() WHERE table_name = 'token_steps' AND column_name = 'shadow'"
    ).fetchall()[0][0]
    live = "NOT coalesce(shadow, false)" if shadow_column and metric != "loss" else "true"
    rows = conn.execute(
        f"SELECT * FROM ({_metric_sql(metric, live)}) WHERE y IS NOT NULL AND isfinite(y) ORDER BY pid, rkey"
    ).fetchall()
    keys = [(r[0], r[1]) for r in rows]
    y = np.array([r[5] for r in rows], dtype=np.float64)
    seqs = [(r[0], r[2]) for r in rows]
    tables = _tables(conn)
    labels: dict[tuple, dict] = {}
    if "request_labels" in tables:
        for pid, seq, key, value in conn.execute(
            "SELECT pid, request_seq, key, value FROM request_labels WHERE request_seq <> 0"
        ).fetchall():
            labels.setdefault((pid, seq), {})[key] = value
    model_factors: dict[tuple, dict] = {}
    if "model_factors" in tables:
        for pid, model, key, value in conn.execute(
            "SELECT pid, model_id, key, value FROM model_factors"
        ).fetchall():
            model_factors.setdefault((pid, model), {})[key] = value
    intents: dict[tuple, dict] = {}
    if "request_intents" in tables:
        for pid, seq, action, fmt in conn.execute(
            "SELECT pid, request_seq, action, output_format FROM request_intents"
        ).fetchall():
            intents[(pid, seq)] = {"intent.action": action, "intent.format": fmt}
    factors: dict[str, list] = {}
    n = len(rows)
    label_keys = {k for mine in labels.values() for k in mine} | {"variant", "tenant"}

    def put(name: str, i: int, value) -> None:
        factors.setdefault(name, [None] * n)[i] = None if value is None else str(value)

    for i, r in enumerate(rows):
        mine = labels.get(seqs[i], {}) if seqs[i][1] else {}
        put("variant", i, mine.get("variant", r[3]))
        for key, value in mine.items():
            if key not in NOT_FACTORS and key != "variant":
                put(key if key not in ("tenant",) else f"label.{key}", i, value)
        for key, value in model_factors.get((r[0], r[3]), {}).items():
            put(f"model.{key}" if key in label_keys else key, i, value)
        put("tenant", i, r[4])
        for key, value in intents.get(seqs[i], {}).items() if seqs[i][1] else ():
            put(key, i, value)
    return keys, y, {k: ["(none)" if v is None else v for v in vals] for k, vals in factors.items()}


def attribution(
    conn,
    metric: str = "loss",
    *,
    resamples: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
    keep_levels: bool = False,
) -> Attribution:
    label, unit = METRICS[metric]
    keys, y, raw = request_factors(conn, metric)
    out = Attribution(metric, label, unit, len(y), 0, None, resamples, alpha)
    if len(y) < MIN_REQUESTS:
        out.skipped["*"] = f"{len(y)} requests with the metric (need {MIN_REQUESTS})"
        return out
    factors, codes, names = [], [], {}
    for name in sorted(raw):
        levels, inverse = np.unique(np.array(raw[name], dtype=object), return_inverse=True)
        if len(levels) < 2:
            continue
        if len(levels) > MAX_LEVELS:
            out.skipped[name] = f"{len(levels)} levels (more than {MAX_LEVELS}: an id, not a factor)"
            continue
        # reference: the most frequent level; ties (a balanced design) go to the level with the lowest
        # mean metric, so the contrasts read "this level raises it by"; then the first by name
        counts = np.bincount(inverse, minlength=len(levels))
        means = np.bincount(inverse, y, minlength=len(levels)) / np.maximum(counts, 1)
        ref = min(range(len(levels)), key=lambda j: (-counts[j], means[j], str(levels[j])))
        order = [ref] + [j for j in range(len(levels)) if j != ref]
        recode = np.empty(len(levels), np.int64)
        recode[order] = np.arange(len(levels))
        code = recode[inverse]
        alias = next((f for f, c in zip(factors, codes, strict=True) if _same_partition(c, code)), None)
        if alias is not None:
            names[alias].append(name)
            continue
        factors.append(name)
        codes.append(code)
        names[name] = [name]
        levels_by = [str(levels[j]) for j in order]
        names[name + "\0levels"] = levels_by
    if keep_levels:
        out.levels_of = {k: {f: raw[f][i] for f in raw} for i, k in enumerate(keys)}
    if not factors:
        return out
    level_names = [names[f + "\0levels"] for f in factors]
    display = [" = ".join(names[f]) for f in factors]
    fit = _fit(y, np.stack(codes, axis=1), [len(lv) for lv in level_names], resamples, seed)
    out.cells, out.r2 = fit["cells"], fit["r2"]
    lo_q, hi_q = alpha / 2, 1 - alpha / 2
    for fi, name in enumerate(display):
        best = fit["main"][fi]
        levels = level_names[fi]
        if best is None:
            nest = [display[g] for g in range(len(factors)) if g != fi and _nested(codes[fi], codes[g])]
            note = "not separable" + (f": nested in {', '.join(nest)}" if nest else " from the other factors")
            out.factors.append(FactorEffect(name, levels, None, levels[0], None, None, False, note))
            continue
        level, effect, reps = best
        ci = _ci(reps, lo_q, hi_q)
        sig = ci is not None and (ci[0] > 0 or ci[1] < 0)
        out.factors.append(FactorEffect(name, levels, levels[level], levels[0], effect, ci, sig))
    ranked = sorted(out.factors, key=lambda f: (f.effect is None, -abs(f.effect or 0.0), f.factor))
    for i, f in enumerate(ranked, 1):
        f.rank = i
    out.factors = ranked
    for (fi, gi), found in fit["pairs"].items():
        refs = (level_names[fi][0], level_names[gi][0])
        if found is None:
            out.interactions.append(
                Interaction(
                    (display[fi], display[gi]),
                    None,
                    refs,
                    None,
                    None,
                    False,
                    "no identified interaction (levels never crossed)",
                )
            )
            continue
        (lf, lg), effect, reps = found
        ci = _ci(reps, lo_q, hi_q)
        sig = ci is not None and (ci[0] > 0 or ci[1] < 0)
        out.interactions.append(
            Interaction(
                (display[fi], display[gi]), (level_names[fi][lf], level_names[gi][lg]), refs, effect, ci, sig
            )
        )
    out.interactions.sort(key=lambda i: (i.effect is None, -abs(i.effect or 0.0)))
    return out


def _ci(reps: np.ndarray, lo: float, hi: float) -> tuple[float, float] | None:
    reps = reps[np.isfinite(reps)]
    if not len(reps):
        return None
    a, b = np.quantile(reps, [lo, hi])
    return float(a), float(b)


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return _nested(a, b) and _nested(b, a)


def _nested(coarse: np.ndarray, fine: np.ndarray) -> bool:
    """Every level of `fine` falls in one level of `coarse` (coarse is a function of fine)."""
    pairs = np.unique(np.stack([fine, coarse], axis=1), axis=0)
    return len(np.unique(pairs[:, 0])) == len(pairs)


def _design(cell_codes: np.ndarray, nlevels: list[int]) -> tuple[np.ndarray, dict, dict]:
    """Treatment-coded design rows for cells (C x F level codes): intercept, main effects, pairwise
    interactions (only level pairs that occur in some cell). Returns X and the column of each term."""
    main_cols, pair_cols = {}, {}
    columns = [np.ones(len(cell_codes))]
    for f, k in enumerate(nlevels):
        for level in range(1, k):
            main_cols[(f, level)] = len(columns)
            columns.append((cell_codes[:, f] == level).astype(np.float64))
    for f, g in combinations(range(len(nlevels)), 2):
        for lf in range(1, nlevels[f]):
            for lg in range(1, nlevels[g]):
                col = ((cell_codes[:, f] == lf) & (cell_codes[:, g] == lg)).astype(np.float64)
                if col.any():
                    pair_cols[(f, g, lf, lg)] = len(columns)
                    columns.append(col)
    return np.stack(columns, axis=1), main_cols, pair_cols


def _rows(codes: np.ndarray, nlevels: list[int], main_cols: dict, pair_cols: dict, width: int) -> np.ndarray:
    """Design rows for arbitrary level combinations (possibly unobserved), with the observed columns."""
    x = np.zeros((len(codes), width))
    x[:, 0] = 1
    for (f, level), j in main_cols.items():
        x[:, j] = codes[:, f] == level
    for (f, g, lf, lg), j in pair_cols.items():
        x[:, j] = (codes[:, f] == lf) & (codes[:, g] == lg)
    return x


def _fit(y: np.ndarray, codes: np.ndarray, nlevels: list[int], resamples: int, seed: int) -> dict:
    cells, cell_of = np.unique(codes, axis=0, return_inverse=True)
    cell_of = cell_of.ravel()
    c = len(cells)
    x, main_cols, pair_cols = _design(cells, nlevels)
    p = x.shape[1]
    # per cell: counts and sums, for the data (ones) and every resample (Poisson weights)
    order = np.argsort(cell_of, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(cell_of[order]) != 0])
    w = bootstrap_weights(len(y), resamples, seed)[order].astype(np.float64)
    n_b = np.add.reduceat(w, starts, axis=0).T  # (B x C)
    s_b = np.add.reduceat(w * y[order][:, None], starts, axis=0).T
    n0 = np.bincount(cell_of, minlength=c).astype(np.float64)
    s0 = np.bincount(cell_of, y, minlength=c)
    beta0 = _solve(x[None], n0[None], s0[None])[0]
    fitted = x @ beta0
    sst = float(((y - y.mean()) ** 2).sum())
    ssr = float(((y - fitted[cell_of]) ** 2).sum())
    betas = _solve(np.broadcast_to(x, (resamples, c, p)), n_b, s_b)
    proj = np.linalg.pinv(x) @ x  # the row space of the design: what the data identify

    def identified(vec: np.ndarray) -> bool:
        return bool(np.linalg.norm(proj @ vec - vec) <= 1e-8 * max(1.0, np.linalg.norm(vec)))

    main = []
    for f, k in enumerate(nlevels):
        ref_codes = cells.copy()
        ref_codes[:, f] = 0
        x_ref = _rows(ref_codes, nlevels, main_cols, pair_cols, p)
        best = None
        for level in range(1, k):
            lv = cells.copy()
            lv[:, f] = level
            delta = _rows(lv, nlevels, main_cols, pair_cols, p) - x_ref  # (C x p) per cell
            vec = n0 @ delta / n0.sum()
            if not identified(vec):
                continue
            effect = float(vec @ beta0)
            if best is None or abs(effect) > abs(best[1]):
                vec_b = (n_b @ delta) / n_b.sum(axis=1, keepdims=True)  # the resample's own mix of cells
                best = (level, effect, np.einsum("bp,bp->b", vec_b, betas))
        main.append(best)
    pairs = {}
    for f, g in combinations(range(len(nlevels)), 2):
        best = None
        for (ff, gg, lf, lg), j in pair_cols.items():
            if (ff, gg) != (f, g):
                continue
            e = np.zeros(p)
            e[j] = 1
            if identified(e) and (best is None or abs(beta0[j]) > abs(best[1])):
                best = ((lf, lg), float(beta0[j]), betas[:, j])
        pairs[(f, g)] = best
    return {"cells": c, "r2": None if sst == 0 else 1 - ssr / sst, "main": main, "pairs": pairs}


def _solve(x: np.ndarray, n: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Weighted least squares on cell means for each stack entry: min sum_c n_c (mean_c - x_c b)^2, the
    minimum-norm solution (pseudo-inverse) so unidentified directions stay at 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, s / np.where(n > 0, n, 1), 0.0)
    r = np.sqrt(n)
    a = x * r[:, :, None]
    return np.einsum("bpc,bc->bp", np.linalg.pinv(a), r * mean)


# ---- presentation (query --attribution) ------------------------------------------------------------

COLUMNS = (
    "kind",
    "rank",
    "factor",
    "level",
    "reference",
    "effect",
    "ci_low",
    "ci_high",
    "significant",
    "levels",
    "note",
)


def rows(result: Attribution) -> list[tuple]:
    out = []
    for f in result.factors:
        out.append(
            (
                "factor",
                f.rank,
                f.factor,
                f.level,
                f.reference,
                _r(f.effect),
                *_ci_r(f.ci),
                f.significant,
                len(f.levels),
                f.note,
            )
        )
    for i in result.interactions:
        out.append(
            (
                "interaction",
                None,
                " x ".join(i.factors),
                None if i.levels is None else ", ".join(i.levels),
                ", ".join(i.references),
                _r(i.effect),
                *_ci_r(i.ci),
                i.significant,
                None,
                i.note,
            )
        )
    for name, why in sorted(result.skipped.items()):
        out.append(("skipped", None, name, None, None, None, None, None, False, None, why))
    return out


def summary(result: Attribution) -> str:
    unit = f" ({result.unit})" if result.unit else ""
    r2 = "-" if result.r2 is None else f"{result.r2:.3f}"
    level = round(100 * (1 - result.alpha), 2)
    return (
        f"attribution of {result.label}{unit} over {result.requests} requests: main effects + pairwise"
        f" interactions on {result.cells} cells, R^2 {r2}; effect = largest level contrast vs the"
        f" reference level, {level:g}% percentile intervals (Poisson bootstrap over requests,"
        f" {result.resamples} resamples, seed 0)"
    )


def _r(v):
    return None if v is None else round(v, 6)


def _ci_r(ci):
    return (None, None) if ci is None else (round(ci[0], 6), round(ci[1], 6))
