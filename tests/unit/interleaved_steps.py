"""Token steps of a continuously batched server, for the report and export tests: three served requests
whose steps interleave across forward passes, one of them joining late, in the store's token_steps
columns. A request's steps are not consecutive passes here, so grouping them by `step_seq - step` (the
generate()-era rule) splits every request; only the request key (views.REQUEST_KEY) keeps each whole."""

from __future__ import annotations

MS = 1_000_000
T0 = 10**12

# request -> (request_seq, trace id, tenant, the passes (step_seq) it has a row in, in order)
REQUESTS = {
    "a": (1, "aa" * 16, "acme", (1, 3, 4, 6)),
    "b": (2, "bb" * 16, "globex", (1, 2, 4, 5)),
    "c": (3, "cc" * 16, "acme", (3, 5, 6)),  # joins at pass 3, after a and b started
}
PASSES = 6
SLOW_PASS = 5  # 30 ms where the others take 10: the slowest step, shared by two requests' rows


def pass_start_ns(step_seq: int) -> int:
    return T0 + (step_seq - 1) * 31 * MS


def interleaved_steps(pid: int) -> dict[str, list]:
    """One token step per (request, pass it is in): batch_row is its row in that pass, step its index in
    its own request; a pass's rows share its latency."""
    rows: dict[str, list] = {
        k: []
        for k in ("pid", "step_seq", "trace_id", "step", "position", "token_id", "loss", "entropy",
                  "target_prob", "latency_ns", "t_start_ns", "t_end_ns", "batch_row", "tenant", "session",
                  "model_id", "request_seq", "request_id", "tokens_in_pass")
    }  # fmt: skip
    for step_seq in range(1, PASSES + 1):
        members = [(rid, r) for rid, r in REQUESTS.items() if step_seq in r[3]]
        for batch_row, (rid, (seq, trace, tenant, passes)) in enumerate(members):
            step = passes.index(step_seq)
            start, latency = pass_start_ns(step_seq), (30 if step_seq == SLOW_PASS else 10) * MS
            values = {
                "pid": pid, "step_seq": step_seq, "trace_id": trace, "step": step, "position": 4 + step,
                "token_id": 65 + step, "loss": 0.25 * (step + 1) + seq, "entropy": 1.0, "target_prob": 0.5,
                "latency_ns": latency, "t_start_ns": start, "t_end_ns": start + latency,
                "batch_row": batch_row, "tenant": tenant, "session": f"s-{rid}", "model_id": "m",
                "request_seq": seq, "request_id": rid, "tokens_in_pass": 4 if step == 0 else 1,
            }  # fmt: skip
            for k, v in values.items():
                rows[k].append(v)
    return rows
