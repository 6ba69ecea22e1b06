"""The in-process CUPTI collector on a real map, driven through the real control block.

No GPU here, so NVIDIA's `cupti` module is replaced by tests/unit/fake_cupti.py where a GPU would be
needed; the collector, the writer, the control block, the drain thread, the ring and the reader are
the real ones. The error paths use the real cupti-python (installed, but no driver here).
"""

from __future__ import annotations

import time

import pytest
from fake_cupti import CLOCK_OFFSET_NS, FakeCupti
from llmobs.cupti import protocol as p
from llmobs.cupti.collector import CuptiCollector, load_cupti
from llmobs.gpu.records import CuptiCapture
from llmobs.shm import layout
from llmobs.shm import writer as writer_mod
from llmobs.shm.control import ControlClient
from llmobs.shm.reader import ShmReader

WAIT_S = 10.0


@pytest.fixture
def shm(tmp_path):
    w = writer_mod.ShmWriter(shm_dir=str(tmp_path))
    yield w, str(tmp_path)
    writer_mod._command_handlers.pop(layout.CMD_COLLECT_CUPTI, None)
    w.close()


def _collector(fake=None, **kwargs) -> CuptiCollector:
    c = CuptiCollector(load=(lambda: fake) if fake is not None else load_cupti, **kwargs)
    writer_mod.register_command_handler(layout.CMD_COLLECT_CUPTI, c.handle)
    return c


def _read_until_end(reader, cursor=0, timeout=WAIT_S) -> CuptiCapture:
    """Poll the ring (a file condition, bounded) until the collector's MARK_END arrives."""
    cap = CuptiCapture()
    deadline = time.monotonic() + timeout
    while cap.end is None:
        reader.refresh()
        got = reader.read_cupti(cursor)
        cap.add(got)
        cursor = got.next_cursor
        if cap.end is None:
            assert time.monotonic() < deadline, "the collector never wrote MARK_END"
            time.sleep(0.005)
    return cap


def _steps(w, fake, n, kernels=3):
    """n token steps, each launching `kernels` kernels; returns [(step_seq, mono_before, mono_after)]."""
    out = []
    for _ in range(n):
        before = time.monotonic_ns()
        seq = w.begin_step(1, 2, 0, 0)
        for i in range(kernels):
            fake.launch(f"gemm_kernel_{i}")
        out.append((seq, before, time.monotonic_ns()))
    return out


def test_collects_k_steps_tagged_with_their_step(shm):
    w, d = shm
    fake = FakeCupti(buffer_records=16)
    c = _collector(fake)
    _steps(w, fake, 2)  # before the command: nothing is enabled, nothing recorded
    with ControlClient(w.pid, d) as ctl:
        seq = ctl.post(layout.CMD_COLLECT_CUPTI, 4)
        timeline = _steps(w, fake, 6)  # the command takes effect at the first of these
        ack = ctl.ack()
    assert ack["ack_seq"] == seq and ack["ack_status"] == layout.ACK_OK
    first = ack["ack_step_seq"]
    assert first == timeline[0][0]
    with ShmReader(w.pid, shm_dir=d) as r:
        cap = _read_until_end(r)
        r.read_names()
        names = r.names
    assert cap.end.first_step == first and cap.end.last_step == first + 3
    assert ack["done_step_seq"] == 0 or ack["done_step_seq"] >= first + 4
    recs = cap.array()
    kernels = recs[recs["kind"] == p.KIND_CONCURRENT_KERNEL]
    # exactly the K collected steps, 3 kernels each, each tagged with the step it was launched in
    assert sorted(set(kernels["step_seq"].tolist())) == list(range(first, first + 4))
    assert len(kernels) == 12
    assert cap.end.written == len(recs) == 12 * 3  # runtime + driver + kernel per launch
    assert cap.end.unattributed == 0 and cap.end.cupti_dropped == 0 and cap.end.collector_dropped == 0
    assert {names[h] for h in kernels["name_hash"].tolist()} == {f"gemm_kernel_{i}" for i in range(3)}
    api = recs[recs["kind"] == p.KIND_RUNTIME]
    assert {names[h] for h in api["name_hash"].tolist()} == {"cudaLaunchKernel"}
    assert set(api["device_id"].tolist()) == {p.NO_DEVICE}
    # CUPTI time was fitted to CLOCK_MONOTONIC: each kernel starts inside its step's window
    window = {seq: (lo, hi) for seq, lo, hi in timeline}
    for k in kernels:
        lo, hi = window[int(k["step_seq"])]
        assert lo - 50_000 <= int(k["start_ns"]) <= hi + 50_000
        assert int(k["end_ns"]) - int(k["start_ns"]) == 2000
    assert cap.clock is not None and cap.clock.samples >= 2
    assert abs(cap.clock.offset_ns - CLOCK_OFFSET_NS) < 50_000
    assert cap.clock.residual_ns < 50_000
    # off again: a later step records nothing and the collector gave CUPTI back
    assert fake.enabled == set() and fake.subscribers == 0
    assert all(stack == [] for stack in fake.stacks.values())
    assert w.step_hook is None
    assert not c.active


def test_records_whose_correlation_comes_later_wait_for_it(shm):
    """A buffer boundary between an API call's EXTERNAL_CORRELATION and its kernel: still joined."""
    w, d = shm
    fake = FakeCupti(buffer_records=2)  # every buffer splits a launch's records
    _collector(fake)
    with ControlClient(w.pid, d) as ctl:
        ctl.post(layout.CMD_COLLECT_CUPTI, 2)
        _steps(w, fake, 3, kernels=5)
    with ShmReader(w.pid, shm_dir=d) as r:
        cap = _read_until_end(r)
    recs = cap.array()
    assert len(recs) == 2 * 5 * 3
    assert 0 not in set(recs["step_seq"].tolist())
    assert cap.end.unattributed == 0


def test_a_second_command_while_collecting_is_refused_busy(shm):
    w, d = shm
    fake = FakeCupti()
    _collector(fake)
    with ControlClient(w.pid, d) as ctl:
        ctl.post(layout.CMD_COLLECT_CUPTI, 50)
        _steps(w, fake, 1)
        seq = ctl.post(layout.CMD_COLLECT_CUPTI, 5)
        _steps(w, fake, 1)
        ack = ctl.ack()
    assert ack["ack_seq"] == seq and ack["ack_status"] == layout.ACK_BUSY


def _status_reason(w, d) -> tuple[int, str]:
    with ShmReader(w.pid, shm_dir=d) as r:
        r.refresh()
        cap = CuptiCapture()
        cap.add(r.read_cupti(0))
        r.read_names()
        status, _, h = cap.statuses[-1]
        return status, r.name(h)


def test_without_cupti_python_it_says_so(shm):
    w, d = shm

    def missing():
        raise ImportError("No module named 'cupti'")

    c = CuptiCollector(load=missing)
    writer_mod.register_command_handler(layout.CMD_COLLECT_CUPTI, c.handle)
    with ControlClient(w.pid, d) as ctl:
        ctl.post(layout.CMD_COLLECT_CUPTI, 3)
        w.begin_step(1, 2, 0, 0)
        assert ctl.ack()["ack_status"] == layout.ACK_UNSUPPORTED
    status, reason = _status_reason(w, d)
    assert status == layout.ACK_UNSUPPORTED and "cupti-python is not installed" in reason


def test_real_cupti_python_without_a_driver_answers_no_gpu(shm):
    """The real cupti-python on this GPU-less host: subscribe fails for want of libcuda."""
    pytest.importorskip("cupti")
    w, d = shm
    c = _collector()
    with ControlClient(w.pid, d) as ctl:
        ctl.post(layout.CMD_COLLECT_CUPTI, 3)
        w.begin_step(1, 2, 0, 0)
        assert ctl.ack()["ack_status"] == layout.ACK_NO_GPU
    status, reason = _status_reason(w, d)
    assert status == layout.ACK_NO_GPU and "no CUDA driver" in reason
    assert not c.active and w.step_hook is None


def test_yields_to_a_running_pytorch_profiler(shm):
    """The real torch profiler (CPU activities) is running: the collector refuses, CUPTI untouched."""
    torch = pytest.importorskip("torch")
    w, d = shm
    fake = FakeCupti()
    _collector(fake)
    with (
        ControlClient(w.pid, d) as ctl,
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
    ):
        ctl.post(layout.CMD_COLLECT_CUPTI, 3)
        w.begin_step(1, 2, 0, 0)
        assert ctl.ack()["ack_status"] == layout.ACK_BUSY
    status, reason = _status_reason(w, d)
    assert "PyTorch profiler" in reason
    assert fake.subscribers == 0 and fake.enabled == set()


def test_another_subscriber_owning_cupti_is_busy(shm):
    w, d = shm
    _collector(FakeCupti(subscribed_by="kineto"))
    with ControlClient(w.pid, d) as ctl:
        ctl.post(layout.CMD_COLLECT_CUPTI, 3)
        w.begin_step(1, 2, 0, 0)
        assert ctl.ack()["ack_status"] == layout.ACK_BUSY
    assert "another tool owns CUPTI" in _status_reason(w, d)[1]


def test_profiler_starting_mid_collection_makes_it_yield(shm):
    w, d = shm
    fake = FakeCupti()
    running = {"on": False}
    _collector(fake, profiler_running=lambda: running["on"])
    with ControlClient(w.pid, d) as ctl:
        ctl.post(layout.CMD_COLLECT_CUPTI, 10)
        _steps(w, fake, 2)
        running["on"] = True
        _steps(w, fake, 1)
    with ShmReader(w.pid, shm_dir=d) as r:
        cap = _read_until_end(r)
    assert cap.end.lost_ownership
    assert fake.enabled == set() and fake.subscribers == 0
    assert set(cap.array()["step_seq"].tolist()) == {cap.end.first_step, cap.end.first_step + 1}


def test_buffer_callback_only_queues_and_counts_overflow():
    c = CuptiCollector(load=FakeCupti)
    for _ in range(300):
        c._buffer_completed([object(), object()])
    assert len(c._buffers) == 256
    assert c.queue_dropped == 2 * (300 - 256)


def test_install_registers_nothing_without_cuda(shm):
    """On this CPU-only torch, install() leaves the writer's own answer: ACK_NO_GPU."""
    import llmobs.cupti as lc

    lc._collector = None
    assert lc.install() is None
    assert layout.CMD_COLLECT_CUPTI not in writer_mod._command_handlers
    w, d = shm
    with ControlClient(w.pid, d) as ctl:
        ctl.post(layout.CMD_COLLECT_CUPTI, 3)
        w.begin_step(1, 2, 0, 0)
        assert ctl.ack()["ack_status"] == layout.ACK_NO_GPU
    forced = lc.install(force=True)
    try:
        assert forced is not None
        assert writer_mod._command_handlers[layout.CMD_COLLECT_CUPTI] == forced.handle
    finally:
        lc._collector = None


def test_external_ids_are_pushed_and_popped_per_thread(shm):
    """CUPTI's external-id stack is per thread: a step begun on another thread must not pop ours."""
    import threading

    w, d = shm
    fake = FakeCupti()
    c = _collector(fake)
    with ControlClient(w.pid, d) as ctl:
        ctl.post(layout.CMD_COLLECT_CUPTI, 3)
        first = _steps(w, fake, 1)[0][0]
        other = threading.Thread(target=_steps, args=(w, fake, 1))
        other.start()
        other.join(10)
        assert fake.stack_of_this_thread() == [first]  # ours is still there, untouched
        w.clear_context()  # the request on this thread ends: our id comes off our stack
        assert fake.stack_of_this_thread() == []
        _steps(w, fake, 2)
    with ShmReader(w.pid, shm_dir=d) as r:
        cap = _read_until_end(r)
    assert c.last_error is None
    kernels = cap.array()[cap.array()["kind"] == p.KIND_CONCURRENT_KERNEL]
    assert sorted(set(kernels["step_seq"].tolist())) == [first, first + 1, first + 2]
