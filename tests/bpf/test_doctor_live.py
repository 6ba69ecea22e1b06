"""`llmobs-agent doctor` for real on this host: the eBPF rows are OK as root, the GPU rows say
MISSING with a reason where there is no GPU, an unprivileged run says "run as root" without a
traceback, and the checks leave no probe behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from llmobs.errors import ExitCode
from llmobs.hostcheck import CPU_PROFILE_CHECKS, run_checks

DOCTOR = [sys.executable, "-m", "llmobs.cli", "doctor"]
EBPF_ROWS = ("privileges", "btf", "bcc", "uprobe", "tracepoint", "ringbuf", "kernel_headers", "tracefs")
GPU_ROWS = ("libcuda", "cuda_driver", "nvml", "cupti")
HAS_GPU = Path("/dev/nvidiactl").exists()
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def doctor(*args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*(prefix or []), *DOCTOR, *args], capture_output=True, text=True, timeout=120, cwd="/"
    )


def test_doctor_json_as_root_ebpf_ok_gpu_missing_with_reason() -> None:
    result = doctor("--json")
    assert result.returncode == ExitCode.OK, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    rows = {row["check"]: row for row in json.loads(result.stdout)}
    assert set(EBPF_ROWS) | set(GPU_ROWS) <= set(rows)
    for check in EBPF_ROWS:
        assert rows[check]["status"] == "OK", rows[check]
    assert "100 of 100 calls counted" in rows["uprobe"]["detail"]
    assert "50 of 50 calls counted" in rows["tracepoint"]["detail"]
    assert {check for check, row in rows.items() if row["required_for_cpu_profile"]} == set(
        CPU_PROFILE_CHECKS
    )
    if not HAS_GPU:
        for check in GPU_ROWS:
            assert rows[check]["status"] == "MISSING", rows[check]
            assert rows[check]["detail"], rows[check]
            assert "NVIDIA driver" in rows[check]["hint"], rows[check]


def test_doctor_table_as_root() -> None:
    result = doctor()
    assert result.returncode == ExitCode.OK, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for title in ("privileges", "bcc compile+load", "uprobe", "tracepoint", "BPF ring buffer"):
        row = next(line for line in lines if line.startswith(title))
        assert " OK " in row, row
    assert "verdict: the CPU probe profile can run on this host" in result.stdout
    assert result.stderr == ""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_doctor_unprivileged_says_run_as_root_and_exits_host_unsupported() -> None:
    result = doctor("--json", prefix=NOBODY)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == ExitCode.HOST_UNSUPPORTED, result.stdout + result.stderr
    rows = {row["check"]: row for row in json.loads(result.stdout)}
    for check in CPU_PROFILE_CHECKS:
        assert rows[check]["status"] == "MISSING", rows[check]
        assert "run as root" in rows[check]["hint"], rows[check]
    assert "uid 65534" in rows["privileges"]["detail"]
    # The rows that need no privilege still report what they found.
    assert rows["btf"]["status"] == "OK"
    assert rows["tracefs"]["status"] == "OK"


def bpftool_json(*args: str) -> list[dict]:
    out = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout or "[]")


def test_checks_in_process_leave_no_probe_behind() -> None:
    rows = {row.check: row for row in run_checks()}
    assert all(rows[check].status.value == "OK" for check in CPU_PROFILE_CHECKS), rows
    ours = [entry for entry in bpftool_json("perf") if entry.get("pid") == os.getpid()]
    assert ours == []
