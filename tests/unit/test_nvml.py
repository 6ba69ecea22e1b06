"""NvmlSampler: the real nvidia-ml-py on this driver-less host (one status line, then off), and the
sampling logic on an object with pynvml's functions standing in for the driver."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
from fake_nvml import FakeNvml
from llmobs.gpu import nvml


def test_real_nvml_without_a_driver_prints_one_line_and_stays_off():
    pytest.importorskip("pynvml")
    lines = []
    s = nvml.NvmlSampler(status=lines.append)
    assert s.open() is False
    assert not s.available
    assert lines == ["nvml: off: no NVIDIA driver on this host (libnvidia-ml.so.1 not found); "
                     "the agent runs on without GPU samples"]  # fmt: skip
    assert s.start() is False
    assert s.sample() == ([], [])


def test_missing_nvidia_ml_py_is_one_line_too():
    lines = []

    def missing():
        raise ImportError("No module named 'pynvml'")

    assert nvml.NvmlSampler(load=missing, status=lines.append).open() is False
    assert len(lines) == 1 and "nvidia-ml-py is not installed" in lines[0]


def test_samples_devices_and_processes():
    fake = FakeNvml()
    lines = []
    s = nvml.NvmlSampler(hz=10, load=lambda: fake, status=lines.append)
    assert s.period_s == 0.25  # clamped to 4 Hz
    assert s.open() and lines == ["nvml: sampling 2 GPU(s) at 4 Hz"]
    devices, procs = s.sample()
    assert [(d.device, d.gpu_util, d.mem_util, d.mem_used) for d in devices] == [
        (0, 75, 30, 5 << 30),
        (1, 0, 0, 5 << 30),
    ]
    assert [(p.device, p.pid, p.sm_util, p.mem_util, p.mem_used) for p in procs] == [
        (0, 100, 70, 25, 3 << 30)
    ]
    assert s._last_seen_us[0] == 1000
    s.sample()
    assert s._last_seen_us[0] == 2000  # asks NVML only for samples newer than the last one seen
    d2, p2 = s.drain()
    assert len(d2) == 4 and len(p2) == 2 and s.drain() == ([], [])


def test_thread_samples_until_stopped():
    fake = FakeNvml(devices=1)
    s = nvml.NvmlSampler(hz=4, load=lambda: fake, status=lambda line: None)
    assert s.start()
    assert fake.sampled.wait(10), "the sampler thread took no samples"
    s.stop()
    assert fake.shutdowns == 1 and not s.available
    n = fake.calls
    assert s.sample() == ([], []) and fake.calls == n


def test_a_failing_device_is_skipped_and_counted():
    fake = FakeNvml()
    s = nvml.NvmlSampler(load=lambda: fake, status=lambda line: None)
    s.open()

    def broken(h):
        if h == "h1":
            raise RuntimeError("GPU is lost")
        return NS(gpu=1, memory=1)

    fake.nvmlDeviceGetUtilizationRates = broken
    devices, _ = s.sample()
    assert [d.device for d in devices] == [0] and s.errors == 1


def test_assign_steps_places_samples_in_their_pid_s_steps():
    steps = {
        "pid": np.array([100, 100, 200]),
        "step_seq": np.array([5, 6, 9]),
        "t_start_ns": np.array([1000, 2000, 1000]),
        "t_end_ns": np.array([1900, 2900, 5000]),
    }
    at = [(1500, 100), (1950, 100), (2000, 100), (2900, 100), (3000, 100), (1500, 200), (1500, 300)]
    samples = [nvml.ProcessSample(ts, 0, pid, 1, 1, 1) for ts, pid in at]
    assert nvml.assign_steps(samples, steps).tolist() == [5, 0, 6, 6, 0, 9, 0]
