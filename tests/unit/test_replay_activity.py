"""CUPTI activity of a replay's passes (llmobs.cupti.replay_activity), with the real collector and the
real replay engine; NVIDIA's `cupti` module is tests/unit/fake_cupti.py (no GPU here: the real module
on a GPU is tests/gpu/test_replay_cuda.py, run by scripts/gpu_check.sh).

- kernels group by the pass that launched them: another thread's kernels and the capture's own ops
  (outside_the_pass) are not a pass's, and the per-pass counts and device time are exact;
- the session holds the process's one CUPTI subscription: a CMD_COLLECT_CUPTI meanwhile is ACK_BUSY,
  and after finish() the live collection starts again; every refusal says why and holds nothing;
- replay_window brackets each replayed pass once, in order, with the capture's ops outside it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from continuous_batching import tiny_llama
from fake_cupti import FakeCupti
from llmobs.cupti.collector import CuptiCollector
from llmobs.cupti.replay_activity import ReplayActivity
from llmobs.publisher.replay import replay_window
from llmobs.shm import layout
from llmobs.shm import writer as writer_mod


@pytest.fixture
def writer(tmp_path):
    w = writer_mod.ShmWriter(shm_dir=str(tmp_path))
    yield w
    w.close()


def _collector(fake) -> CuptiCollector:
    return CuptiCollector(load=lambda: fake, profiler_running=lambda: False)


def test_kernels_are_counted_per_pass_and_other_threads_and_the_captures_ops_are_left_out():
    fake = FakeCupti(buffer_records=5)  # several buffers complete mid-way, on the launching threads
    collector = _collector(fake)
    session, reason = ReplayActivity.start(collector)
    assert session is not None and reason == "" and collector.active and fake.subscribers == 1
    live = threading.Thread(target=lambda: [fake.launch("live_gemm", 9_000) for _ in range(4)])
    session.pass_begin(0)
    fake.launch("gemm", 3_000)
    live.start()
    live.join()
    fake.launch("rmsnorm", 1_000)
    with session.outside_the_pass():
        fake.launch("entropy", 500)
    session.pass_end()
    session.pass_begin(1)
    fake.launch("gemm", 3_000)
    session.pass_end()
    fake.launch("after", 100)  # no pass pushed: not the replay's
    summary = session.finish(3)
    assert summary["status"] == "collected" and summary["reason"] == ""
    assert summary["kernels"] == [2, 1, 0] and summary["kernel_ns"] == [4_000, 3_000, 0]
    assert summary["other_records"] == 6 and summary["dropped_records"] == 0  # live x4, entropy, after
    assert summary["top_kernels"] == [{"name": "gemm", "calls": 2, "ns": 6_000},
                                      {"name": "rmsnorm", "calls": 1, "ns": 1_000}]  # fmt: skip
    assert not collector.active and fake.subscribers == 0 and not fake.enabled
    assert fake.stack_of_this_thread() == []  # every push popped


def test_the_session_holds_cupti_a_live_collection_meanwhile_is_busy_and_runs_after(writer):
    fake = FakeCupti()
    collector = _collector(fake)
    session, _ = ReplayActivity.start(collector)
    status, stop = collector.handle(writer, 4)
    assert (status, stop) == (layout.ACK_BUSY, None) and fake.subscribers == 1
    session.finish(0)
    status, stop = collector.handle(writer, 4)
    assert status == layout.ACK_OK and fake.subscribers == 1  # the live collection's own subscription
    again, reason = ReplayActivity.start(collector)  # and a replay now waits its turn
    assert again is None and "live CUPTI collection" in reason
    stop()  # the drain thread finishes the live collection (MARK_END) and gives CUPTI back
    deadline = time.monotonic() + 10
    while collector.active:
        assert time.monotonic() < deadline, "the live collection never gave CUPTI back"
        time.sleep(0.005)
    after, reason = ReplayActivity.start(collector)
    assert after is not None and reason == ""
    assert after.finish(1)["kernels"] == [0]


@pytest.mark.parametrize("case", ["no collector", "import", "profiler", "subscribe", "enable"])
def test_a_refused_session_says_why_and_holds_nothing(case):
    fake = FakeCupti(subscribed_by="nsys" if case == "subscribe" else None)
    if case == "enable":

        def refuse(kind):
            raise fake.cuptiError("CUPTI_ERROR_NOT_INITIALIZED")

        fake.activity_enable = refuse

    def missing():
        raise ImportError("No module named 'cupti'")

    collector = (
        None
        if case == "no collector"
        else CuptiCollector(
            load=missing if case == "import" else (lambda: fake), profiler_running=lambda: case == "profiler"
        )
    )
    session, reason = ReplayActivity.start(collector)
    expected = {
        "no collector": "no CUPTI collector",
        "import": "cupti-python is not installed",
        "profiler": "PyTorch profiler",
        "subscribe": "CUPTI refused",
        "enable": "CUPTI refused",
    }
    assert session is None and expected[case] in reason
    if collector is not None:
        assert not collector.active and fake.subscribers == 0 and not fake.enabled


class RecordingActivity:
    """The replay engine's side of the contract: which pass each bracket names, and where the
    capture's own ops ran (inside a pass or not)."""

    def __init__(self):
        self.calls: list = []
        self.inside = None

    def pass_begin(self, index):
        assert self.inside is None, "a pass began inside another"
        self.inside = index
        self.calls.append(("begin", index))

    def pass_end(self):
        self.calls.append(("end", self.inside))
        self.inside = None

    def outside_the_pass(self):
        import contextlib

        assert self.inside is not None, "the capture's ops run inside a replayed pass"
        self.calls.append(("own ops", self.inside))
        return contextlib.nullcontext()


def test_replay_window_brackets_each_replayed_pass_once_in_order_with_the_captures_ops_outside():
    model = tiny_llama()
    tokens = torch.arange(1, 13)
    activity = RecordingActivity()
    result = replay_window(model, tokens, 6, 9, repeats=2, activity=activity)
    assert result.status == "ok"
    passes = [call for call in activity.calls if call[0] != "own ops"]
    assert passes == [(kind, k) for k in range(8) for kind in ("begin", "end")]
    own = [k for kind, k in activity.calls if kind == "own ops"]
    # per pass and layer: the attention entropy, the MLP variance and the layer output's copy
    assert own == [k for k in range(8) for _ in range(3 * model.config.num_hidden_layers)]


def _report(gpu) -> dict:
    """The smallest report `replay` prints: an ok replay with no root cause and no trajectory."""
    return {"verdict": "reproduced", "detail": "d", "replay_id": "r", "step": 5, "step_seq": 9,
            "batch_row": 0, "trace_id": "t", "pid": 1, "status": "ok", "source": "prompt", "snapshot_len": 0,
            "repeats": 2,
            "wall_ms": 10.0, "prefill_ms": 1.0, "live_batch_size": 1, "model": "m", "op_graph_hash": "00",
            "linear_calls": 14, "gpu": gpu, "first_diverging_layer": None, "root_cause": None,
            "trajectory": [], "db": "s.duckdb"}  # fmt: skip


def test_the_replay_command_prints_the_gpu_summary_per_pass_and_says_why_when_there_is_none():
    import io

    from llmobs.commands.replay import CPU_REASON, gpu_summary, print_report

    collected = {"status": "collected", "reason": "", "kernels": [10, 12], "kernel_ns": [3_000, 5_000],
                 "copies": [0, 1], "top_kernels": [{"name": "gemm", "calls": 8, "ns": 6_000}],
                 "other_records": 3, "dropped_records": 0}  # fmt: skip
    gpu = gpu_summary(collected)
    assert (gpu["kernels_per_pass"], gpu["kernel_us_per_pass"]) == (11.0, 4.0)
    lines = {}
    for name, summary in [
        ("collected", gpu),
        ("busy", gpu_summary({"status": "off", "reason": "busy now"})),
        ("cpu", gpu_summary({"status": "off", "reason": CPU_REASON})),
        ("old", None),
    ]:
        out = io.StringIO()
        print_report(_report(summary), out)
        lines[name] = [line for line in out.getvalue().splitlines() if "GPU (CUPTI)" in line]
    assert lines["collected"] == [
        "  GPU (CUPTI): 11 kernels and 4.0 us of kernel time per replayed pass; top: gemm 6 us"
    ]
    assert lines["busy"] == ["  GPU (CUPTI): not collected: busy now"]
    assert lines["cpu"] == lines["old"] == []  # a CPU replay, or a file from before: nothing to say
