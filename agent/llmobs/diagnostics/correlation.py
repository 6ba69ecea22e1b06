"""The anomaly correlation matrix: how each layer stream (kind x layer x head) moves with the token-loss
anomalies, over the sampled steps in the store.

For every stream, each sampled (pid, step_seq, trace_id) is one observation: the stream's value there,
standardised within its own (pid, stream) so processes with other scales do not mix, and a label y = 1
when that token step has an anomaly row (any of `kinds`; default: every kind), else 0. Per stream:
- r: the point-biserial correlation of value and y (Pearson's r against a 0/1 variable, DuckDB corr);
- d: the standardised difference, mean z-value on anomalous steps minus mean on normal steps;
- n, n_anomalous: observations behind them. r and d are NULL without both kinds of step.
A stream that rises on anomalous steps has r > 0; root cause uses |r| (llmobs.diagnostics.rootcause).
Module names come from `layer_modules` (registered by the workload), else "layer N <kind>".
"""

from __future__ import annotations

from dataclasses import dataclass

KIND_NAMES = {1: "attention_entropy", 2: "mlp_variance"}


def kind_name(kind: int) -> str:
    return KIND_NAMES.get(int(kind), f"kind{int(kind)}")


def fallback_module(layer: int, kind: int, head: int = -1) -> str:
    """The name a stream gets when the workload registered none."""
    head_part = f" head {head}" if head >= 0 else ""
    return f"layer {layer}{head_part} ({kind_name(kind)})"


@dataclass(frozen=True)
class StreamCorrelation:
    kind: int
    layer: int
    head: int
    module: str
    n: int
    n_anomalous: int
    r: float | None
    d: float | None


COLUMNS = ["kind", "stream", "layer", "head", "module", "n", "n_anomalous", "r", "d"]


def matrix_sql(kinds: list[str] | None = None) -> tuple[str, dict]:
    """(sql, params) of the matrix: one row per stream, COLUMNS, strongest |r| first. Params: $pid
    (NULL = every process) and $kinds (NULL = every anomaly kind)."""
    sql = """
    WITH s AS (
        SELECT pid, step_seq, trace_id, kind, layer, head, value FROM layer_streams
        WHERE ($pid IS NULL OR pid = $pid) AND isfinite(value)
    ),
    a AS (
        SELECT DISTINCT pid, step_seq, trace_id FROM anomalies
        WHERE ($pid IS NULL OR pid = $pid) AND ($kinds IS NULL OR list_contains($kinds, kind))
    ),
    labelled AS (
        SELECT s.*, CASE WHEN a.pid IS NULL THEN 0.0 ELSE 1.0 END AS y
        FROM s LEFT JOIN a USING (pid, step_seq, trace_id)
    ),
    z AS (
        SELECT *, (value - avg(value) OVER w) / nullif(stddev_pop(value) OVER w, 0) AS zv
        FROM labelled WINDOW w AS (PARTITION BY pid, kind, layer, head)
    ),
    names AS (SELECT kind, layer, min(module) AS module FROM layer_modules
              WHERE ($pid IS NULL OR pid = $pid) GROUP BY kind, layer)
    SELECT z.kind,
        CASE z.kind WHEN 1 THEN 'attention_entropy' WHEN 2 THEN 'mlp_variance'
             ELSE 'kind' || z.kind END AS stream,
        z.layer, z.head, names.module,
        count(*) AS n, sum(y)::BIGINT AS n_anomalous,
        CASE WHEN sum(y) > 0 AND sum(y) < count(*) THEN coalesce(corr(coalesce(zv, 0), y), 0) END AS r,
        avg(zv) FILTER (WHERE y = 1) - avg(zv) FILTER (WHERE y = 0) AS d
    FROM z LEFT JOIN names USING (kind, layer)
    GROUP BY z.kind, z.layer, z.head, names.module
    ORDER BY abs(r) DESC NULLS LAST, z.kind, z.layer, z.head
    """
    return sql, {"pid": None, "kinds": kinds}


def correlation_matrix(
    conn, pid: int | None = None, kinds: list[str] | None = None
) -> list[StreamCorrelation]:
    """The matrix for one process (or all), strongest |r| first."""
    sql, params = matrix_sql(kinds)
    params["pid"] = pid
    rows = conn.execute(sql, params).fetchall()
    out = []
    for kind, _stream, layer, head, module, n, n_anom, r, d in rows:
        name = module or fallback_module(layer, kind, head)
        if module and head >= 0:
            name = f"{module}[head {head}]"
        r = None if r is None else float(r)
        d = None if d is None else float(d)
        out.append(StreamCorrelation(int(kind), int(layer), int(head), name, int(n), int(n_anom), r, d))
    return out
