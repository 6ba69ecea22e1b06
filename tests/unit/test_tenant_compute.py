"""`top`'s per-tenant compute as running sums (llmobs.pipeline.tenant_compute) against the rule summed anew
over every pass held at each reading (what LiveStats did before, kept here as the reference), on random
streams of rows: passes that grow, rows that join a pass after it was read, unknown tokens, zero-length
and reversed passes, several tenants a pass, windows that move on, and the bound on passes held."""

from __future__ import annotations

import random

import pytest
from llmobs.pipeline.tenant_compute import TenantCompute


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


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_passes", [3, 20_000])
def test_running_sums_match_the_rule_summed_anew_at_every_reading(seed, max_passes):
    running, reference = TenantCompute(max_passes), Reference(max_passes)
    readings = 0
    for op in _stream(seed, max_passes):
        if op[0] == "row":
            running.add_row(*op[1:])
            reference.add_row(*op[1:])
            continue
        got, want = dict(running.since(op[1])), reference.since(op[1])
        readings += 1
        assert running.passes.keys() == reference.passes.keys()
        assert got.keys() == want.keys()  # a tenant of a held pass, even with no time, is there
        for tenant, ns in want.items():  # exact integers: within 1 ns a held pass of the float rule
            assert abs(got[tenant] - ns) <= len(running.passes), (tenant, got[tenant], ns)
            assert isinstance(got[tenant], int) and got[tenant] >= 0
        held = {seq: slot for seq, slot in running.passes.items()}
        for seq, slot in held.items():  # each pass's shares add up to its duration exactly
            if slot[3] is not None:
                assert sum(slot[3].values()) == max(slot[0] - slot[1], 0), seq
    assert readings > 5


def test_a_pass_shares_by_tokens_with_unknown_rows_at_the_known_mean_and_remainders_to_the_largest():
    compute = TenantCompute(100)
    compute.add_row(5, 0, 10, "a", 3)
    compute.add_row(5, 0, 10, "b", 1)
    compute.add_row(5, 0, 10, "c", 0)  # unknown: weighs round(mean(3, 1)) = 2
    # 10 ns by 3:1:2 of 6 -> floors 5, 1, 3 (remainders 0, 4, 2): the one ns left goes to b
    assert compute.since(0) == {"a": 5, "b": 2, "c": 3}
    compute.add_row(5, 0, 12, "b", 2)  # a row joins after the reading, and the pass ends later
    assert compute.since(0) == {"a": 5, "b": 4, "c": 3}  # 12 ns by 3:3:2 of 8: 4.5, 4.5, 3; tie -> a first
    assert compute.since(13) == {} and not compute.passes  # it left the window: nothing held


def test_the_heap_stays_bounded_without_readings():
    compute = TenantCompute(10)
    for seq in range(1, 2_000):
        compute.add_row(seq, seq * 10, seq * 10 + 5, "a", 1)
    assert len(compute.passes) <= 40 and len(compute._by_end) <= 41
    assert compute.since(0) == {"a": 5 * len(compute.passes)}
