"""Migration 8 (map ABI v3): a store at version 7 gains token_steps.tokens_in_pass / request_seq /
request_id (defaults for the rows it has) and the request_events table."""

from __future__ import annotations

import duckdb
from llmobs.store import schema, synthetic
from llmobs.store.sink import DuckDBStore


def test_a_version_7_store_is_upgraded_and_its_steps_get_the_defaults(tmp_path):
    path = tmp_path / "s.duckdb"
    conn = duckdb.connect(str(path))
    assert schema.migrate(conn, target=7)[-1] == 7
    steps = synthetic.token_steps(pid=11, requests=2, tokens_per_request=3)
    conn.register("s", steps)
    names = ", ".join(steps.schema.names)
    conn.execute(f"INSERT INTO token_steps ({names}) SELECT {names} FROM s")
    conn.close()
    with DuckDBStore(path) as store:
        rows = store.query(
            "SELECT DISTINCT tokens_in_pass, request_seq, request_id FROM token_steps"
        ).to_pylist()
        assert rows == [{"tokens_in_pass": 0, "request_seq": 0, "request_id": ""}]
        assert store.count("token_steps") == 6 and store.count("request_events") == 0
        assert "request_events" in schema.TIME_COLUMN
