"""`llmobs-agent trace`: its refusals on real processes (no such pid, not instrumented, a real
instrumented PyTorch process on this GPU-less host), and the whole ask -> collect -> read -> join ->
store path on a real map and a real DuckDB file, with only NVIDIA's cupti module stood in for."""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_cupti import FakeCupti
from llmobs import cli
from llmobs.commands import trace
from llmobs.cupti.collector import CuptiCollector
from llmobs.errors import ExitCode, NoGpu, NoResponse
from llmobs.shm import layout
from llmobs.shm import writer as writer_mod
from llmobs.shm.control import ControlClient
from llmobs.shm.reader import ShmReader

REPO = Path(__file__).resolve().parents[2]
KERNELS = ("gemm_a", "gemm_b", "softmax")
DURATION = {"gemm_a": 5000, "gemm_b": 3000, "softmax": 1000}


def test_no_such_process(capsys):
    assert cli.main(["trace", "--pid", "999999999", "--steps", "2"]) == ExitCode.NO_SUCH_PROCESS
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: no process with pid 999999999"


def test_a_process_that_is_not_instrumented(capsys, tmp_path):
    rc = cli.main(["trace", "--pid", str(os.getpid()), "--shm-dir", str(tmp_path)])
    assert rc == ExitCode.NOT_TRACKED
    assert "publishes no llmobs map" in capsys.readouterr().err.splitlines()[0]


def test_real_instrumented_cpu_workload_says_it_has_no_gpu():
    """A real PyTorch generate loop, instrumented, on this GPU-less host: one line, exit code 10."""
    ready_r, ready_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "workload.py"), "--model", "tiny", "--requests", "0",
         "--max-new-tokens", "4", "--threads", "1", "--ready-fd", str(ready_w)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(ready_w,),
    )  # fmt: skip
    os.close(ready_w)
    try:
        ready, _, _ = select.select([ready_r], [], [], 60)
        assert ready, "the workload did not get ready within 60 s"
        info = json.loads(os.read(ready_r, 4096).decode().splitlines()[0])
        out = subprocess.run(
            [sys.executable, "-m", "llmobs.cli", "trace", "--pid", str(info["pid"]), "--steps", "4",
             "--timeout", "20"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.close(ready_r)
    assert out.returncode == ExitCode.NO_GPU, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == (
        f"error: cannot trace process {info['pid']}: this host has no NVIDIA GPU (/dev/nvidia0 is absent) "
        f"and the process has not loaded the CUDA driver (no libcuda.so in /proc/{info['pid']}/maps)"
    )
    assert lines[1].startswith("hint: ") and len(lines) == 2


def _fake_proc(tmp_path, libs, nvidia0=False):
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    proc.joinpath("maps").write_text(
        "".join(
            f"7f00{i:04x}000-7f00{i:04x}fff r-xp 00000000 08:01 {i} /opt/lib/{lib}\n"
            for i, lib in enumerate(libs)
        )
    )
    dev = tmp_path / "dev"
    dev.mkdir()
    if nvidia0:
        dev.joinpath("nvidia0").write_text("")
    return str(tmp_path / "proc"), str(dev)


@pytest.mark.parametrize(
    ("libs", "nvidia0", "expect"),
    [
        (["libtorch_cpu.so"], True, "it runs no CUDA (its torch is CPU-only"),
        (["libtorch_cuda.so", "libc10_cuda.so"], True, "its torch has CUDA but it has not initialised it"),
        (["libtorch_cpu.so"], False, "this host has no NVIDIA GPU ("),
        (["libtorch_cuda.so", "libcuda.so.1"], True, None),
    ],
)
def test_check_gpu_says_which_reason(tmp_path, libs, nvidia0, expect):
    proc_root, dev_root = _fake_proc(tmp_path, libs, nvidia0)
    if expect is None:
        trace.check_gpu(42, proc_root, dev_root)
        return
    with pytest.raises(NoGpu) as info:
        trace.check_gpu(42, proc_root, dev_root)
    assert expect in str(info.value)


# --- the whole path on a real map: a stepping "workload" thread, the real collector and Tracer -------
class Workload:
    """Token steps in a thread: begin_step, 3 kernel launches, publish the step's record."""

    def __init__(self, writer, fake):
        self.w, self.fake = writer, fake
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.trace_words = (0x0123456789ABCDEF, 0x0FEDCBA987654321)
        self.steps = 0

    def _run(self):
        block = torch.zeros(1, 7)
        hi, lo = self.trace_words
        i = 0
        while not self.stop.is_set():
            t0 = time.monotonic_ns()
            seq = self.w.begin_step(hi, lo, 0, 0)
            for name in KERNELS:
                self.fake.launch(name, DURATION[name])
            self.w.publish_steps(
                block, step_seq=seq, t_start=t0, t_end=time.monotonic_ns(), trace_hi=[hi],
                trace_lo=[lo], tenant_hash=0, session_hash=0, model_hash=0, step=i, position=[i],
                batch_row=[0], kv_len=-1, flags=0,
            )  # fmt: skip
            i += 1
            self.steps = i
            if i > 100_000:
                break

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


@pytest.fixture
def shm(tmp_path):
    w = writer_mod.ShmWriter(shm_dir=str(tmp_path))
    yield w, str(tmp_path)
    writer_mod._command_handlers.pop(layout.CMD_COLLECT_CUPTI, None)
    w.close()


def _args(pid, shm_dir, steps=5, timeout=20.0):
    return argparse.Namespace(pid=pid, steps=steps, timeout=timeout, top=5, quiet=True, shm_dir=shm_dir)


def test_trace_collects_joins_and_stores(shm, tmp_path, capsys):
    w, d = shm
    fake = FakeCupti(buffer_records=32)
    c = CuptiCollector(load=lambda: fake)
    writer_mod.register_command_handler(layout.CMD_COLLECT_CUPTI, c.handle)
    with Workload(w, fake), ShmReader(w.pid, shm_dir=d) as view:
        result = trace.Tracer(view, _args(w.pid, d)).trace()
    s = result["summary"]
    first, last = result["first_step"], result["last_step"]
    assert last - first + 1 == 5
    assert [st.step_seq for st in s.steps] == list(range(first, last + 1))
    trace_hex = "0123456789abcdef0fedcba987654321"
    for st in s.steps:
        assert st.kernels == 3 and st.launches == 6  # cudaLaunchKernel + cuLaunchKernel
        assert st.gpu_ns == st.kernel_ns == sum(DURATION.values())
        assert st.trace_id == trace_hex and st.tokens == 1
    assert s.joined == s.records == 5 * 9 and s.untracked == s.unjoined == 0
    assert [k.name for k in s.top_kernels] == ["gemm_a", "gemm_b", "softmax"]
    assert s.top_kernels[0].count == 5 and s.top_kernels[0].total_ns == 5 * 5000

    trace.print_report(result, top=5)
    report = capsys.readouterr().out
    assert f"steps {first}..{last}" in report and "gemm_a" in report and "clock fit" in report

    out = tmp_path / "t.json"
    trace.write_json(str(out), result)
    doc = json.loads(out.read_text())
    assert doc["kernels"] == 15 and doc["token_steps"] == list(range(first, last + 1))

    db = tmp_path / "store.duckdb"
    trace.store(str(db), result)
    trace.store(str(db), result)  # a second store adds CUPTI rows but never duplicates token steps
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    steps = con.execute("SELECT count(*), count(DISTINCT step_seq) FROM token_steps").fetchone()
    assert steps == (5, 5)
    joined = con.execute(
        """SELECT count(*) FROM gpu_ops g
           JOIN token_steps t ON g.pid = t.pid AND g.external_id = t.step_seq
           WHERE g.source = 'cupti' AND g.name = 'gemm_a'
             AND trace_hex(g.trace_hi, g.trace_lo) = t.trace_id"""
    ).fetchone()[0]
    assert joined == 2 * 5
    rollup = con.execute("SELECT step_seq, gpu_ns FROM step_rollups ORDER BY step_seq").fetchall()
    assert [r[0] for r in rollup] == list(range(first, last + 1))
    assert {r[1] for r in rollup} == {2 * sum(DURATION.values())}  # two stores of the same records
    fits = con.execute("SELECT clock, samples, residual_ns FROM clock_fits").fetchall()
    assert fits and fits[0][0] == "cupti" and fits[0][1] >= 2
    api_gpu = con.execute(
        "SELECT count(*) FROM gpu_ops WHERE probe = 'cupti_runtime' AND gpu_start_ns IS NOT NULL"
    )
    assert api_gpu.fetchone()[0] == 0
    con.close()


def test_trace_of_a_process_whose_torch_has_no_cuda_gets_no_gpu(shm):
    """No collector registered (instrument() saw no CUDA): the writer answers ACK_NO_GPU."""
    w, d = shm
    with Workload(w, FakeCupti()), ShmReader(w.pid, shm_dir=d) as view, pytest.raises(NoGpu) as info:
        trace.Tracer(view, _args(w.pid, d)).trace()
    assert "torch.cuda.is_available() is False" in str(info.value)


def test_idle_process_times_out_and_the_command_is_withdrawn(shm):
    w, d = shm
    with ShmReader(w.pid, shm_dir=d) as view, pytest.raises(NoResponse) as info:
        trace.Tracer(view, _args(w.pid, d, timeout=0.3)).trace()
    assert "did not start a token step within 0.3 s" in str(info.value)
    with ControlClient(w.pid, d) as ctl:
        assert ctl.ack()["cmd"] == layout.CMD_NONE
    w.begin_step(1, 2, 0, 0)  # a step after the withdrawal starts no collection
    assert w._cmd_until is None


def test_gpu_ops_rows_keep_api_records_out_of_gpu_time():
    from llmobs.cupti import protocol as p
    from llmobs.gpu.records import gpu_ops_rows

    recs = np.zeros(3, layout.CUPTI_RECORD.dtype)
    recs["kind"] = [p.KIND_RUNTIME, p.KIND_CONCURRENT_KERNEL, p.KIND_MEMCPY]
    recs["step_seq"] = [4, 4, 0]
    recs["start_ns"], recs["end_ns"] = [10, 20, 40], [15, 30, 45]
    recs["device_id"] = [p.NO_DEVICE, 0, 0]
    rows = gpu_ops_rows(9, recs, {}, {"step_seq": np.array([4]), "trace_id": ["ab" * 16]})
    assert rows["gpu_start_ns"] == [None, 20, 40] and rows["device_id"] == [None, 0, 0]
    assert rows["external_id"] == [4, 4, None] and rows["trace_id"] == ["ab" * 16, "ab" * 16, ""]
    assert rows["probe"] == ["cupti_runtime", "cupti_kernel", "cupti_memcpy"]


def test_cupti_source_hands_the_trace_once_without_steps_the_store_has():
    from llmobs.dataflow import Source
    from llmobs.gpu.cupti_source import CuptiSource
    from llmobs.gpu.records import CuptiCapture

    recs = np.zeros(2, layout.CUPTI_RECORD.dtype)
    recs["step_seq"], recs["start_ns"], recs["end_ns"] = [4, 5], [10, 20], [15, 30]
    steps = {"step_seq": np.array([4, 5, 6]), "t_start_ns": np.array([1, 2, 3]), "trace_id": ["ab" * 16] * 3}
    result = {"pid": 9, "records": recs, "names": {}, "steps": steps, "capture": CuptiCapture()}
    source = CuptiSource(result, stored_steps={4, 6})
    assert isinstance(source, Source)
    batch = source.poll()
    assert set(batch) == {"gpu_ops", "token_steps"} and len(batch["gpu_ops"]["ts_ns"]) == 2
    fresh = batch["token_steps"]
    assert fresh["step_seq"].tolist() == [5] and fresh["trace_id"] == ["ab" * 16]
    assert source.poll() is None
    assert source.stats() == {"records": 2, "token_steps": 1, "already_stored": 2}
    every = CuptiSource(result, stored_steps={4, 5, 6}).poll()
    assert set(every) == {"gpu_ops"}  # all steps stored already: CUPTI rows only
