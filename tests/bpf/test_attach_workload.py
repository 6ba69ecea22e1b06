"""`attach` on the project's demo workload (scripts/workload.py --model tiny, a real GPT-2 generating
tokens through the real map writer): every event carries the (trace, step) the map records for that
step, the exact totals cover every token step, and `--sample` keeps traces whole. (The statistical
1/N bound over many random traces is in test_probes.py: this workload has only 4 distinct traces.)"""

from __future__ import annotations

import signal
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
from llmobs.bpf.records import DEFAULT_THIN, THINNED_PROBES, trace_kept
from llmobs.shm.reader import ShmReader
from test_attach import Agent, _assert_clean
from test_cpu_priority import CaseWorkload, enter_together, exit_together
from test_probes_target import leftovers

REQUESTS, TOKENS, SAMPLE = 24, 4, 2  # the workload's 4 prompts -> 4 trace ids (hash of the input ids)
ALLOC_BYTES = 123_457  # test_known_allocations_per_step's size: nothing else in the process allocates it
TINY = ("--model", "tiny", "--threads", "1")
WORKLOADS = {  # each test's workload
    "tags": (*TINY, "--requests", str(REQUESTS), "--max-new-tokens", str(TOKENS)),
    "allocs": (*TINY, "--requests", "6", "--max-new-tokens", "4", "--alloc-bytes", str(ALLOC_BYTES)),
}


@pytest.fixture(scope="module")
def workloads():
    """Each test's workload, started at once (each loads torch and its model: ~7 s, spent side by side
    instead of one after the other) and held until the module's tests are done."""
    started = {key: CaseWorkload(*args) for key, args in WORKLOADS.items()}
    enter_together(*started.values())
    try:
        yield started
    finally:
        exit_together(*started.values())


def test_tags_match_the_map_and_sampling_keeps_requests_whole(tmp_path, workloads):
    out = tmp_path / "w.parquet"
    before = leftovers()
    workload = workloads["tags"]
    agent = Agent(
        "--pid",
        str(workload.pid),
        "--profile",
        "cpu,gemm,host",
        "--sample",
        str(SAMPLE),
        "--out",
        str(out),
    )
    agent.wait_for("attached in")
    workload.generate()
    with ShmReader(workload.pid) as reader:  # what the map says each token step was
        steps = reader.read_steps().rows()
    agent.proc.send_signal(signal.SIGINT)
    code, text = agent.finish()
    assert code == 0, text
    _assert_clean(agent.pid, workload.pid, before)
    trace_of = {row["step_seq"]: row["trace_id"] for row in steps}
    position = {row["step_seq"]: row["step"] for row in steps}
    assert len(trace_of) == REQUESTS * TOKENS
    events = pq.read_table(out).to_pylist()
    aggregates = pq.read_table(out.with_suffix(".aggregates.parquet")).to_pylist()
    gemms = {row["step_seq"]: row["count"] for row in aggregates if row["probe"] == "sgemm"}
    # exact totals: every token step of every request did its GEMMs, sampled or not; the trace id is
    # the hash of the prompt, so the same prompt at the same token index repeats the same GEMM calls
    assert set(trace_of) <= set(gemms)
    repeats = defaultdict(set)
    for step_seq, trace in trace_of.items():
        repeats[(trace, position[step_seq])].add(gemms[step_seq])
    assert all(len(counts) == 1 for counts in repeats.values()), repeats
    assert len(repeats) == len({trace for trace, _ in repeats}) * TOKENS
    # every sampled event is tagged with the trace the map shows for its step
    tagged = [e for e in events if e["step_seq"]]
    assert tagged or not any(trace_kept(int(t[:16], 16), int(t[16:], 16), SAMPLE) for t in trace_of.values())
    assert all(e["trace_id"] == trace_of[e["step_seq"]] for e in tagged if e["step_seq"] in trace_of)
    # 1 in SAMPLE requests; a thinned probe's tagged events also 1 in DEFAULT_THIN of those
    ratios = {(e["probe"] in THINNED_PROBES and e["step_seq"] != 0, e["sample_ratio"]) for e in events}
    assert {ratio for thinned, ratio in ratios if not thinned} == {SAMPLE}
    assert {ratio for thinned, ratio in ratios if thinned} <= {SAMPLE * DEFAULT_THIN}
    # whole traces: all of a trace's GEMMs are sampled or none, exactly as the kernel's hash decides
    sampled = defaultdict(int)
    for e in tagged:
        if e["probe"] == "sgemm":
            sampled[e["trace_id"]] += 1
    for trace in set(trace_of.values()):
        total = sum(gemms[s] for s, t in trace_of.items() if t == trace)
        keep = trace_kept(int(trace[:16], 16), int(trace[16:], 16), SAMPLE)
        assert sampled[trace] == (total if keep else 0), (trace, keep)


def test_known_allocations_per_step(tmp_path, workloads):
    """workload.py --alloc-bytes B: every forward pass allocates exactly 1 + step_seq % 3 tensors of B
    bytes (and frees them in the same step); the agent sees exactly those, tagged with that step."""
    out, nbytes = tmp_path / "a.parquet", ALLOC_BYTES
    before = leftovers()
    workload = workloads["allocs"]
    agent = Agent("--pid", str(workload.pid), "--profile", "cpu,mem,host", "--out", str(out))
    agent.wait_for("attached in")
    workload.generate()
    with ShmReader(workload.pid) as reader:
        steps = [row["step_seq"] for row in reader.read_steps().rows()]
    agent.proc.send_signal(signal.SIGINT)
    code, text = agent.finish()
    assert code == 0, text
    _assert_clean(agent.pid, workload.pid, before)
    assert len(steps) == 24
    events = pq.read_table(out).to_pylist()
    allocs, frees = defaultdict(int), defaultdict(int)
    for e in events:
        if e["value"] == nbytes and e["probe"] == "alloc_cpu":
            allocs[e["step_seq"]] += 1
        elif e["value"] == nbytes and e["probe"] == "free_cpu":
            frees[e["step_seq"]] += 1
    expected = {step: 1 + step % 3 for step in steps}
    assert dict(allocs) == expected
    assert dict(frees) == expected
