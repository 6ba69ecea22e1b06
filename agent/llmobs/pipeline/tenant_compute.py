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
rows is kept as arrays, and a reading merges what came in into the held (pass, tenant) groups (~4 a
pass), shares only the passes that changed (each group keeps its share) and sums by tenant, in a few
vectorised calls.

Tenants are integer codes (the caller interns names). A row of step 0 (untagged) is no pass.
"""

from __future__ import annotations

import numpy as np

# A (pass, tenant) group is a column of an int64 array [FIELDS, n] with these rows: its pass and tenant,
# the arrival number of its first row (the remainders' tie-break), its rows' earliest start and latest
# end, the tokens of its rows that know theirs, how many do and how many do not. One 2-D array, not an
# array a field: each step below is one numpy call however many fields (a slow target's second is ~30
# calls, not ~80); fields as rows, so each is contiguous (a server's second hands ~20,000 rows at once).
SEQ, TENANT, FIRST, START, END, KNOWN, KNOWN_ROWS, UNKNOWN_ROWS = range(8)
FIELDS = 8
MERGE_ROWS = 1 << 16  # rows added without a reading are merged into groups at this many (bounded memory)


class TenantCompute:
    """Recent forward passes of one process and the compute (ns) each tenant's rows took of them."""

    def __init__(self, max_passes: int):
        self.max_passes = max_passes  # passes kept; more than 4x this keeps the newest max_passes (by seq)
        self.held: set[int] = set()  # the passes held (step_seq)
        self._groups = np.zeros((FIELDS, 0), np.int64)  # sorted by (seq, tenant)
        self._shares = np.zeros(0, np.int64)  # each held group's ns of its pass (a merge redoes the new)
        self._batches: list[np.ndarray] = []  # rows added since the last merge (as groups of one row)
        self._rows: list[tuple[int, ...]] = []  # single rows (add_row) since the last merge
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
        rows = np.empty((FIELDS, n), np.int64)
        rows[SEQ] = seq
        rows[TENANT] = tenant
        rows[FIRST] = np.arange(self._arrived + 1, self._arrived + n + 1)
        rows[START] = start
        rows[END] = end
        known = np.asarray(tokens) > 0
        rows[KNOWN] = np.where(known, tokens, 0)
        rows[KNOWN_ROWS] = known
        rows[UNKNOWN_ROWS] = ~known
        self._arrived += n
        if not rows[SEQ].all():
            rows = rows[:, rows[SEQ] != 0]
        self._batches.append(rows)
        self._pending += rows.shape[1]
        self.held.update(rows[SEQ, run_starts(rows[SEQ])].tolist())  # a pass's rows are mostly adjacent
        if len(self.held) > 4 * self.max_passes:
            self._drop_oldest()
        elif self._pending >= MERGE_ROWS:
            self._merge()

    def since(self, since_ns: int) -> dict[int, int]:
        """tenant code -> compute ns over the passes that ended at or after since_ns, for every tenant
        with a row in one (older passes are dropped: no later window holds them)."""
        groups = self._merge()
        if not groups.shape[1]:
            return {}
        first_of_pass = run_starts(groups[SEQ])
        gone = np.maximum.reduceat(groups[END], first_of_pass) < since_ns
        if gone.any():
            self.held.difference_update(groups[SEQ, first_of_pass[gone]].tolist())
            self._keep(np.repeat(~gone, np.diff(first_of_pass, append=groups.shape[1])))
            groups = self._groups
            if not groups.shape[1]:
                return {}
        tenants = groups[TENANT]
        groups_of = np.bincount(tenants)  # each tenant's groups held
        present = np.flatnonzero(groups_of)  # a tenant of a held pass, even at 0 ns
        sums = np.zeros(len(groups_of), np.int64)
        np.add.at(sums, tenants, self._shares)
        return dict(zip(present.tolist(), sums[present].tolist(), strict=True))

    def _keep(self, keep: np.ndarray) -> None:
        """Only the held groups where `keep` (whole passes)."""
        self._groups = self._groups[:, keep]
        self._shares = self._shares[keep]

    def _merge(self) -> np.ndarray:
        """The rows added since the last merge joined to the held groups (a row of a held pass and tenant
        adds to its group: a pass may grow after a reading). Only the held groups from the new rows' first
        pass on are merged again: new rows are mostly of new passes, so a reading costs what came in."""
        if not self._pending:
            return self._groups
        parts = self._batches
        if self._rows:
            parts = [*parts, np.array(self._rows, np.int64).T]
        new = _grouped(np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])
        held = self._groups
        split = int(np.searchsorted(held[SEQ], new[SEQ, 0]))  # held groups before it stay as they are
        if split < held.shape[1]:
            new = _grouped(np.concatenate([held[:, split:], new], axis=1))
        self._groups = np.concatenate([held[:, :split], new], axis=1)
        self._shares = np.concatenate([self._shares[:split], _shares(new)])  # whole passes from split on
        self._batches, self._rows, self._pending = [], [], 0
        return self._groups

    def _drop_oldest(self) -> None:
        """Bounded: the newest max_passes passes (by step_seq) stay."""
        newest = sorted(self.held)[-self.max_passes :]
        self.held = set(newest)
        self._keep(self._merge()[SEQ] >= newest[0])


def run_starts(*keys: np.ndarray) -> np.ndarray:
    """Where a run of equal keys (arrays of one length, at least one element) begins."""
    change = np.empty(len(keys[0]), bool)
    change[0] = True
    np.not_equal(keys[0][1:], keys[0][:-1], out=change[1:])
    for key in keys[1:]:
        change[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(change)


def _grouped(rows: np.ndarray) -> np.ndarray:
    """Rows (or groups) as (pass, tenant) groups sorted by pass then tenant, each from its first row."""
    rows = rows[:, np.lexsort(rows[[FIRST, TENANT, SEQ]])]  # by pass, tenant, then first row first
    bounds = run_starts(rows[SEQ], rows[TENANT])
    if len(bounds) == rows.shape[1]:  # no two rows of one pass and tenant: the rows are the groups
        return rows
    groups = rows[:, bounds]
    groups[START] = np.minimum.reduceat(rows[START], bounds)
    groups[END] = np.maximum.reduceat(rows[END], bounds)
    groups[KNOWN:] = np.add.reduceat(rows[KNOWN:], bounds, axis=1)
    return groups


def _shares(groups: np.ndarray) -> np.ndarray:
    """Each group's ns of its pass by the rule above (groups sorted by pass, each pass's in any order)."""
    first_of_pass = run_starts(groups[SEQ])
    end = np.maximum.reduceat(groups[END], first_of_pass)
    duration = np.maximum(end - np.minimum.reduceat(groups[START], first_of_pass), 0)
    count = groups.shape[1]
    if len(first_of_pass) == count:  # one tenant a pass (a lone request, a one-tenant batch): all of it
        return duration
    pass_of = np.repeat(np.arange(len(first_of_pass)), np.diff(first_of_pass, append=count))
    known, known_rows, _ = np.add.reduceat(groups[KNOWN:], first_of_pass, axis=1)
    fill = np.ones(len(first_of_pass), np.int64)
    some = known_rows > 0  # np.round rounds halves to even, as Python's round does
    fill[some] = np.maximum(np.round(known[some] / known_rows[some]), 1)
    weight = groups[KNOWN] + groups[UNKNOWN_ROWS] * fill[pass_of]
    total = np.add.reduceat(weight, first_of_pass)  # >= 1: a pass has a row, each weighs >= 1
    scaled = duration[pass_of] * weight
    if int(duration.max()) * int(total.max()) >= 1 << 63:  # exact past int64: Python ints
        scaled = duration[pass_of].astype(object) * weight.astype(object)
    quota = (scaled // total[pass_of]).astype(np.int64)
    remainder = (scaled % total[pass_of]).astype(np.int64)
    left = duration - np.add.reduceat(quota, first_of_pass)  # fewer than the pass's tenants
    order = np.lexsort((groups[FIRST], -remainder, pass_of))  # largest remainder first, ties by first row
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order)) - first_of_pass[pass_of[order]]
    return quota + (rank < left[pass_of])
