"""GenAI server metrics of served requests, from their request-end rows (request_events), as the
OpenTelemetry GenAI semantic conventions define them (docs/otlp.md cites the version followed):

    gen_ai.server.request.duration        s  arrival -> end, every request (error.type when it failed)
    gen_ai.server.time_to_first_token     s  arrival -> first token, successful requests
    gen_ai.server.time_per_output_token   s  (last token - first token) / (output tokens - 1), successful
                                             requests with at least two output tokens

each with the convention's explicit bucket boundaries and its attributes gen_ai.operation.name,
gen_ai.provider.name and gen_ai.request.model, plus llmobs.tenant. Token usage (gen_ai.usage.input_tokens /
output_tokens) is a span attribute in the conventions: it is on the request span (llmobs.otlp.served).

Cardinality: llmobs.tenant takes at most TENANT_CAP distinct values per exporter; later tenants are folded
into TENANT_OTHER and counted in `TenantCap.folded` (requests) and `.folded_tenants` (distinct tenants).
Each bucket's exemplar points at the request span.
"""

from __future__ import annotations

from llmobs.otlp.served import ERROR_REASONS, PROVIDER

# Explicit bucket boundaries (seconds) the conventions give for each histogram.
REQUEST_DURATION_BOUNDS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
TIME_TO_FIRST_TOKEN_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                              7.5, 10.0)  # fmt: skip
TIME_PER_OUTPUT_TOKEN_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TENANT_CAP = 64  # distinct llmobs.tenant values on the metrics; the rest fold into TENANT_OTHER
TENANT_OTHER = "other"

DESCRIPTIONS = {
    "gen_ai.server.request.duration": (
        "s",
        "Generative AI server request duration such as time-to-last byte or last output token",
    ),
    "gen_ai.server.time_to_first_token": ("s", "Time to generate first token for successful responses"),
}


class TenantCap:
    """The first TENANT_CAP tenants keep their name on the metrics; later ones read TENANT_OTHER."""

    def __init__(self, cap: int = TENANT_CAP):
        self.cap = cap
        self.kept: set[str] = set()
        self.folded_tenants: set[str] = set()  # bounded by what it holds: names only, no series
        self.folded = 0  # requests whose tenant was folded

    def label(self, tenant: str) -> str:
        if tenant in self.kept or not tenant:
            return tenant
        if len(self.kept) < self.cap:
            self.kept.add(tenant)
            return tenant
        self.folded += 1
        if len(self.folded_tenants) < 1 << 16:
            self.folded_tenants.add(tenant)
        return TENANT_OTHER


def served_points(rows: list[dict], operation: str, tenants: TenantCap) -> list[tuple]:
    """(histogram, attributes, bounds, value in seconds, row) for each request-end row: what
    MetricsAggregator records (its exemplar: the row's request span, llmobs.otlp.served)."""
    points = []
    for row in rows:
        reason = row["finish_reason"] or ""
        attrs = (
            ("gen_ai.operation.name", operation),
            ("gen_ai.provider.name", PROVIDER),
            ("gen_ai.request.model", row["model_id"] or ""),
            ("llmobs.tenant", tenants.label(row["tenant"] or "")),
        )
        end = int(row["t_end_ns"])
        duration = max(end - int(row["t_start_ns"] or end), 0) / 1e9
        if reason in ERROR_REASONS:  # failed: its duration, with error.type; no TTFT/TPOT (successful only)
            points.append(("gen_ai.server.request.duration", (*attrs, ("error.type", reason)),
                           REQUEST_DURATION_BOUNDS, duration, row))  # fmt: skip
            continue
        points.append(("gen_ai.server.request.duration", attrs, REQUEST_DURATION_BOUNDS, duration, row))
        ttft, tpot = row["ttft_ns"], row["tpot_ns"]
        if ttft is not None and ttft >= 0:
            points.append(
                ("gen_ai.server.time_to_first_token", attrs, TIME_TO_FIRST_TOKEN_BOUNDS, ttft / 1e9, row)
            )
        if tpot is not None and tpot >= 0:
            tpot_s = tpot / 1e9
            points.append(
                ("gen_ai.server.time_per_output_token", attrs, TIME_PER_OUTPUT_TOKEN_BOUNDS, tpot_s, row)
            )
    return points
