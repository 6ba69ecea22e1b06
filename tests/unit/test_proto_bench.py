"""`python -m bench.proto` runs end to end on a small input and prints the side-by-side figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "bench.proto"]


def test_bench_proto_small_run_prints_sizes_times_ratios_and_reference() -> None:
    result = subprocess.run(
        [*BENCH, "--records", "640", "--reps", "2", "--tokens", "64", "--logs", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "640 token-step records, 2 interleaved repetitions" in out
    for label in ("size", "encode", "decode (parse)", "encode+decode, median"):
        assert f"  {label} " in out
    assert "12.7 KB -> 3.2 KB (3.97x)" in out
    assert "89 us -> 14 us (6.36x)" in out
    size_line = next(line for line in out.splitlines() if line.strip().startswith("size, median"))
    json_kb, proto_kb = (
        float(part.split()[0]) for part in size_line.split("  ") if part.strip().endswith("KB")
    )
    assert proto_kb < json_kb


def test_bench_proto_rejects_bad_arguments() -> None:
    result = subprocess.run(
        [*BENCH, "--records", "10", "--tokens", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "need --records >= --tokens" in result.stderr
