"""`top`'s per-tenant compute as running sums (llmobs.pipeline.tenant_compute) against the rule summed anew
over every pass held at each reading (what LiveStats did before, kept here as the reference), on random
streams of rows: passes that grow, rows that join a pass after it was read, unknown tokens, zero-length
and reversed passes, several tenants a pass, windows that move on, and the bound on passes held."""

from __future__ import annotations

import random

import numpy as np
import pytest
from llmobs.pipeline import tenant_compute
from llmobs.pipeline.tenant_compute import END, SEQ, START, TenantCompute


class Reference:
    """The rule summed anew each reading: every row kept, each held pass shared in floats."""

    def __init__(self, max_passes: int):
        self.max_passes = max_passes
        self.passes: dict[int, list] = {}  # seq -> [end, start, [(tenant, tokens)]]

    def add_row(self, seq, start, end, tenant, tokens):
        if not seq:
            return
        slot = self.passes.get(seq)
        if slot is None:
            slot = self.passes[seq] = [end, start, []]
            if len(self.passes) > 4 * self.max_passes:
                for old in sorted(self.passes)[: len(self.passes) - self.max_passes]:
                    del self.passes[old]
        slot[0], slot[1] = max(slot[0], end), min(slot[1], start)
        slot[2].append((tenant, tokens))

    def since(self, since_ns):
        self.passes = {seq: slot for seq, slot in self.passes.items() if slot[0] >= since_ns}
        compute: dict[str, float] = {}
        for end, start, rows in self.passes.values():
            known = [k for _, k in rows if k > 0]
            fill = max(round(sum(known) / len(known)), 1) if known else 1
            weights = [(t, k if k > 0 else fill) for t, k in rows]
            total = sum(w for _, w in weights)
            for tenant, w in weights:
                compute[tenant] = compute.get(tenant, 0.0) + max(end - start, 0) * w / total
        return compute


def _stream(seed: int, max_passes: int):
    rng = random.Random(seed)
    tenants = ["", "acme", "globex", "initech"][: rng.randint(1, 4)]
    seq, now = 0, 10**12
    for _ in range(rng.randint(200, 600)):
        op = rng.random()
        if op < 0.08:  # a reading, the window's start somewhere in the recent past
            yield ("since", now - rng.randint(0, 40) * 1_000_000)
            continue
        if op < 0.2 and seq:  # a row joins a recent pass: it may end later, or start earlier
            old = rng.randint(max(1, seq - 8), seq)
            start = now - rng.randint(0, 30) * 1_000_000
            end = start + rng.choice([0, -1_000, rng.randint(1, 9_000_000)])  # zero and reversed too
            yield ("row", old, start, end, rng.choice(tenants), rng.choice([0, 0, 1, 7, 512]))
            continue
        seq += rng.choice([1, 1, 1, 2, 0]) or 0  # 0: step 0 (untagged), no pass
        now += rng.randint(0, 3_000_000)
        start = now - rng.randint(0, 5_000_000)
        for _row in range(rng.randint(1, 5)):
            yield (
                "row",
                seq,
                start,
                now + rng.randint(0, 1000),
                rng.choice(tenants),
                rng.choice([0, 1, 3, 64]),
            )


class Interned:
    """TenantCompute with tenant names: it takes integer codes (the caller interns them)."""

    def __init__(self, max_passes: int):
        self.compute = TenantCompute(max_passes)
        self.names: list[str] = []

    def code(self, tenant: str) -> int:
        if tenant not in self.names:
            self.names.append(tenant)
        return self.names.index(tenant)

    def add_row(self, seq, start, end, tenant, tokens):
        self.compute.add_row(seq, start, end, self.code(tenant), tokens)

    def add_rows(self, rows):
        seq, start, end, tenant, tokens = zip(*rows, strict=True)
        self.compute.add_rows(
            np.array(seq),
            np.array(start),
            np.array(end),
            np.array([self.code(t) for t in tenant]),
            np.array(tokens),
        )

    def since(self, since_ns):
        return {self.names[code]: ns for code, ns in self.compute.since(since_ns).items()}

    def shares_by_pass(self) -> dict[int, int]:
        """Each held pass's shares summed (merged first, as a reading does)."""
        groups = self.compute._merge()
        sums: dict[int, int] = {}
        for seq, share in zip(groups[SEQ].tolist(), self.compute._shares.tolist(), strict=True):
            sums[seq] = sums.get(seq, 0) + share
        return sums

    def durations(self) -> dict[int, int]:
        groups = self.compute._merge()
        spans: dict[int, list] = {}
        for seq, start, end in zip(
            groups[SEQ].tolist(), groups[START].tolist(), groups[END].tolist(), strict=True
        ):
            span = spans.setdefault(seq, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
        return {seq: max(end - start, 0) for seq, (start, end) in spans.items()}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_passes", [3, 20_000])
def test_the_shares_match_the_rule_summed_anew_at_every_reading(seed, max_passes):
    running, reference = Interned(max_passes), Reference(max_passes)
    readings = 0
    for op in _stream(seed, max_passes):
        if op[0] == "row":
            running.add_row(*op[1:])
            reference.add_row(*op[1:])
            continue
        got, want = running.since(op[1]), reference.since(op[1])
        readings += 1
        assert running.compute.held == reference.passes.keys()
        assert got.keys() == want.keys()  # a tenant of a held pass, even with no time, is there
        for tenant, ns in want.items():  # exact integers: within 1 ns a held pass of the float rule
            assert abs(got[tenant] - ns) <= len(reference.passes), (tenant, got[tenant], ns)
            assert isinstance(got[tenant], int) and got[tenant] >= 0
        assert running.shares_by_pass() == running.durations()  # each pass's shares add up to its duration
    assert readings > 5


def _batches(seed: int):
    """The same random streams, the rows between two readings cut into random runs, each to be added as
    one batch or a row at a time (so batches and single rows interleave between readings)."""
    rng = random.Random(seed)
    run: list[tuple] = []
    for op in _stream(seed, 20_000):
        if op[0] == "row":
            run.append(op[1:])
            if rng.random() < 0.3:
                yield rng.choice(["batch", "single"]), run
                run = []
            continue
        if run:
            yield rng.choice(["batch", "single"]), run
        run = []
        yield op


@pytest.mark.parametrize("seed", range(12))
def test_batches_and_single_rows_add_as_their_rows_one_by_one_would(seed):
    mixed, one_by_one = Interned(20_000), Interned(20_000)
    for op in _batches(seed):
        if op[0] in ("batch", "single"):
            if op[0] == "batch":
                mixed.add_rows(op[1])
            for row in op[1]:
                one_by_one.add_row(*row)
                if op[0] == "single":
                    mixed.add_row(*row)
            continue
        assert mixed.since(op[1]) == one_by_one.since(op[1])  # exactly: the remainders' ties too
        assert mixed.compute.held == one_by_one.compute.held


def test_a_pass_shares_by_tokens_with_unknown_rows_at_the_known_mean_and_remainders_to_the_largest():
    compute = Interned(100)
    compute.add_row(5, 0, 10, "a", 3)
    compute.add_row(5, 0, 10, "b", 1)
    compute.add_row(5, 0, 10, "c", 0)  # unknown: weighs round(mean(3, 1)) = 2
    # 10 ns by 3:1:2 of 6 -> floors 5, 1, 3 (remainders 0, 4, 2): the one ns left goes to b
    assert compute.since(0) == {"a": 5, "b": 2, "c": 3}
    compute.add_row(5, 0, 12, "b", 2)  # a row joins after the reading, and the pass ends later
    assert compute.since(0) == {"a": 5, "b": 4, "c": 3}  # 12 ns by 3:3:2 of 8: 4.5, 4.5, 3; tie -> a first
    compute.add_rows([(6, 20, 30, "c", 1), (6, 20, 30, "b", 1), (6, 20, 30, "a", 1)])
    # 10 ns by 1:1:1 of 3: 3 each, remainder 1 each; the one ns left to the tenant whose row came first
    assert compute.since(13) == {"a": 3, "b": 3, "c": 4} and compute.compute.held == {6}  # pass 5 left
    assert compute.since(31) == {} and not compute.compute.held  # it left the window: nothing held


@pytest.mark.parametrize("batched", [False, True])
def test_the_remainders_go_to_tenants_not_to_their_rows(batched):
    # 11 ns by a:2 (two rows of 1 token), b:1 of 3: a 22/3 = 7 r1, b 11/3 = 3 r2 -> the ns left goes to b.
    # Shared by rows it would be 3 r2 each, the two ns left to a's two rows first: a 8, b 3.
    compute = Interned(10)
    rows = [(4, 0, 11, "a", 1), (4, 0, 11, "a", 1), (4, 0, 11, "b", 1)]
    if batched:
        compute.add_rows(rows)
    else:
        for row in rows:
            compute.add_row(*row)
    assert compute.since(0) == {"a": 7, "b": 4}


def test_a_long_pass_of_many_tokens_is_shared_exactly_past_int64():
    compute = Interned(10)
    duration, tokens = 3 * 10**12, 5 * 10**7 + 1  # duration x weight ~1.5e20: past int64
    compute.add_rows([(1, 0, duration, "a", tokens), (1, 0, duration, "b", 2 * tokens)])
    a, b = duration * tokens // (3 * tokens), duration * 2 * tokens // (3 * tokens)
    assert compute.since(0) == {"a": a + (duration - a - b), "b": b}  # 0 or 1 ns left: to the first
    assert sum(compute.since(0).values()) == duration


def test_passes_held_stay_bounded_without_readings():
    compute = Interned(10)
    for seq in range(1, 2_000):
        compute.add_row(seq, seq * 10, seq * 10 + 5, "a", 1)
    assert len(compute.compute.held) <= 40
    held = compute.compute.held
    assert compute.since(0) == {"a": 5 * len(held)} and compute.compute._groups.shape[1] == len(held)
    compute.add_rows([(seq, seq * 10, seq * 10 + 5, "a", 1) for seq in range(2_000, 2_100)])
    assert compute.compute.held == set(range(2_090, 2_100))  # over 4x after the batch: its newest 10


def test_rows_without_readings_are_merged_at_a_bound(monkeypatch):
    monkeypatch.setattr(tenant_compute, "MERGE_ROWS", 50)
    merged, reference = Interned(20_000), Interned(20_000)
    for seq in range(1, 400):
        for tenant in ("a", "b"):
            merged.add_row(seq // 3 + 1, seq * 10, seq * 10 + 7, tenant, seq % 4)
    assert merged.compute._pending < 50 and merged.compute._groups.shape[1] > 0
    monkeypatch.setattr(tenant_compute, "MERGE_ROWS", 1 << 30)
    for seq in range(1, 400):
        for tenant in ("a", "b"):
            reference.add_row(seq // 3 + 1, seq * 10, seq * 10 + 7, tenant, seq % 4)
    assert reference.compute._pending == 798  # merged only at its reading
    monkeypatch.setattr(tenant_compute, "MERGE_ROWS", 50)
    batched = Interned(20_000)
    for seq in range(1, 400, 10):  # batches of 20 rows: merged once 50 wait
        batched.add_rows(
            [(s // 3 + 1, s * 10, s * 10 + 7, t, s % 4) for s in range(seq, min(seq + 10, 400)) for t in "ab"]
        )
    assert batched.compute._pending < 50
    monkeypatch.setattr(tenant_compute, "MERGE_ROWS", 1 << 30)
    assert merged.since(0) == reference.since(0) == batched.since(0)
