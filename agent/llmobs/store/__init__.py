"""The local DuckDB store: schema and migrations, the DuckDBStore sink, retention, canned views."""

from llmobs.store.sink import DB_PATH_ENV, DEFAULT_DB_PATH, DuckDBStore, SinkResult, default_db_path

__all__ = ["DB_PATH_ENV", "DEFAULT_DB_PATH", "DuckDBStore", "SinkResult", "default_db_path"]
