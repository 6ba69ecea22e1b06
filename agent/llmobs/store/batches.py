"""Turn what sources hand the store (pyarrow tables, numpy structured arrays, dicts of columns) into
pyarrow Tables, the one form the store appends (DuckDB scans Arrow memory without copying row by row).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

TableLike = pa.Table | pa.RecordBatch | np.ndarray | Mapping[str, Any]


def to_arrow(data: TableLike) -> pa.Table:
    """Convert one batch to a pyarrow Table; raise TypeError/ValueError on shapes we cannot take."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, np.ndarray):
        if data.dtype.names is None:
            raise TypeError("a numpy batch must be a structured array (one named field per column)")
        return pa.table({name: _numpy_column(data[name]) for name in data.dtype.names})
    if isinstance(data, Mapping):
        columns = {}
        for name, values in data.items():
            columns[name] = _numpy_column(values) if isinstance(values, np.ndarray) else values
        return pa.table(columns)
    raise TypeError(f"cannot append a {type(data).__name__}; give a pyarrow Table, numpy array or dict")


def _numpy_column(values: np.ndarray) -> pa.Array:
    if values.dtype.kind == "S":  # fixed-width bytes from a C struct: NUL-padded UTF-8
        return pa.array(np.char.decode(np.char.rstrip(values, b"\0"), "utf-8"), type=pa.string())
    if values.dtype.kind == "U":
        return pa.array(values, type=pa.string())
    return pa.array(np.ascontiguousarray(values))
