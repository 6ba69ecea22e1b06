"""docs/grafana.md stays true to the exporter: its dashboard JSON parses, and every metric series,
label and span attribute it queries is one the exporter emits (under Prometheus's OTLP translation)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from llmobs.otlp import encoder, metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"


def dashboard() -> dict:
    text = (DOCS / "grafana.md").read_text()
    block = re.search(r"```json\n(.*?)\n```", text, re.S)
    assert block, "docs/grafana.md has no ```json block"
    return json.loads(block.group(1))


def prometheus_names() -> set[str]:
    """Series names of our metrics as Prometheus's default OTLP translation writes them."""
    names = set()
    for name, (unit, _) in metrics._DESCRIPTIONS.items():
        base = name.replace(".", "_") + ("_seconds" if unit == "s" else "")
        names.update({f"{base}_bucket", f"{base}_sum", f"{base}_count", f"{base}_total"})
    return names


def span_attributes() -> set[str]:
    names = {a for _, a in encoder.STEP_ATTRIBUTES + encoder.ROLLUP_ATTRIBUTES + encoder.EVENT_ATTRIBUTES}
    return names | {"gen_ai.operation.name", "gen_ai.usage.output_tokens", "llmobs.request.mean_loss"}


def test_dashboard_queries_name_only_what_the_exporter_emits():
    board = dashboard()
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"] if "expr" in t]
    traceql = [t["query"] for p in board["panels"] for t in p["targets"] if t.get("queryType") == "traceql"]
    assert len(exprs) >= 5 and len(traceql) == 3
    known = prometheus_names()
    labels = {"le", "gen_ai_request_model", "llmobs_tenant", "llmobs_kernel_class"}
    for expr in exprs:
        for series in re.findall(r"\b((?:gen_ai|llmobs)_[a-z_]+)\[", expr.replace("{", "[")):
            assert series in known, f"{series} is not an exported series"
        for label in re.findall(r"by \(([^)]*)\)", expr):
            assert {x.strip() for x in label.split(",")} <= labels
    attributes = span_attributes()
    for query in traceql:
        for attribute in re.findall(r"span\.([a-z_.0-9]+)", query):
            assert attribute in attributes, f"span.{attribute} is not exported"
        assert '"gen_ai.token_step"' in query and encoder.STEP_SPAN_NAME == "gen_ai.token_step"


def test_traceql_examples_use_exported_attributes():
    text = (DOCS / "grafana.md").read_text()
    attributes = span_attributes()
    used = set(re.findall(r"span\.((?:llmobs|gen_ai)\.[a-z_.0-9]+)", text))
    assert used and used <= attributes, used - attributes
    # Kernel names are never metric labels: the dashboard groups GPU time by class only.
    assert "llmobs_kernel_name" not in text


def test_otlp_doc_lists_every_attribute():
    text = (DOCS / "otlp.md").read_text()
    missing = {a for a in span_attributes() if f"`{a}`" not in text}
    assert not missing, missing
    assert all(f"`{name}`" in text for name in metrics._DESCRIPTIONS)
