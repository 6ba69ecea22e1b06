"""scripts/gpu_check.sh where there is no GPU: its syntax, its no-GPU exit, and a CPU rehearsal of the
part that must refuse cleanly (trace on a real instrumented process without CUDA)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(
    os.path.exists("/dev/nvidia0"), reason="this host has a GPU: run the real check"
)


def _run(tmp_path, *args, timeout=60, **env):
    out = tmp_path / "out"
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OUT": str(out), "LLMOBS_STAGE": str(tmp_path / "stage"), **env},
    ), out / "gpu_check.txt"  # fmt: skip


def test_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "error", str(SCRIPT)], check=True)


def test_dry_run_without_a_gpu_says_so_and_exits_10(tmp_path):
    done, results = _run(tmp_path, "--dry-run")
    assert done.returncode == 10, done.stdout + done.stderr
    text = results.read_text()
    assert "gpu_check: no GPU (/dev/nvidia0 absent): nothing to check on this host" in text
    assert text == done.stdout  # everything said went into the one results file


def test_unknown_argument_is_a_usage_error(tmp_path):
    done, _ = _run(tmp_path, "--bogus")
    assert done.returncode == 2 and "unknown argument --bogus" in done.stderr


def test_rehearsal_stages_llmobs_and_trace_refuses_without_cuda(tmp_path):
    """The staged package (no install) imports, and the trace part meets a real CPU workload."""
    done, results = _run(tmp_path, "--rehearse", "--", "--parts", "trace", timeout=170)
    text = results.read_text()
    assert done.returncode == 0, text
    assert "== preflight: RAN (cuda=False" in text
    assert "trace without CUDA: exit 10: error: cannot trace process" in text
    assert "== trace: SKIPPED (no CUDA in torch here; trace refused with exit 10)" in text
    assert "gpu_check: exit 0; results in" in text


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace_doc(steps=(11, 12), kernels_per_step=2):
    """`trace --json` output made by the real summary code from ring-shaped records."""
    import numpy as np
    from llmobs.commands.trace import summary_json
    from llmobs.cupti import protocol as p
    from llmobs.gpu.records import CuptiCapture, summarize
    from llmobs.shm import layout
    from llmobs.shm.hashing import name_hash

    rows = []
    for seq in steps:
        for _ in range(kernels_per_step):
            rows.append((seq, p.KIND_CONCURRENT_KERNEL, name_hash("k")))
            rows.append((seq, p.KIND_RUNTIME, name_hash("cudaLaunchKernel_v7000")))
    recs = np.zeros(len(rows), layout.CUPTI_RECORD.dtype)
    recs["step_seq"] = [r[0] for r in rows]
    recs["kind"] = [r[1] for r in rows]
    recs["name_hash"] = [r[2] for r in rows]
    recs["end_ns"] = 100
    names = {name_hash("k"): "k", name_hash("cudaLaunchKernel_v7000"): "cudaLaunchKernel_v7000"}
    token_steps = {"step_seq": np.array(steps), "trace_id": ["ab" * 16] * len(steps)}
    cap = CuptiCapture()
    cap.clock = p.ClockMark(1, 2, 0.5, 800.0, 1500.0, 32)
    cap.end = p.EndMark(steps[0], steps[-1], len(rows), 0, 0, 0, False)
    summary = summarize(recs, names, token_steps)
    result = {"pid": 1, "first_step": steps[0], "last_step": steps[-1], "records": recs, "names": names,
              "steps": token_steps, "summary": summary, "capture": cap}  # fmt: skip
    return summary_json(result)


def test_gpu_check_judges_trace_output_and_compares_launches(tmp_path):
    import pyarrow.parquet as pq
    from llmobs.bpf.output import aggregates_table
    from llmobs.bpf.profiles import PROBES

    gc = _gpu_check_module()
    steps, checks, lines = gc.judge_trace(_trace_doc(), 2)
    assert [s["step_seq"] for s in steps] == [11, 12] and all(checks.values()), checks
    assert any("residual 800 ns rms" in line for line in lines)
    assert not all(gc.judge_trace(_trace_doc(), 8)[1].values())  # 2 steps where 8 were asked

    index = {probe.name: i for i, probe in enumerate(PROBES)}
    totals = {(1, index["cudaLaunchKernel"], 11): [2, 0, 0], (1, index["cudaLaunchKernel"], 12): [2, 0, 0],
              (1, index["cudaGraphLaunch"], 12): [5, 0, 0]}  # fmt: skip
    path = tmp_path / "a.aggregates.parquet"
    pq.write_table(aggregates_table(totals), path)
    counts = gc.launch_counts(path)
    assert counts == {11: {"cudaLaunchKernel": 2}, 12: {"cudaLaunchKernel": 2, "cudaGraphLaunch": 5}}
    table, agree = gc.compare_launches(steps, counts)
    assert agree and "cudaGraphLaunch" not in table[-1]
    totals[(1, index["cudaLaunchKernel"], 12)] = [3, 0, 0]
    pq.write_table(aggregates_table(totals), path)
    assert gc.compare_launches(steps, gc.launch_counts(path))[1] is False


def test_gpu_check_nvml_part_stores_the_samples_of_a_real_workload(tmp_path):
    """The nvml part's whole path on a real instrumented CPU workload and a real store, with only
    NVML stood in for (it reports every pid the source tracks, on GPU 0): rows polled, stored in
    gpu_samples through the Pipeline, and the workload's token steps joined to them by step_gpu."""
    import argparse
    from types import SimpleNamespace as NS

    from fake_nvml import FakeNvml
    from llmobs.gpu.nvml_source import NvmlSource

    gc = _gpu_check_module()
    made = []

    class EveryTrackedPid(FakeNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, h):
            return [NS(pid=pid, usedGpuMemory=1 << 30) for pid in made[0].pids] if h == "h0" else []

        def nvmlDeviceGetProcessUtilization(self, h, last_seen):
            return [NS(pid=pid, smUtil=30, memUtil=5, timeStamp=last_seen + 1) for pid in made[0].pids]

    def make_source(say):
        made.append(NvmlSource(load=EveryTrackedPid, say=say))
        return made[0]

    res = gc.Results(tmp_path / "results.txt")
    args = argparse.Namespace(model="tiny", device="cpu", requests=2, tokens=4, batch=1, rehearse=True,
                              load_timeout=180, run_timeout=240)  # fmt: skip
    gc.nvml_part(res, args, {"duckdb": True}, tmp_path, make_source=make_source)
    text = (tmp_path / "results.txt").read_text()
    assert res.parts == [("nvml", "RAN", "4/4 checks")], text
    assert "[ok] every polled row in gpu_samples" in text and "[ok] token steps joined to a sample" in text
    assert "gpu 0 (NVIDIA H200, GPU-0000-h0): sm 30% mem 5% used 1,024 MiB" in text


def test_gpu_check_nvml_part_skips_with_the_reason_on_this_host(tmp_path):
    pytest.importorskip("pynvml")
    gc = _gpu_check_module()
    res = gc.Results(tmp_path / "results.txt")
    gc.nvml_part(res, None, {"duckdb": True}, tmp_path)  # the real NVML: no driver here, no workload started
    reason = "nvml: off: no NVIDIA driver on this host (libnvidia-ml.so.1 not found); the agent runs on"
    assert res.parts == [("nvml", "SKIPPED", reason + " without GPU samples")]
