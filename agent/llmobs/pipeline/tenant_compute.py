"""`top`'s per-tenant compute: each recent forward pass's duration shared out by its rows' tokens, summed
per tenant over the passes that ended in the window, in numpy over the passes' (pass, tenant) groups.

The rule is the store's (llmobs.pipeline.apportion, docs/store-schema.md) applied to a pass's tenants
rather than its rows: a row weighs the tokens it processed in the pass; a row of unknown tokens (0)
weighs the mean of the pass's known rows, rounded, at least 1; the pass's duration (integer ns, at least
0) goes to its tenants as floor(T * w / W), plus one ns to the tenants with the largest remainders (ties
by first row). So a pass needs, per tenant, only the sum of its known tokens and its count of unknown
rows, and the shares are exact integers.

Why numpy: `top`'s figures are recomputed every second over the last 10 s, at a GPU server's 20k token
steps a second. Summing every pass in Python each second cost ~2.3 us a token step (session 23); running
sums in a Python dict a pass still ~1.9 us (a call a row, a share a pass: session 24). Here a batch of
rows is kept as arrays, and a reading merges them into (pass, tenant) groups (~4 a pass), shares every
held pass and sums by tenant in a few vectorised passes.

Tenants are integer codes (the caller interns names). A row of step 0 (untagged) is no pass.
"""

from __future__ import annotations

import numpy as np

# A (pass, tenant) group, one array each: its pass and tenant, the arrival number of its first row (the
# remainders' tie-break), its rows' earliest start and latest end, the tokens of its rows that know
# theirs, how many do and how many do not.
FIELDS = ("seq", "tenant", "first", "start", "end", "known", "known_rows", "unknown_rows")
MERGE_ROWS = 1 << 16  # rows added without a reading are merged into groups at this many (bounded memory)


class TenantCompute:
    """Recent forward passes of one process and the compute (ns) each tenant's rows took of them."""

    def __init__(self, max_passes: int):
        self.max_passes = max_passes  # passes kept; more than 4x this keeps the newest max_passes (by seq)
        self.held: set[int] = set()  # the passes held (step_seq)
        self._groups = {field: np.zeros(0, np.int64) for field in FIELDS}  # sorted by (seq, tenant)
        self._shares = np.zeros(0, np.int64)  # each held group's ns of its pass (a merge redoes the new)
        self._batches: list[dict[str, np.ndarray]] = []  # rows added since the last merge
        self._rows: list[tuple[int, ...]] = []  # single rows (add_row) since the last merge, as FIELDS
        self._pending = 0  # rows in _batches and _rows
        self._arrived = 0  # rows ever added: each row's arrival number

    def add_row(self, seq: int, start: int, end: int, tenant: int, tokens: int) -> None:
        """A row of pass `seq` (a token step, or a prefill chunk that produced no token): its tenant code
        and the tokens it processed (0 unknown)."""
        self._arrived += 1
        if not seq:
            return
        known = tokens > 0
        self._rows.append((seq, tenant, self._arrived, start, end, tokens if known else 0, known, not known))
        self._pending += 1
        if seq not in self.held:
            self.held.add(seq)
            if len(self.held) > 4 * self.max_passes:
                self._drop_oldest()
        if self._pending >= MERGE_ROWS:
            self._merge()

    def add_rows(self, seq, start, end, tenant, tokens) -> None:
        """Many rows, as add_row each in turn would, except that the bound on passes held is applied once
        after the batch: arrays of one length, `tenant` an array of codes or one code for every row."""
        n = len(seq)
        if not n:
            return
        seq = np.asarray(seq, np.int64)
        tokens = np.asarray(tokens, np.int64)
        known = tokens > 0
        rows = {
            "seq": seq,
            "tenant": np.broadcast_to(np.asarray(tenant, np.int64), (n,)),
            "first": np.arange(self._arrived + 1, self._arrived + n + 1, dtype=np.int64),
            "start": np.asarray(start, np.int64),
            "end": np.asarray(end, np.int64),
            "known": np.where(known, tokens, 0),
            "known_rows": known.astype(np.int64),
            "unknown_rows": (~known).astype(np.int64),
        }
        self._arrived += n
        tagged = seq != 0
        if not tagged.all():
            rows = {field: values[tagged] for field, values in rows.items()}
        self._batches.append(rows)
        self._pending += len(rows["seq"])
        self.held.update(np.unique(rows["seq"]).tolist())
        if len(self.held) > 4 * self.max_passes:
            self._drop_oldest()
        elif self._pending >= MERGE_ROWS:
            self._merge()

    def since(self, since_ns: int) -> dict[int, int]:
        """tenant code -> compute ns over the passes that ended at or after since_ns, for every tenant
        with a row in one (older passes are dropped: no later window holds them)."""
        groups = self._merge()
        first_of_pass = _starts_of_runs(groups["seq"])
        pass_end = np.maximum.reduceat(groups["end"], first_of_pass) if len(first_of_pass) else groups["end"]
        gone = pass_end < since_ns
        if gone.any():
            self.held.difference_update(groups["seq"][first_of_pass[gone]].tolist())
            self._keep(np.repeat(~gone, np.diff(np.r_[first_of_pass, len(groups["seq"])])))
            groups = self._groups
        if not len(groups["seq"]):
            return {}
        totals = np.zeros(int(groups["tenant"].max()) + 1, np.int64)
        np.add.at(totals, groups["tenant"], self._shares)
        present = np.flatnonzero(np.bincount(groups["tenant"]))  # a tenant of a held pass, even at 0 ns
        return dict(zip(present.tolist(), totals[present].tolist(), strict=True))

    def _keep(self, keep: np.ndarray) -> None:
        """Only the held groups where `keep` (whole passes)."""
        self._groups = {field: values[keep] for field, values in self._groups.items()}
        self._shares = self._shares[keep]

    def _merge(self) -> dict[str, np.ndarray]:
        """The rows added since the last merge joined to the held groups (a row of a held pass and tenant
        adds to its group: a pass may grow after a reading). Only the held groups from the new rows' first
        pass on are merged again: new rows are mostly of new passes, so a reading costs what came in."""
        if not self._pending:
            return self._groups
        parts = self._batches
        if self._rows:
            columns = np.array(self._rows, np.int64).reshape(-1, len(FIELDS)).T
            parts = [*parts, dict(zip(FIELDS, columns, strict=True))]
        new = _grouped({field: np.concatenate([part[field] for part in parts]) for field in FIELDS})
        held = self._groups
        split = int(np.searchsorted(held["seq"], new["seq"][0]))  # held groups before it stay as they are
        if split < len(held["seq"]):
            tail = {field: np.concatenate([held[field][split:], new[field]]) for field in FIELDS}
            new = _grouped(tail)
        self._groups = {field: np.concatenate([held[field][:split], new[field]]) for field in FIELDS}
        self._shares = np.concatenate([self._shares[:split], _shares(new)])  # whole passes from split on
        self._batches, self._rows, self._pending = [], [], 0
        return self._groups

    def _drop_oldest(self) -> None:
        """Bounded: the newest max_passes passes (by step_seq) stay."""
        newest = sorted(self.held)[-self.max_passes :]
        self.held = set(newest)
        self._keep(self._merge()["seq"] >= newest[0])


def _starts_of_runs(*keys: np.ndarray) -> np.ndarray:
    """Where a run of equal keys (sorted arrays of one length) begins."""
    if not len(keys[0]):
        return np.zeros(0, np.int64)
    change = np.zeros(len(keys[0]), bool)
    change[0] = True
    for key in keys:
        change[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(change)


def _grouped(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows (or groups) as (pass, tenant) groups sorted by pass then tenant."""
    order = np.lexsort((rows["first"], rows["tenant"], rows["seq"]))  # a group's first row first
    rows = {field: values[order] for field, values in rows.items()}
    bounds = _starts_of_runs(rows["seq"], rows["tenant"])
    return {
        "seq": rows["seq"][bounds],
        "tenant": rows["tenant"][bounds],
        "first": rows["first"][bounds],
        "start": np.minimum.reduceat(rows["start"], bounds),
        "end": np.maximum.reduceat(rows["end"], bounds),
        **{field: np.add.reduceat(rows[field], bounds) for field in FIELDS[5:]},
    }


def _shares(groups: dict[str, np.ndarray]) -> np.ndarray:
    """Each group's ns of its pass by the rule above (groups sorted by pass, each pass's in any order)."""
    first_of_pass = _starts_of_runs(groups["seq"])
    sizes = np.diff(np.r_[first_of_pass, len(groups["seq"])])
    pass_of = np.repeat(np.arange(len(first_of_pass)), sizes)
    known = np.add.reduceat(groups["known"], first_of_pass)
    known_rows = np.add.reduceat(groups["known_rows"], first_of_pass)
    fill = np.ones(len(first_of_pass), np.int64)
    some = known_rows > 0  # np.round rounds halves to even, as Python's round does
    fill[some] = np.maximum(np.round(known[some] / known_rows[some]), 1).astype(np.int64)
    weight = groups["known"] + groups["unknown_rows"] * fill[pass_of]
    total = np.add.reduceat(weight, first_of_pass)  # >= 1: a pass has a row, each weighs >= 1
    duration = np.maximum(
        np.maximum.reduceat(groups["end"], first_of_pass)
        - np.minimum.reduceat(groups["start"], first_of_pass),
        0,
    )
    scaled = duration[pass_of] * weight
    if len(duration) and int(duration.max()) * int(total.max()) >= 1 << 63:  # exact past int64: Python ints
        scaled = duration[pass_of].astype(object) * weight.astype(object)
    quota = (scaled // total[pass_of]).astype(np.int64)
    remainder = (scaled % total[pass_of]).astype(np.int64)
    left = duration - np.add.reduceat(quota, first_of_pass)  # fewer than the pass's tenants
    order = np.lexsort((groups["first"], -remainder, pass_of))  # largest remainder first, ties by first row
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order)) - first_of_pass[pass_of[order]]
    return quota + (rank < left[pass_of])
