"""`llmobs-agent query`: canned views and SQL over a real store, in every format, and its error paths."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from llmobs.cli import main
from llmobs.errors import ExitCode
from llmobs.pipeline.correlate import correlate
from llmobs.store import DuckDBStore, synthetic


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "q.duckdb"
    with DuckDBStore(path) as store:
        # pid 1: 4 acme/globex requests, 2 decoded at a time; pid 2: 3 requests, one at a time, later.
        one = synthetic.token_steps(pid=1, requests=4, tokens_per_request=6, batch_rows=2, seed=1)
        two = synthetic.token_steps(
            pid=2, requests=3, tokens_per_request=5, seed=2, start_ns=9_000_000_000_000
        )
        steps = pa.concat_tables([one, two])
        assert store.export({"token_steps": steps, "events": synthetic.events_for_steps(steps, seed=3)}).ok
        assert store.export(
            {"probe_aggregates": synthetic.aggregates_for_steps(one, synthetic.DEFAULT_PROBES)}
        ).ok
        correlate(store.connection)
    return path


def _run(capsys, *argv):
    code = main(["query", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_slowest_steps_are_ordered_by_latency_and_filtered_by_tenant(db, capsys):
    code, out, _ = _run(
        capsys, "--slowest-steps", "-n", "5", "--tenant", "acme", "--db", str(db), "--format", "json"
    )
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 5 and {r["tenant"] for r in rows} == {"acme"}
    latencies = [r["latency_ms"] for r in rows]
    assert latencies == sorted(latencies, reverse=True)
    truth = (
        duckdb.connect(str(db), read_only=True)
        .execute("SELECT latency_ns FROM token_steps WHERE tenant = 'acme' ORDER BY latency_ns DESC LIMIT 5")
        .fetchall()
    )
    assert latencies == [round(t[0] / 1e6, 3) for t in truth]
    alloc = next(p for p in synthetic.DEFAULT_PROBES if p.probe == "alloc_cpu")
    assert all(r["allocations"] == alloc.count for r in rows)  # rollup columns joined to each step


def test_table_output_is_aligned_with_a_row_count(db, capsys):
    code, out, _ = _run(capsys, "--slowest-steps", "-n", "3", "--db", str(db))
    assert code == 0
    lines = out.rstrip("\n").split("\n")
    header, rule, *body, footer = lines
    assert footer == "(3 rows)" and len(body) == 3
    # Aligned: no cell of any line crosses the gaps between the rule's dashes.
    gaps = [i for i in range(len(rule)) if rule[i] == " "]
    assert len(header.split()) == len(rule.split()) == 17
    for line in [header, *body]:
        assert len(line) <= len(rule)
        assert all(i >= len(line) or line[i] == " " for i in gaps), line


def test_by_tenant_counts_tokens_and_peak_concurrency(db, capsys):
    code, out, _ = _run(capsys, "--by-tenant", "--db", str(db), "--format", "csv")
    assert code == 0
    rows = {r["tenant"]: r for r in csv.DictReader(io.StringIO(out))}
    # pid 1 decodes requests 0+1 together, then 2+3: acme (0, 2) and globex (1, 3) never overlap
    # themselves; pid 2 runs alone, later. So each tenant's peak concurrency is 1.
    assert set(rows) == {"acme", "globex"}
    assert int(rows["acme"]["tokens"]) == 2 * 6 + 2 * 5
    assert int(rows["globex"]["tokens"]) == 2 * 6 + 1 * 5
    assert int(rows["acme"]["requests"]) == 4 and int(rows["globex"]["requests"]) == 3
    assert rows["acme"]["concurrency"] == "1" and rows["globex"]["concurrency"] == "1"
    assert float(rows["acme"]["p50_ms"]) <= float(rows["acme"]["p99_ms"])


def test_concurrency_counts_overlapping_requests(tmp_path, capsys):
    path = tmp_path / "c.duckdb"
    # Three requests of one tenant: A [0, 100), B [50, 150), C [100, 200): at most two overlap (C starts
    # exactly when A ends, which is not an overlap).
    spans = [("a" * 32, 0, 100), ("b" * 32, 50, 150), ("c" * 32, 100, 200)]
    steps = pa.table(
        {
            "pid": pa.array([1] * 3, pa.int32()),
            "step_seq": [1, 2, 3],
            "trace_id": [s[0] for s in spans],
            "t_start_ns": [s[1] for s in spans],
            "t_end_ns": [s[2] for s in spans],
            "latency_ns": [100, 100, 100],
            "tenant": ["t"] * 3,
            "session": ["s1", "s1", "s2"],
            "loss": np.array([1.0, 2.0, np.nan], np.float32),
        }
    )
    with DuckDBStore(path) as store:
        assert store.export({"token_steps": steps}).ok
    code, out, _ = _run(capsys, "--by-session", "--db", str(path), "--format", "json")
    assert code == 0
    rows = {r["session"]: r for r in json.loads(out)}
    assert rows["s1"]["concurrency"] == 2 and rows["s2"]["concurrency"] == 1
    assert rows["s1"]["mean_loss"] == 1.5 and rows["s2"]["mean_loss"] is None  # NaN loss is not averaged


def test_top_probes_prefers_exact_counts(db, capsys):
    code, out, _ = _run(capsys, "--top-probes", "--db", str(db), "--format", "json")
    assert code == 0
    rows = {r["probe"]: r for r in json.loads(out)}
    alloc = next(p for p in synthetic.DEFAULT_PROBES if p.probe == "alloc_cpu")
    # 12 forward passes of pid 1 have exact aggregates; pid 2's 15 passes only sampled events.
    assert rows["alloc_cpu"]["exact"] is True
    assert rows["alloc_cpu"]["count"] == 12 * alloc.count
    assert rows["alloc_cpu"]["samples"] == (12 + 15) * alloc.count
    assert rows["alloc_cpu"]["class"] == "alloc"


def test_raw_sql_in_every_format(db, capsys):
    sql = "SELECT tenant, count(*) AS n FROM token_steps GROUP BY tenant ORDER BY tenant"
    _, as_csv, _ = _run(capsys, sql, "--db", str(db), "--format", "csv")
    assert as_csv.splitlines() == ["tenant,n", "acme,22", "globex,17"]
    _, as_json, _ = _run(capsys, sql, "--db", str(db), "--format", "json")
    assert json.loads(as_json) == [{"tenant": "acme", "n": 22}, {"tenant": "globex", "n": 17}]
    _, as_table, _ = _run(capsys, sql, "--db", str(db))
    assert as_table.splitlines()[2].split() == ["acme", "22"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["SELEC nonsense"], "query failed: Parser Error"),
        (["SELECT * FROM no_such_table"], "query failed: Catalog Error"),
    ],
)
def test_bad_queries_give_one_line_and_the_store_error_code(db, capsys, argv, message):
    code, out, err = _run(capsys, *argv, "--db", str(db))
    assert code == ExitCode.STORE_ERROR
    assert out == ""
    assert err.startswith(f"error: {message}") and err.count("\n") == 2  # error + hint, no traceback


def _cli(*argv: str) -> subprocess.CompletedProcess:
    """The real entry point in a child: the exit status and stderr a script would see."""
    return subprocess.run(
        [sys.executable, "-m", "llmobs.cli", *argv], capture_output=True, text=True, timeout=60, check=False
    )


USAGE_HINT = "hint: llmobs-agent query --help lists the canned views; SQL goes in one quoted argument"


@pytest.mark.parametrize(
    ("argv", "error", "hint"),
    [
        ([], "error: nothing to run: give SQL or a canned view", USAGE_HINT),
        (["SELECT 1", "--by-tenant"], "error: give either SQL or a canned view, not both", USAGE_HINT),
        (["--slowest-steps", "-n", "0"], "error: -n must be at least 1, not 0", USAGE_HINT),
        (["--top-probes", "--limit", "-3"], "error: -n must be at least 1, not -3", USAGE_HINT),
        (
            ["--top-probes", "--tenant", "acme"],
            "error: --tenant filters only --slowest-steps, --by-tenant and --by-session",
            "hint: in SQL, filter with WHERE tenant = '...'",
        ),
        (
            ["SELECT 1", "--session", "s"],
            "error: --session filters only --slowest-steps and --by-session",
            "hint: in SQL, filter with WHERE session = '...'",
        ),
    ],
)
def test_argument_mistakes_are_usage_errors_said_before_the_store_is_opened(tmp_path, argv, error, hint):
    """Exit 2 with exactly one error and one hint line from the real CLI. The --db named does not
    exist, so a store error (11, `no store at`) would mean the arguments were checked too late."""
    absent = tmp_path / "absent.duckdb"
    result = _cli("query", *argv, "--db", str(absent))
    assert (result.returncode, result.stdout) == (ExitCode.USAGE, "")
    assert result.stderr.splitlines() == [error, hint]
    assert not absent.exists()


def test_a_real_store_problem_is_still_a_store_error_from_the_real_cli(tmp_path):
    """The control of the test above: valid arguments over a missing store exit 11, not 2."""
    absent = tmp_path / "absent.duckdb"
    result = _cli("query", "--slowest-steps", "-n", "1", "--db", str(absent))
    assert (result.returncode, result.stdout) == (ExitCode.STORE_ERROR, "")
    error, hint = result.stderr.splitlines()
    assert error == f"error: no store at {absent}" and hint.startswith("hint: ")


def test_missing_and_corrupt_stores(tmp_path, capsys):
    code, _, err = _run(capsys, "SELECT 1", "--db", str(tmp_path / "absent.duckdb"))
    assert code == ExitCode.STORE_ERROR and "no store at" in err
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"\x00garbage" * 512)
    code, _, err = _run(capsys, "SELECT 1", "--db", str(junk))
    assert code == ExitCode.STORE_ERROR and err.startswith("error: cannot open") and "Traceback" not in err


def test_requests_with_the_same_trace_id_count_separately(tmp_path, capsys):
    steps = synthetic.token_steps(
        pid=1, requests=3, tokens_per_request=4, tenants=("t",), sessions_per_tenant=1
    )
    same = steps["trace_id"][0].as_py()
    steps = steps.set_column(steps.schema.get_field_index("trace_id"), "trace_id", pa.array([same] * 12))
    with DuckDBStore(tmp_path / "r.duckdb") as store:
        assert store.export({"token_steps": steps}).ok
    code, out, _ = _run(capsys, "--by-tenant", "--db", str(tmp_path / "r.duckdb"), "--format", "json")
    assert code == 0
    assert json.loads(out)[0]["requests"] == 3 and json.loads(out)[0]["concurrency"] == 1
