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

Design: in a paired store (shadow scoring: a shadow scores its primary's prompt and tokens; mirrored
traffic: the same prompt hash on both servers) the prompts' own spread swamps a variant's effect when
requests are the units. So when some prompt block (compare's pairing key: the prompt key, joined with
a shadow's primary) holds requests at 2+ levels of some factor, the fit absorbs the blocks ("blocked
by prompt"): a fixed effect per block, by Frisch-Waugh-Lovell (metric and design demeaned within
block, a direct weighted least squares on the deviations), and the bootstrap draws one Poisson weight
per block. A term that varies within no block (a factor constant within each prompt, like its intent)
comes from the cell-means fit under the same block weights, noted "between prompts". Without any
such block the design is "requests", as above.
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
    design: str = "requests"  # or "blocked by prompt": see attribution()
    blocks: int = 0  # blocked: the prompt blocks of 2+ requests (the bootstrap's units with them)
    factors: list[FactorEffect] = field(default_factory=list)
    interactions: list[Interaction] = field(default_factory=list)
    skipped: dict = field(default_factory=dict)  # factor -> why it is not in the model
    levels_of: dict = field(default_factory=dict)  # (pid, request key) -> {factor: level}, for explain


_ANY = "any_value(request_seq) AS request_seq, any_value(model_id) AS model_id, any_value(tenant) AS tenant"
_TRACE = "any_value(trace_id) AS trace_id"  # after y: the request's prompt key, see request_blocks


def _metric_sql(metric: str, live: str = "true") -> str:
    """`live`: the condition on token_steps that keeps live rows (a shadow's rows are its scoring pass:
    their latency is not a served latency, and the anomaly lane does not score them)."""
    k = request_key()
    if metric == "loss":
        return f"""SELECT pid, {k} AS rkey, {_ANY}, avg(loss) FILTER (isfinite(loss)) AS y,
            {_TRACE} FROM token_steps GROUP BY ALL"""
    if metric == "latency":
        return f"""SELECT pid, {k} AS rkey, {_ANY}, avg(latency_ns) FILTER (step > 0) / 1e6 AS y,
            {_TRACE} FROM token_steps WHERE {live} GROUP BY ALL"""
    if metric == "anomaly":
        return f"""WITH t AS (SELECT pid, {k} AS rkey, step_seq, coalesce(batch_row, 0) AS row, step,
                request_seq, model_id, tenant, trace_id FROM token_steps WHERE {live}),
            a AS (SELECT pid, step_seq, coalesce(batch_row, 0) AS row, step, trace_id, count(*) AS n
                  FROM anomalies GROUP BY ALL)
            SELECT t.pid, t.rkey, any_value(t.request_seq) AS request_seq, any_value(t.model_id) AS model_id,
                any_value(t.tenant) AS tenant, coalesce(sum(a.n), 0) / count(*) AS y,
                any_value(t.trace_id) AS trace_id
            FROM t LEFT JOIN a ON a.pid = t.pid AND a.step_seq = t.step_seq AND a.row = t.row
                AND (a.step IS NULL OR a.step = t.step) AND (a.trace_id IS NULL OR a.trace_id = t.trace_id)
            GROUP BY t.pid, t.rkey"""
    raise ValueError(metric)


def _tables(conn) -> set[str]:
    return {r[0] for r in conn.execute("SELECT table_name FROM duckdb_tables()").fetchall()}


def request_factors(conn, metric: str) -> tuple[list[tuple], np.ndarray, dict[str, list], np.ndarray]:
    """(request keys, y, {factor: level per request}, prompt block per request) for every request with
    a finite metric."""
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
    blocks = request_blocks(conn, keys, [r[6] for r in rows], labels, tables)
    return keys, y, {k: ["(none)" if v is None else v for v in vals] for k, vals in factors.items()}, blocks


def request_blocks(conn, keys: list[tuple], traces: list, labels: dict, tables: set[str]) -> np.ndarray:
    """Block id per request: requests on the same prompt, by compare's pairing key (llmobs.diagnostics
    .compare): the prompt key (request_events.prompt_hash when the trace id came from a caller, else
    the trace id, which is the prompt hash) across processes, joined with a shadow's primary (its
    `shadow_of` label). A request without either is a block of its own."""
    prompt_hash: dict[tuple, str] = {}
    if "request_events" in tables:
        prompt_hash = {
            (pid, -seq): ph
            for pid, seq, ph in conn.execute(
                "SELECT DISTINCT pid, request_seq, prompt_hash FROM request_events WHERE kind = 'end'"
                " AND request_seq <> 0 AND trace_from_caller AND prompt_hash <> ''"
            ).fetchall()
        }
    parent = list(range(len(keys)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    index = {k: i for i, k in enumerate(keys)}
    first_of: dict[str, int] = {}
    for i, k in enumerate(keys):
        prompt = prompt_hash.get(k, traces[i])
        if prompt is not None:
            parent[root(i)] = root(first_of.setdefault(prompt, i))
        primary = labels.get((k[0], -k[1]), {}).get("shadow_of") if k[1] < 0 else None
        j = index.get((k[0], -int(primary))) if primary is not None and str(primary).isdigit() else None
        if j is not None:
            parent[root(i)] = root(j)
    _, blocks = np.unique([root(i) for i in range(len(keys))], return_inverse=True)
    return blocks.ravel().astype(np.int64)


def attribution(
    conn,
    metric: str = "loss",
    *,
    resamples: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
    keep_levels: bool = False,
    block_on_prompt: bool = True,
) -> Attribution:
    """The matrix of `metric`. Design: when some prompt block (request_blocks) holds requests at 2+
    levels of some factor, the blocks are absorbed and resampled ("blocked by prompt"): a paired design
    (shadow scoring, mirrored traffic) then compares requests on the same prompt, and the prompts' own
    spread drops out of the effects and their intervals. Otherwise (or `block_on_prompt` False) units
    are requests ("requests")."""
    label, unit = METRICS[metric]
    keys, y, raw, blocks = request_factors(conn, metric)
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
    stacked = np.stack(codes, axis=1)
    blocked = block_on_prompt and _varies_within_a_block(stacked, blocks)
    if blocked:
        out.design = "blocked by prompt"
        out.blocks = int((np.bincount(blocks) >= 2).sum())
    fit = _fit(y, stacked, [len(lv) for lv in level_names], resamples, seed, blocks if blocked else None)
    out.cells, out.r2 = fit["cells"], fit["r2"]
    between = "between prompts: constant within each prompt, so not blocked"
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
        note = between if fit["basis"][("main", fi)] == "between" else ""
        out.factors.append(FactorEffect(name, levels, levels[level], levels[0], effect, ci, sig, note))
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
                (display[fi], display[gi]),
                (level_names[fi][lf], level_names[gi][lg]),
                refs,
                effect,
                ci,
                sig,
                between if fit["basis"][("pair", (fi, gi))] == "between" else "",
            )
        )
    out.interactions.sort(key=lambda i: (i.effect is None, -abs(i.effect or 0.0)))
    return out


def _varies_within_a_block(codes: np.ndarray, blocks: np.ndarray) -> bool:
    """Some prompt block holds requests at 2+ levels of some factor (then blocking has something to
    compare within a prompt; otherwise the fit stays on requests, as without any pairing)."""
    for column in codes.T:
        pairs = np.unique(np.stack([blocks, column], axis=1), axis=0)
        if len(np.unique(pairs[:, 0])) < len(pairs):
            return True
    return False


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


def _fit(
    y: np.ndarray,
    codes: np.ndarray,
    nlevels: list[int],
    resamples: int,
    seed: int,
    blocks: np.ndarray | None = None,
) -> dict:
    """The model and its bootstrap. `blocks` None: units are requests (the cell-means fit, a Poisson
    weight per request). `blocks` given: the prompt blocks are absorbed (_fit_within) and the bootstrap
    draws one Poisson weight per block; a term the within-block fit does not identify (a factor
    constant within every block) comes from the cell-means fit under the same block weights, marked
    "between" in `basis`."""
    cells, cell_of = np.unique(codes, axis=0, return_inverse=True)
    cell_of = cell_of.ravel()
    c = len(cells)
    x, main_cols, pair_cols = _design(cells, nlevels)
    p = x.shape[1]
    if blocks is None:
        w_request = bootstrap_weights(len(y), resamples, seed)
    else:
        w_block = bootstrap_weights(int(blocks.max()) + 1, resamples, seed)
        w_request = w_block[blocks]
    # per cell: counts and sums, for the data (ones) and every resample (Poisson weights)
    order = np.argsort(cell_of, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(cell_of[order]) != 0])
    w = w_request[order].astype(np.float64)
    n_b = np.add.reduceat(w, starts, axis=0).T  # (B x C)
    s_b = np.add.reduceat(w * y[order][:, None], starts, axis=0).T
    n0 = np.bincount(cell_of, minlength=c).astype(np.float64)
    s0 = np.bincount(cell_of, y, minlength=c)
    beta0 = _solve(x[None], n0[None], s0[None])[0]
    fitted = x @ beta0
    sst = float(((y - y.mean()) ** 2).sum())
    ssr = float(((y - fitted[cell_of]) ** 2).sum())
    betas = _solve(np.broadcast_to(x, (resamples, c, p)), n_b, s_b)
    terms = (cells, nlevels, main_cols, pair_cols, n0, n_b)
    main, pairs = _contrasts(*terms, beta0, betas, np.linalg.pinv(x) @ x)
    out = {"cells": c, "r2": None if sst == 0 else 1 - ssr / sst, "main": main, "pairs": pairs}
    out["basis"] = {("main", f): "requests" for f in range(len(main))}
    out["basis"].update({("pair", fg): "requests" for fg in pairs})
    if blocks is None:
        return out
    beta_w, betas_w, proj_w, r2_w = _fit_within(y, x, cell_of, blocks, w_block)
    main_w, pairs_w = _contrasts(*terms, beta_w, betas_w, proj_w)
    out["r2"] = r2_w
    for f, found in enumerate(main_w):
        out["basis"][("main", f)] = "within" if found is not None else "between"
        out["main"][f] = found if found is not None else main[f]
    for fg, found in pairs_w.items():
        out["basis"][("pair", fg)] = "within" if found is not None else "between"
        out["pairs"][fg] = found if found is not None else pairs[fg]
    return out


def _fit_within(
    y: np.ndarray, x: np.ndarray, cell_of: np.ndarray, blocks: np.ndarray, w_block: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float | None]:
    """The fit with a fixed effect per prompt block, by Frisch-Waugh-Lovell: the metric and every design
    column demeaned within block, then least squares on the deviations (exact for any balance). A
    block's requests share its bootstrap weight, so a resample's weighted block means are the
    unweighted ones and one demeaning serves every resample; a block of one request has zero deviations
    and drops out. Requests of one block and one cell share their demeaned design row: the fit runs on
    those (block, cell) units, the resamples on their Gram matrices (the cell-means shortcut does not
    survive demeaning: a cell's rows differ by block). Returns (beta, betas per resample, the projection
    onto the design's row space, the within-block R^2)."""
    nblocks = len(w_block)
    size = np.bincount(blocks, minlength=nblocks).astype(np.float64)
    y_dev = y - (np.bincount(blocks, y, minlength=nblocks) / size)[blocks]
    x_request = x[cell_of]
    x_mean = (
        np.stack([np.bincount(blocks, x_request[:, j], minlength=nblocks) for j in range(x.shape[1])], axis=1)
        / size[:, None]
    )
    units, unit_of = np.unique(np.stack([blocks, cell_of], axis=1), axis=0, return_inverse=True)
    unit_of = unit_of.ravel()
    x_dev = x[units[:, 1]] - x_mean[units[:, 0]]  # (U x p)
    n_u = np.bincount(unit_of, minlength=len(units)).astype(np.float64)
    s_u = np.bincount(unit_of, y_dev, minlength=len(units))
    beta = _solve(x_dev[None], n_u[None], s_u[None])[0]
    sst = float((y_dev**2).sum())
    ssr = float(((y_dev - (x_dev @ beta)[unit_of]) ** 2).sum())
    # the resamples' Gram matrices sum_u w_bu n_u x_u x_u' (their upper triangles) over the units that
    # carry information (a block of one request, or one whose levels never vary, has zero deviations),
    # in chunks of units so the outer products stay ~32 MB
    live = np.flatnonzero(np.abs(x_dev).sum(axis=1) > 0)
    p = x.shape[1]
    upper = np.triu_indices(p)
    w_u = w_block[units[live, 0]].astype(np.float64).T  # (B x U): a unit's weight is its block's
    triangle = np.zeros((w_u.shape[0], len(upper[0])))
    chunk = max(1, (4 << 20) // len(upper[0]))
    for start in range(0, len(live), chunk):
        part = x_dev[live[start : start + chunk]]
        weights = w_u[:, start : start + chunk] * n_u[live[start : start + chunk]]
        triangle += weights @ (part[:, upper[0]] * part[:, upper[1]])
    gram = np.zeros((w_u.shape[0], p, p))
    gram[:, upper[0], upper[1]] = triangle
    gram[:, upper[1], upper[0]] = triangle
    rhs = (w_u * s_u[live]) @ x_dev[live]
    # minimum-norm solutions, as _solve: a Gram matrix squares the design's condition, hence its rcond
    betas = np.einsum("bpq,bq->bp", np.linalg.pinv(gram, rcond=1e-10, hermitian=True), rhs)
    proj = np.linalg.pinv(x_dev) @ x_dev
    return beta, betas, proj, None if sst == 0 else 1 - ssr / sst


def _contrasts(cells, nlevels, main_cols, pair_cols, n0, n_b, beta0, betas, proj) -> tuple[list, dict]:
    """Each factor's largest identified level contrast and each pair's largest identified interaction,
    with their bootstrap replicates; None where the design (its row space: `proj`) identifies none."""
    p = len(beta0)

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
                with np.errstate(invalid="ignore", divide="ignore"):  # an empty resample: NaN, dropped
                    vec_b = (n_b @ delta) / n_b.sum(axis=1, keepdims=True)  # its own mix of cells
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
    return main, pairs


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


DESIGN_COLUMNS = ("design", "blocks")  # csv and json: on every row (the table says it in its header)


def rows(result: Attribution, design: bool = False) -> list[tuple]:
    """Rows of COLUMNS; with `design`, of COLUMNS + DESIGN_COLUMNS."""
    out = _rows_of(result)
    return [(*r, result.design, result.blocks) for r in out] if design else out


def _rows_of(result: Attribution) -> list[tuple]:
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
    if result.design == "blocked by prompt":
        design = f", blocked by prompt ({result.blocks} prompts with 2+ requests)"
        r2, units = f"within-prompt R^2 {r2}", "prompt blocks"
    else:
        design, r2, units = "", f"R^2 {r2}", "requests"
    return (
        f"attribution of {result.label}{unit} over {result.requests} requests{design}: main effects +"
        f" pairwise interactions on {result.cells} cells, {r2}; effect = largest level contrast vs the"
        f" reference level, {level:g}% percentile intervals (Poisson bootstrap over {units},"
        f" {result.resamples} resamples, seed 0)"
    )


def _r(v):
    return None if v is None else round(v, 6) + 0.0  # + 0.0: no "-0.0" in the output


def _ci_r(ci):
    return (None, None) if ci is None else (_r(ci[0]), _r(ci[1]))
