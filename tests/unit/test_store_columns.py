"""schema.tables_columns (one information_schema query for every table, what a store opens with)
gives exactly what table_columns gives table by table: the same columns, types and order, and an
empty mapping for a table the store does not have."""

from __future__ import annotations

from llmobs.store import DuckDBStore, schema


def test_tables_columns_equals_table_columns_one_by_one(tmp_path):
    with DuckDBStore(tmp_path / "s.duckdb") as store:
        conn = store.connection
        conn.execute("CREATE TABLE extra_table (b INTEGER, a VARCHAR, c DOUBLE)")
        tables = [t for t in schema.TIME_COLUMN if t] + ["extra_table", "no_such_table"]
        together = schema.tables_columns(conn, tables)
        one_by_one = {table: schema.table_columns(conn, table) for table in tables}
        assert together == one_by_one
        assert list(together["extra_table"].items()) == [("b", "INTEGER"), ("a", "VARCHAR"), ("c", "DOUBLE")]
        assert together["no_such_table"] == {}
        assert together["token_steps"]  # a migrated store has its tables
