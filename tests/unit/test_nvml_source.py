"""NvmlSource, the live Source of gpu_samples: the real nvidia-ml-py on this GPU-less host (one status
line, then None for good), and rows, tracking and failures with pynvml's functions stood in for."""

from __future__ import annotations

import os

import numpy as np
import pytest
from fake_nvml import FakeNvml
from llmobs import clock
from llmobs.dataflow import Source
from llmobs.gpu import nvml_source
from llmobs.gpu.nvml import DeviceSample, ProcessSample
from llmobs.gpu.nvml_source import COLUMNS, MAX_FAILED_POLLS, NvmlSource, split_by_pid


def test_this_host_without_a_gpu_says_so_once_and_polls_none_after():
    pytest.importorskip("pynvml")
    lines = []
    source = NvmlSource(say=lines.append)  # the real pynvml: libnvidia-ml.so.1 is not on this host
    assert isinstance(source, Source)
    source.track(os.getpid())
    assert [source.poll() for _ in range(50)] == [None] * 50
    assert lines == ["nvml: off: no NVIDIA driver on this host (libnvidia-ml.so.1 not found); "
                     "the agent runs on without GPU samples"]  # fmt: skip
    assert source.status == lines[0] and not source.available
    assert source.stats()["available"] == 0 and source.stats()["polls"] == 0
    source.close()


def test_nvidia_ml_py_missing_is_loaded_once_then_none_cheaply():
    loads = []

    def missing():
        loads.append(1)
        raise ImportError("No module named 'pynvml'")

    lines = []
    source = NvmlSource(load=missing, say=lines.append)
    source.track(1)
    assert all(source.poll() is None for _ in range(20))
    assert len(loads) == 1 and len(lines) == 1 and "nvidia-ml-py is not installed" in lines[0]


def test_without_say_the_source_prints_nothing_and_keeps_the_line_in_status(capsys):
    source = NvmlSource(load=lambda: (_ for _ in ()).throw(ImportError("no pynvml")))
    source.track(1)
    assert source.poll() is None and "nvidia-ml-py is not installed" in source.status
    assert capsys.readouterr() == ("", "")  # the runtime prints `status`, once


def test_rows_of_tracked_pids_only_with_device_numbers_beside():
    fake = FakeNvml()
    lines = []
    source = NvmlSource(load=lambda: fake, say=lines.append)
    assert source.poll() is None  # opened, but nothing tracked: nothing read
    assert lines == ["nvml: sampling 2 GPU(s) at 1 Hz"] and fake.calls == 0
    source.track(100)
    source.track(200)  # on no GPU: no rows
    before = clock.monotonic_ns()
    batch = source.poll()
    assert set(batch) == {"gpu_samples"}
    rows = batch["gpu_samples"]
    assert tuple(rows) == COLUMNS
    assert rows["pid"].tolist() == [100] and rows["gpu_index"].tolist() == [0]
    assert before <= int(rows["ts_ns"][0]) <= clock.monotonic_ns()
    assert rows["gpu_uuid"] == ["GPU-0000-h0"] and rows["gpu_name"] == ["NVIDIA H200"]
    assert (rows["sm_util"], rows["mem_util"], rows["mem_used"]) == ([70], [25], [3 << 30])
    assert rows["gpu_util"].tolist() == [75] and rows["gpu_mem_util"].tolist() == [30]
    assert rows["device_mem_used"].tolist() == [5 << 30] and rows["device_mem_total"].tolist() == [141 << 30]
    assert source.stats() == {"polls": 1, "rows": 1, "read_errors": 0, "gpus": 2, "available": 1}
    assert not source.sampler.devices and not source.sampler.processes  # nothing piles up undrained
    source.untrack(100)
    assert source.poll() is None
    source.close()
    assert fake.shutdowns == 1 and source.poll() is None


def test_nvml_without_a_figure_is_null_not_minus_one():
    fake = FakeNvml(devices=1)
    fake.nvmlDeviceGetProcessUtilization = lambda h, last: (_ for _ in ()).throw(RuntimeError("NOT_FOUND"))
    source = NvmlSource(load=lambda: fake, say=lambda line: None)
    source.track(100)
    rows = source.poll()["gpu_samples"]
    assert rows["sm_util"] == [None] and rows["mem_util"] == [None] and rows["mem_used"] == [3 << 30]


def test_a_gpu_failing_mid_run_is_one_status_line_then_off_never_an_exception():
    fake = FakeNvml(devices=1)
    lines = []
    source = NvmlSource(load=lambda: fake, say=lines.append)
    source.track(100)
    assert source.poll() is not None

    def lost(h):
        raise RuntimeError("GPU is lost")

    fake.nvmlDeviceGetUtilizationRates = lost
    results = [source.poll() for _ in range(MAX_FAILED_POLLS - 1)]
    assert results == [None] * (MAX_FAILED_POLLS - 1) and source.available
    assert lines[1:] == ["nvml: read failed, that GPU's samples are skipped: GPU 0: GPU is lost"]
    assert source.poll() is None and not source.available  # the 10th in a row: off, said once
    assert lines[2:] == ["nvml: off: every GPU read failed 10 times in a row (GPU 0: GPU is lost); "
                         "the agent runs on without GPU samples"]  # fmt: skip
    assert source.status == lines[-1] and source.stats()["read_errors"] == MAX_FAILED_POLLS
    fake.nvmlDeviceGetUtilizationRates = lambda h: pytest.fail("a source that is off asked NVML again")
    assert all(source.poll() is None for _ in range(5)) and len(lines) == 3


def test_one_gpu_failing_while_another_reads_keeps_the_source_on():
    fake = FakeNvml(devices=2)
    lines = []
    source = NvmlSource(load=lambda: fake, say=lines.append)
    source.track(100)
    real = fake.nvmlDeviceGetUtilizationRates

    def half_broken(h):
        if h == "h1":
            raise RuntimeError("Xid 79")
        return real(h)

    fake.nvmlDeviceGetUtilizationRates = half_broken
    for _ in range(2 * MAX_FAILED_POLLS):
        assert source.poll()["gpu_samples"]["pid"].tolist() == [100]
    assert source.available and lines[1:] == [
        "nvml: read failed, that GPU's samples are skipped: GPU 1: Xid 79"
    ]


def test_an_unexpected_nvml_exception_turns_the_source_off_with_a_line():
    fake = FakeNvml(devices=1)
    lines = []
    source = NvmlSource(load=lambda: fake, say=lines.append)
    source.track(100)
    source.sampler.sample = lambda: (_ for _ in ()).throw(OSError("driver gone"))
    assert source.poll() is None and not source.available
    assert (
        lines[-1] == "nvml: off: reading the GPUs failed (driver gone); the agent runs on without GPU samples"
    )


def test_split_by_pid_gives_each_target_its_rows():
    dev = [DeviceSample(10, 0, 50, 5, 1, 2), DeviceSample(11, 1, 60, 6, 1, 2)]
    procs = [ProcessSample(10, 0, 7, 1, 1, 100), ProcessSample(10, 0, 8, 2, 2, 200),
             ProcessSample(11, 1, 7, 3, 3, 300)]  # fmt: skip
    columns = nvml_source.rows(dev, procs, [("u0", "n"), ("u1", "n")], {7, 8})
    parts = split_by_pid(columns)
    assert split_by_pid({"gpu_samples": columns}).keys() == parts.keys()  # poll()'s batch as it comes
    assert sorted(parts) == [7, 8]
    assert parts[7]["gpu_index"].tolist() == [0, 1] and parts[7]["mem_used"] == [100, 300]
    assert parts[7]["gpu_uuid"] == ["u0", "u1"] and parts[7]["gpu_util"].tolist() == [50, 60]
    assert parts[8]["pid"].tolist() == [8] and parts[8]["sm_util"] == [2]
    assert all(isinstance(parts[7][k], np.ndarray) == isinstance(columns[k], np.ndarray) for k in COLUMNS)
