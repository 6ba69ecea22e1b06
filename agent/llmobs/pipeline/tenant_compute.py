"""`top`'s per-tenant compute: each recent forward pass's duration shared out by its rows' tokens, summed
per tenant over the passes that ended in the window, kept as running sums.

The rule is the store's (llmobs.pipeline.apportion, docs/store-schema.md) applied to a pass's tenants
rather than its rows: a row weighs the tokens it processed in the pass; a row of unknown tokens (0)
weighs the mean of the pass's known rows, rounded, at least 1; the pass's duration (integer ns, at least
0) goes to its tenants as floor(T * w / W), plus one ns to the tenants with the largest remainders (ties
by first row). So a pass needs, per tenant, only the sum of its known tokens and its count of unknown
rows, and the sums stay exact integers however many passes come and go.

Why running sums: `top`'s figures are recomputed every second over the last 10 s. Summing every pass
held each second cost the snapshot ~2.3 us a token step at 20k steps/s (12,500 passes held, batch 16:
~46 ms a second of a Python loop), and keeping every row of a pass ~2.8 us more. Here a pass is shared
once its rows are in (again when a row joins it later), added to its tenants' sums, and taken out of
them when it leaves the window (a heap by end) or the bound.
"""

from __future__ import annotations

import heapq

# A pass: [end_ns, start_ns, {tenant: [known tokens, unknown rows]}, shares {tenant: ns} once shared,
# known tokens, known rows, unknown rows]
_END, _START, _TENANTS, _SHARES, _KNOWN, _KNOWN_ROWS, _UNKNOWN = range(7)


class TenantCompute:
    """Recent forward passes of one process and the compute (ns) each tenant's rows took of them."""

    def __init__(self, max_passes: int):
        self.max_passes = max_passes  # kept passes; more than 4x this drops the oldest (by step_seq)
        self.passes: dict[int, list] = {}  # step_seq -> a pass (above)
        self.compute: dict[str, int] = {}  # tenant -> ns, over the shared passes held
        self._holders: dict[str, int] = {}  # tenant -> shared passes held that have a row of it
        self._unshared: set[int] = set()  # passes with a row added since they were last shared
        self._by_end: list[tuple[int, int]] = []  # (end_ns, step_seq); stale once a pass's end grew

    def add_row(self, seq: int, start: int, end: int, tenant: str, tokens: int) -> None:
        """A row of pass `seq` (a token step, or a prefill chunk that produced no token): its tenant
        ("" untagged) and the tokens it processed (0 unknown). Step 0 (untagged) is no pass."""
        if not seq:
            return
        slot = self.passes.get(seq)
        if slot is None:
            slot = self.passes[seq] = [end, start, {}, None, 0, 0, 0]
            heapq.heappush(self._by_end, (end, seq))
            if len(self.passes) > 4 * self.max_passes:
                self._drop_oldest()
                if seq not in self.passes:  # itself among the oldest (a late row of a pass long gone)
                    return
        else:
            if end > slot[_END]:
                slot[_END] = end
                heapq.heappush(self._by_end, (end, seq))
            if start < slot[_START]:
                slot[_START] = start
            if slot[_SHARES] is not None:
                self._withdraw(slot)
        counts = slot[_TENANTS].get(tenant)
        if counts is None:
            counts = slot[_TENANTS][tenant] = [0, 0]
        if tokens > 0:
            counts[0] += tokens
            slot[_KNOWN] += tokens
            slot[_KNOWN_ROWS] += 1
        else:
            counts[1] += 1
            slot[_UNKNOWN] += 1
        self._unshared.add(seq)

    def since(self, since_ns: int) -> dict[str, int]:
        """tenant -> compute ns over the passes that ended at or after since_ns (older ones are dropped:
        no later window holds them). The dict is the running sums': read it, do not keep it."""
        by_end, passes = self._by_end, self.passes
        while by_end and by_end[0][0] < since_ns:
            end, seq = heapq.heappop(by_end)
            slot = passes.get(seq)
            if slot is not None and slot[_END] == end:  # else dropped already, or its end grew since
                if slot[_SHARES] is not None:
                    self._withdraw(slot)
                del passes[seq]
                self._unshared.discard(seq)
        for seq in self._unshared:
            self._share(passes[seq])
        self._unshared.clear()
        return self.compute

    def _share(self, slot: list) -> None:
        duration = max(slot[_END] - slot[_START], 0)
        fill = max(round(slot[_KNOWN] / slot[_KNOWN_ROWS]), 1) if slot[_KNOWN_ROWS] else 1
        total = slot[_KNOWN] + slot[_UNKNOWN] * fill  # >= 1: a pass has a row, each weighs >= 1
        quotas = {
            t: divmod(duration * (known + unknown * fill), total)
            for t, (known, unknown) in slot[_TENANTS].items()
        }
        shares = {tenant: quota for tenant, (quota, _) in quotas.items()}
        left = duration - sum(shares.values())  # fewer than the tenants: each remainder is < total
        if left:
            for tenant in sorted(quotas, key=lambda t: -quotas[t][1])[:left]:  # stable: ties by first row
                shares[tenant] += 1
        compute, holders = self.compute, self._holders
        for tenant, ns in shares.items():
            compute[tenant] = compute.get(tenant, 0) + ns
            holders[tenant] = holders.get(tenant, 0) + 1
        slot[_SHARES] = shares

    def _withdraw(self, slot: list) -> None:
        compute, holders = self.compute, self._holders
        for tenant, ns in slot[_SHARES].items():
            left = holders[tenant] - 1
            if left:
                holders[tenant] = left
                compute[tenant] -= ns
            else:  # its last pass held: the tenant is no longer in the window's compute
                del holders[tenant], compute[tenant]
        slot[_SHARES] = None

    def _drop_oldest(self) -> None:
        """Bounded: the newest max_passes passes (by step_seq) stay; the heap is rebuilt from them."""
        for seq in sorted(self.passes)[: len(self.passes) - self.max_passes]:
            slot = self.passes.pop(seq)
            if slot[_SHARES] is not None:
                self._withdraw(slot)
            self._unshared.discard(seq)
        self._by_end = [(slot[_END], seq) for seq, slot in self.passes.items()]
        heapq.heapify(self._by_end)
