"""Column helpers the OTLP encoder, its metrics and its store reads share: integer codes of string
columns and ids of distinct key combinations, in numpy (no Python loop over rows)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def string_codes(*columns) -> tuple[np.ndarray, list[str]]:
    """Integer codes of the strings of one or more Arrow string columns (NULL as ""), one code space
    for all of them, back to back; and the string of each code."""
    chunks = []
    for column in columns:
        chunks.extend(column.chunks if isinstance(column, pa.ChunkedArray) else [column])
    encoded = pa.chunked_array(chunks, pa.string()).fill_null("").combine_chunks().dictionary_encode()
    return np.asarray(encoded.indices).astype(np.int64), encoded.dictionary.to_pylist()


def key_ids(*columns: np.ndarray) -> np.ndarray:
    """One id per distinct combination of the integer columns' values (row by row), numbered in the
    combinations' sorted order. A lexsort of int64 columns: np.unique(axis=0) sorts a void view and
    costs several times more."""
    return sorted_keys(columns)[0]


def sorted_keys(columns) -> tuple[np.ndarray, np.ndarray]:
    """(each row's key id, the index of one row of each key id, in key order)."""
    keys = [np.asarray(c).astype(np.int64, copy=False) for c in columns]
    n = len(keys[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort(keys[::-1])  # the last key sorts first: columns[0] is the primary key
    change = np.zeros(n, bool)
    change[0] = True
    for key in keys:
        ordered = key[order]
        change[1:] |= ordered[1:] != ordered[:-1]
    ids = np.empty(n, np.int64)
    ids[order] = np.cumsum(change) - 1
    return ids, order[change]
