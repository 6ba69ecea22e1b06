"""Issue 8, security: raw prompt text is never stored or exported; only its hash is.

A real workload (tiny GPT-2, byte tokenizer) generates from its known prompts while `attach --db --otlp`
ingests and exports to a real collector (rotel on loopback). Afterwards no prompt's text appears in any
column of any table of the store, in the store's files as raw bytes, or in anything the collector
received. The control: the prompt's hash (the trace id the publisher derives from the prompt's token
ids) IS in the store and on the exported spans, so the search looks where the prompt would be.

There is no opt-in to store prompt text: the publisher never receives text (it sees token ids and
hashes them in-process), so no code path could carry it; docs/reliability.md says why none was added.
"""

from __future__ import annotations

import signal
from pathlib import Path

import duckdb
import numpy as np
from llmobs.shm.hashing import trace_id, trace_words
from test_attach import Agent

from bench.held_workload import HeldWorkload
from bench.rotel_harness import Rotel

REQUESTS, TOKENS = 4, 4


def _prompts() -> list[str]:
    from llmobs.workloads.generate import PROMPTS  # the prompts the workload generates from, in order

    return list(PROMPTS[:REQUESTS])


def _prompt_hash(prompt: str) -> str:
    """The trace id the publisher gives a request with this prompt (the byte tokenizer: ids = bytes)."""
    hi, lo = trace_words(trace_id(np.frombuffer(prompt.encode(), dtype=np.uint8).astype(np.int64)))
    return f"{hi:016x}{lo:016x}"


def _needles(prompts: list[str]) -> list[str]:
    """Each prompt whole and a distinctive piece of it (any 16 bytes of text would be a leak too)."""
    return sorted({n for p in prompts for n in (p, p[:16], p[-16:])})


def _store_hits(db: Path, needles: list[str]) -> list[str]:
    """table.column: needle, for every column whose text form contains a needle. One statement per table
    counts the rows of each (column, needle) pair (one statement per pair: ~3,000 of them, 4 s)."""
    hits = []
    params = {f"n{i}": needle for i, needle in enumerate(needles)}
    with duckdb.connect(str(db), read_only=True) as con:
        columns = con.execute(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'main'"
        ).fetchall()
        tables: dict[str, list[str]] = {}
        for table, column in columns:
            tables.setdefault(table, []).append(column)
        for table, names in tables.items():
            pairs = [(column, i) for column in names for i in range(len(needles))]
            counts = con.execute(
                "SELECT "
                + ", ".join(f'count(*) FILTER (contains(CAST("{c}" AS VARCHAR), $n{i}))' for c, i in pairs)
                + f' FROM "{table}"',
                params,
            ).fetchone()
            hits += [
                f"{table}.{c}: {needles[i]!r}" for (c, i), found in zip(pairs, counts, strict=True) if found
            ]
    return hits


def test_prompt_text_is_never_stored_or_exported_only_its_hash(tmp_path):
    prompts = _prompts()
    needles = _needles(prompts)
    db = tmp_path / "store.duckdb"
    args = ("--model", "tiny", "--requests", str(REQUESTS), "--max-new-tokens", str(TOKENS), "--threads", "1")
    with Rotel(tmp_path / "rotel") as collector:
        with HeldWorkload(*args) as workload:
            agent = Agent("--pid", str(workload.pid), "--profile", "cpu,host", "--db", str(db),
                          "--otlp", collector.grpc_endpoint)  # fmt: skip
            agent.wait_for("attached in")
            workload.generate()
            agent.proc.send_signal(signal.SIGINT)
            code, text = agent.finish()
            assert code == 0, text
        collector.stop()
        received = collector.text()
        spans = collector.spans()

    # the control: the prompts' hashes are where the prompts would be, in the store and on the spans
    hashes = {_prompt_hash(p) for p in prompts}
    with duckdb.connect(str(db), read_only=True) as con:
        stored = {row[0] for row in con.execute("SELECT DISTINCT trace_id FROM token_steps").fetchall()}
    assert hashes <= stored, (hashes, stored)
    exported = {s.attributes.get("llmobs.prompt_hash") for s in spans if not s.parent_id}
    assert hashes <= exported, (hashes, exported)
    assert sum(s.name == "gen_ai.token_step" for s in spans) == REQUESTS * TOKENS

    assert _store_hits(db, needles) == []
    for path in [p for p in tmp_path.rglob("*") if p.is_file() and "rotel" not in p.parts]:
        data = path.read_bytes()
        assert not [n for n in needles if n.encode() in data], f"prompt text in {path}"
    assert not [n for n in needles if n in received], "prompt text reached the collector"
    assert not [n for n in needles if n in text], "prompt text in the agent's output"
