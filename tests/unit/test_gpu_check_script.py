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
