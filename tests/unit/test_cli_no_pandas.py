"""The agent's own commands never load pandas (llmobs.cli._NoPandas): pyarrow would import it on the
first array it builds (~0.5 s before the first drain, +43 MB resident), and the agent uses none of it.
Checked in fresh interpreters, as the agent runs: `attach` (here refused early: no such pid) leaves the
finder in place, and the pyarrow / DuckDB calls the agent makes then work without pandas; a command
that is not the agent's (and the workload side) is left as it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys
import numpy as np
from llmobs import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as exc:  # a usage error or --help: argparse exits
    code = exc.code
import duckdb, pyarrow as pa, pyarrow.compute as pc
table = pa.table({"a": pa.array(np.arange(3)), "b": pa.array(["x", None, "z"])})
conn = duckdb.connect()
conn.register("t", table)
total = conn.execute("SELECT sum(a) FROM t").fetchall()[0][0]
back = conn.sql("SELECT * FROM t ORDER BY a").to_arrow_table().to_pylist()
print(json.dumps({"code": int(code), "pandas": "pandas" in sys.modules, "total": int(total),
                  "back": back, "nulls": pc.sum(pc.is_null(table.column("b"))).as_py()}))
"""


def run_cli(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def pandas_installed() -> bool:
    return subprocess.run([sys.executable, "-c", "import pandas"], capture_output=True).returncode == 0


@pytest.mark.skipif(not pandas_installed(), reason="pandas is not installed: nothing to keep out")
def test_attach_runs_without_pandas_and_pyarrow_duckdb_still_work():
    got = run_cli("attach", "--pid", "999999999")
    assert got["code"] != 0  # refused: no such process (the finder was installed before that)
    assert got["pandas"] is False
    assert got["total"] == 3
    assert got["back"] == [{"a": 0, "b": "x"}, {"a": 1, "b": None}, {"a": 2, "b": "z"}]
    assert got["nulls"] == 1


@pytest.mark.skipif(not pandas_installed(), reason="pandas is not installed")
def test_other_commands_leave_pandas_alone():
    got = run_cli("query", "--help")
    assert got["pandas"] is True  # pyarrow imported it, as it does anywhere else
