"""The gpu tier: real CUDA, real CUPTI (cupti-python), real NVML. Skipped without /dev/nvidia0
(tests/conftest.py); scripts/gpu_check.sh runs it on a GPU machine.

A real CUDA generation loop (scripts/gpu_workload.py, instrumented) is traced by the real
`llmobs-agent trace`: kernels must be captured in every one of the K steps, joined to the token steps
the map holds, with the CUPTI clock fitted to CLOCK_MONOTONIC within a few microseconds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.fixture(scope="module")
def workload():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch here has no CUDA")
    pytest.importorskip("cupti")
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "gpu_workload.py"), "--model", "tiny", "--requests", "0",
         "--max-new-tokens", "16", "--batch", "2", "--ready-fd", str(w)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(w,),
    )  # fmt: skip
    os.close(w)
    ready, _, _ = select.select([r], [], [], 180)
    line = os.read(r, 4096).decode() if ready else ""
    os.close(r)
    if not line:
        proc.kill()
        pytest.fail(f"the CUDA workload did not get ready: {proc.stderr.read()[-2000:]}")
    yield json.loads(line.splitlines()[0])["pid"]
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)


def test_trace_captures_kernels_joined_to_every_step(workload, tmp_path):
    out = tmp_path / "trace.json"
    done = subprocess.run(
        [sys.executable, "-m", "llmobs.cli", "trace", "--pid", str(workload), "--steps", str(STEPS),
         "--timeout", "120", "--json", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    steps = [s for s in doc["steps"] if s["step_seq"]]
    assert [s["step_seq"] for s in steps] == list(range(doc["first_step"], doc["first_step"] + STEPS))
    assert all(s["kernels"] > 0 and s["gpu_ns"] > 0 and s["launches"] > 0 for s in steps)
    assert all(s["trace_id"] for s in steps), "every collected step must be joined to its token step"
    assert doc["unjoined"] == 0 and doc["joined"] > 0
    assert doc["end"]["cupti_dropped"] == 0
    assert doc["clock"]["samples"] >= 2 and doc["clock"]["residual_ns"] < 10_000
    assert doc["top_kernels"] and doc["top_kernels"][0]["count"] > 0


def test_a_second_trace_works_after_the_first(workload):
    """The collector gives CUPTI back after each collection and can be asked again."""
    done = subprocess.run(
        [sys.executable, "-m", "llmobs.cli", "trace", "--pid", str(workload), "--steps", "2",
         "--timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "top " in done.stdout and "clock fit" in done.stdout


def test_nvml_sees_the_workload(workload):
    from llmobs.gpu.nvml import NvmlSampler

    lines = []
    sampler = NvmlSampler(hz=4, status=lines.append)
    assert sampler.open(), lines
    try:
        devices, procs = sampler.sample()
    finally:
        sampler.stop()
    assert devices and devices[0].mem_total > 0
    assert any(p.pid == workload and p.mem_used != 0 for p in procs)


def test_nvml_source_gives_the_workload_rows(workload):
    """The live Source on the real NVML: the generating workload (requests 0: it runs until stopped)
    gets gpu_samples rows with its device memory and the device's UUID."""
    from llmobs.gpu.nvml_source import NvmlSource, split_by_pid

    lines = []
    source = NvmlSource(say=lines.append)
    source.track(workload)
    try:
        batch = source.poll()
    finally:
        source.close()
    assert source.status and not any("read failed" in line for line in lines), lines
    assert batch is not None, lines
    mine = split_by_pid(batch["gpu_samples"])[workload]
    assert all(m and m > 0 for m in mine["mem_used"]) and all(u for u in mine["gpu_uuid"])
    assert all(0 < t <= d for t, d in zip(mine["device_mem_used"], mine["device_mem_total"], strict=True))
