"""The probes on a real PyTorch process: exact per-step counts, in-kernel tags, 1/N sampling, drops.

One compiled program (cpu, mem and host profiles) serves every test of this module; each test
attaches it to a fresh target and detaches it at the end.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from llmobs.bpf.profiles import PROBE_IDS, probes_of
from llmobs.bpf.program import ProbeProgram
from llmobs.bpf.records import DEFAULT_THIN, FLAG_TRACKED, THINNED_PROBES, trace_kept
from llmobs.bpf.session import AttachSession, Options
from test_probes_target import GEMM_FLOPS, LINEAR_OUTPUT_BYTES, Target, leftovers

EXACT = ("alloc_cpu", "free_cpu", "sgemm", "linear", "ioctl")


@pytest.fixture(scope="module")
def program():
    program = ProbeProgram(probes_of(("cpu", "gemm", "mem", "host")))
    yield program
    program.close()


def _attach(program, target, **options) -> AttachSession:
    options.setdefault("profiles", ("cpu", "gemm", "mem", "host"))
    options.setdefault("ioctl_paths", "/dev/null")
    session = AttachSession(target.pid, Options(**options), program=program)
    session.start()
    return session


PROBE_IDS_INV = {index: name for name, index in PROBE_IDS.items()}


def _trace(i: int) -> str:
    return f"{0x1000 + i:016x}{i:016x}"


def _by_name(final) -> dict[tuple[str, int], list[int]]:
    """(probe name, step_seq) -> [count, sum_value, sum_duration_ns] from the exact aggregates."""
    return {(PROBE_IDS_INV[probe], step): value for (_, probe, step), value in final["totals"].items()}


def test_exact_counts_and_tags_per_step(program, targets):
    plan = {1: (5, 100_000, 3, 2), 2: (0, 64, 7, 0), 3: (11, 4096, 1, 5)}  # allocs, nbytes, gemms, ioctls
    with targets.take() as target:
        session = _attach(program, target, gemm_durations=True)
        assert session.cell_address == target.cell_address  # found through /proc/PID/maps
        batches = []
        for step, (allocs, nbytes, gemms, ioctls) in plan.items():
            target.step(step, _trace(step), allocs, nbytes, gemms, ioctls)
            batches.append(session.poll())
        last, final = session.close()
    events = np.concatenate(batches + [last])
    totals = _by_name(final)
    for step, (allocs, nbytes, gemms, ioctls) in plan.items():
        expected_bytes = allocs * nbytes + gemms * LINEAR_OUTPUT_BYTES
        assert totals[("alloc_cpu", step)][:2] == [allocs + gemms, expected_bytes]
        assert totals[("free_cpu", step)][:2] == [allocs + gemms, expected_bytes]
        assert totals[("sgemm", step)][:2] == [gemms, gemms * GEMM_FLOPS]
        assert totals[("linear", step)][0] == gemms  # one at::linear per F.linear
        assert totals.get(("ioctl", step), [0])[0] == ioctls
        assert totals[("alloc_cpu", step)][2] > 0 and totals[("sgemm", step)][2] > 0  # durations from returns
    # with --sample 1 every counted event is also in the ring, tagged with its step's trace (but a
    # thinned probe's: test_a_thinned_probe_counts_every_fault_and_ships_one_in_thin)
    pairs = zip(events["probe"].tolist(), events["step_seq"].tolist(), strict=True)
    sampled = Counter((PROBE_IDS_INV[probe], step) for probe, step in pairs)
    for (name, step), (count, _, _) in totals.items():
        if name not in THINNED_PROBES:
            assert sampled[(name, step)] == count, (name, step)
    mine = events[events["pid"] == target.pid]
    tagged = mine[mine["step_seq"] != 0]
    expected_hi = np.array([0x1000 + s for s in tagged["step_seq"].tolist()], dtype=np.uint64)
    assert (tagged["trace_id_hi"] == expected_hi).all() and (
        tagged["trace_id_lo"] == tagged["step_seq"]
    ).all()
    assert (tagged["flags"] & FLAG_TRACKED).all()
    assert final["counters"]["ring_drops"] == 0 and final["counters"]["agg_overflow"] == 0
    assert final["problems"] == []


# Two threads that make `n` ioctls each on /dev/null at the same moment (a barrier), after a line on
# stdin; the descriptor is open before "ready", so the agent watches it from its attach.
PAIR_C = r"""
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
static int fd;
static long n;
static pthread_barrier_t start;
static void *spin(void *unused) {
    int value;
    pthread_barrier_wait(&start);
    for (long i = 0; i < n; i++) ioctl(fd, FIONREAD, &value);
    return unused;
}
int main(int argc, char **argv) {
    char line[16];
    pthread_t threads[2];
    n = atol(argv[1]);
    fd = open("/dev/null", O_RDONLY);
    pthread_barrier_init(&start, NULL, 2);
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (int t = 0; t < 2; t++) pthread_create(&threads[t], NULL, spin, NULL);
    for (int t = 0; t < 2; t++) pthread_join(threads[t], NULL);
    printf("done\n");
    fflush(stdout);
    return fgets(line, sizeof line, stdin) ? 0 : 0;
}
"""


def test_counts_stay_exact_when_two_cpus_add_to_one_key_at_once(program, tmp_path):
    """Two threads of one process, each on its own CPU, hit the ioctl pair at the same time: every hit
    is added to the same (pid, probe, step) key of the shared aggregates, and none is lost (the adds are
    atomic: a plain add lost 46-115 of the 400,000 here). Where the host has two CPUs."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the two threads never add at the same moment")
    source, binary, ioctls = tmp_path / "pair.c", tmp_path / "pair", 200_000
    source.write_text(PAIR_C)
    subprocess.run(["gcc", "-O2", "-pthread", "-o", str(binary), str(source)], check=True)
    target = subprocess.Popen([str(binary), str(ioctls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert target.stdout.readline() == b"ready\n"
        session = _attach(program, SimpleNamespace(pid=target.pid), profiles=("host",), require_pytorch=False)
        target.stdin.write(b"go\n")
        target.stdin.flush()
        assert target.stdout.readline() == b"done\n"
        _last, final = session.close()
    finally:
        target.kill()
        target.wait()
    assert _by_name(final)[("ioctl", 0)][0] == 2 * ioctls  # no context cell: step 0
    assert final["counters"]["agg_overflow"] == 0


def test_process_without_a_map_is_untracked(program):
    with Target("--no-map") as target:
        session = _attach(program, target)
        assert session.cell_address == 0
        target.step(9, _trace(9), allocs=6, nbytes=512, gemms=2)
        events, final = session.close()
    totals = _by_name(final)
    assert totals[("alloc_cpu", 0)][:2] == [8, 6 * 512 + 2 * LINEAR_OUTPUT_BYTES]
    assert all(step == 0 for _, step in totals)
    assert (events["step_seq"] == 0).all() and (events["trace_id_hi"] == 0).all()
    assert not (events["flags"] & FLAG_TRACKED).any()


def test_trace_sampling_keeps_requests_whole_and_counts_all(program, targets):
    n, traces = 4, 64
    ids = [
        (int.from_bytes(os.urandom(8), "big"), int.from_bytes(os.urandom(8), "big")) for _ in range(traces)
    ]
    with targets.take() as target:
        session = _attach(program, target, sample_n=n, sample_mode="trace", thin=1)  # every event: whole
        batches = []
        for i, (hi, lo) in enumerate(ids):
            for step in (2 * i + 1, 2 * i + 2):  # two token steps per request
                target.step(step, f"{hi:016x}{lo:016x}", allocs=3, nbytes=256, gemms=1)
            batches.append(session.poll())
        last, final = session.close()
    events = np.concatenate(batches + [last])
    totals = {key: value[0] for key, value in _by_name(final).items()}
    for step in range(1, 2 * traces + 1):  # the aggregates count everything, sampled or not
        assert (
            totals[("alloc_cpu", step)] == 4
            and totals[("free_cpu", step)] == 4
            and totals[("sgemm", step)] == 1
        )
    kept = 0
    for i, (hi, lo) in enumerate(ids):
        mine = events[(events["trace_id_hi"] == hi) & (events["trace_id_lo"] == lo)]
        exact = mine[np.isin(mine["probe"], [PROBE_IDS[name] for name in EXACT])]
        expected = trace_kept(hi, lo, n)
        # whole or nothing: both steps' 10 alloc/free/GEMM/linear events, or none of them
        assert len(exact) == (20 if expected else 0), (i, len(exact))
        if not expected:
            assert len(mine) == 0  # no event of a dropped request leaks out (off-CPU, faults included)
        kept += expected
    # binomial(64, 1/4): mean 16, sd 3.5; outside [2, 34] has probability < 1e-6
    assert 2 <= kept <= 34
    assert set(np.unique(events["step_seq"][events["step_seq"] != 0])) <= set(range(1, 2 * traces + 1))


def test_a_thinned_probe_counts_every_fault_and_ships_one_in_thin(program, targets):
    """page_fault_user, thinned: a step's faults are all in its aggregate, 1 in 64 of them reach the
    ring (per CPU, every THIN-th), and the kernel's ledger still closes: the thinned are counted."""
    plan = {1: 3000, 2: 0, 3: 1000}  # pages written once each in a fresh mapping: one fault each
    with targets.take() as target:
        session = _attach(program, target)
        batches = []
        for step, pages in plan.items():
            target.step(step, _trace(step), pages=pages)
            batches.append(session.poll())
        last, final = session.close()
    events = np.concatenate(batches + [last])
    faults = events[(events["probe"] == PROBE_IDS["page_fault_user"]) & (events["pid"] == target.pid)]
    counts = {key: value[0] for key, value in _by_name(final).items()}
    counted = 0
    for step, pages in plan.items():
        count = counts.get(("page_fault_user", step), 0)
        assert pages <= count < pages + 200, (step, count)  # the interpreter's own faults on top
        shipped = int((faults["step_seq"] == step).sum())
        # each CPU ships every THIN-th of its hits: per step, within a CPU count of count / THIN
        assert abs(shipped - count / DEFAULT_THIN) <= os.cpu_count(), (step, shipped, count)
        counted += count
    tagged_shipped = int((faults["step_seq"] != 0).sum())
    assert tagged_shipped + final["counters"]["thinned"] == counted  # nothing tagged is unaccounted for
    assert final["counters"]["ring_drops"] == 0


def test_cpu_sampling_is_about_one_in_n(program, targets):
    n, allocs = 8, 4000
    with targets.take() as target:
        session = _attach(program, target, profiles=("mem",), sample_n=n, sample_mode="cpu")
        target.step(1, _trace(1), allocs=allocs, nbytes=64)
        events, final = session.close()
    totals = {key: value[0] for key, value in _by_name(final).items()}
    assert totals[("alloc_cpu", 1)] == allocs and totals[("free_cpu", 1)] == allocs
    sampled = int(((events["probe"] == PROBE_IDS["alloc_cpu"]) & (events["step_seq"] == 1)).sum())
    # ~500 expected; a hash of a counter, so binomial-like: sd ~21, the bound is > 7 sd wide
    assert 350 <= sampled <= 650


def test_ring_overflow_is_counted_not_lost_silently(targets):
    program = ProbeProgram(probes_of(("mem",)), ring_bytes=4096)  # room for 56 records
    try:
        with targets.take() as target:
            session = AttachSession(target.pid, Options(profiles=("mem",)), program=program)
            session.start()
            target.step(1, _trace(1), allocs=500, nbytes=64)  # 1,000 events, no drain meanwhile
            events, final = session.close()
    finally:
        program.close()
    counted = sum(value[0] for value in final["totals"].values())
    counters = final["counters"]
    assert counted >= 1000
    assert counters["ring_drops"] > 0
    assert len(events) == counters["sampled"] <= 56
    assert counters["sampled"] + counters["ring_drops"] == counted + counters["agg_overflow"]


def test_session_close_detaches_everything(program, targets):
    with targets.take() as target:
        session = _attach(program, target)
        assert leftovers(agent_pid=os.getpid())["perf"]  # attached: our perf events are visible
        target.proc.kill()
        target.proc.wait()
        assert not session.target_alive()
        session.close()
    left = leftovers(agent_pid=os.getpid(), target_pid=target.pid)
    assert left["perf"] == [] and left["uprobe_events"] == []


def test_a_switched_off_probe_counts_nothing_and_counts_again_when_on(program, targets):
    """The governor's switch word (ProbeProgram.set_probe_enabled) on the real kernel: the ioctl
    tracepoint pair and the linear uprobe, counted exactly with the word on, off and on again; a probe
    left on is not touched by another's word."""
    with targets.take() as target:
        session = _attach(program, target)
        try:
            target.step(1, _trace(1), gemms=40, ioctls=50)
            assert program.set_probe_enabled("ioctl", False) and program.set_probe_enabled("linear", False)
            assert not program.set_probe_enabled("ioctl", False)  # already off: no change
            assert not program.probe_enabled("ioctl") and program.probe_enabled("sgemm")
            target.step(2, _trace(2), gemms=40, ioctls=50)
            assert program.set_probe_enabled("ioctl", True) and program.set_probe_enabled("linear", True)
            target.step(3, _trace(3), gemms=40, ioctls=50)
            _events, final = session.close()
        finally:
            program.set_probe_enabled("ioctl", True)
            program.set_probe_enabled("linear", True)
    counts = {key: value[0] for key, value in _by_name(final).items()}
    for step in (1, 3):
        assert counts.get(("ioctl", step)) == 50 and counts.get(("linear", step)) == 40, counts
    assert ("ioctl", 2) not in counts and ("linear", 2) not in counts, counts
    assert counts.get(("sgemm", 2)) == 40  # its word stayed on
