"""The demo workloads are package modules (`python -m llmobs.workloads`, installed with the agent), and
the agent's command modules do not import them, nor torch or transformers, until a workload runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_commands_import_no_workload_side_module():
    probe = (
        "import sys, llmobs.cli, llmobs.commands.demo; "
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or m.startswith('llmobs.workloads')])"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_module_and_the_launcher_by_path_are_one_program(tmp_path):
    """The module generates (its summary line), and the launcher by path is the same program: the same
    parser, word for word. (The launcher's own full runs are the reliability tests' workloads.)"""

    def run(command: list[str], *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, *command, *args], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done

    module, launcher = ["-m", "llmobs.workloads"], [str(ROOT / "scripts" / "workload.py")]
    done = run(module, "--model", "tiny", "--requests", "1", "--max-new-tokens", "2", "--threads", "1",
               "--no-instrument")  # fmt: skip
    summary = json.loads(done.stdout.splitlines()[-1])
    assert (summary["model"], summary["requests"], summary["tokens"]) == ("tiny-gpt2", 1, 2)
    helps = [run(command, "--help").stdout for command in (module, launcher)]
    assert helps[0].split("\n", 1)[1] == helps[1].split("\n", 1)[1] and "--max-new-tokens" in helps[0]


def test_forward_mode_warmup_and_torch_profiler(tmp_path):
    """The peer benchmark's modes (bench/footprint.py peers): teacher-forced forward passes counted by
    their tokens, warm-up requests outside the clock and the counts (a "clock" line says when the measured
    ones begin), the requests under torch.profiler; forward mode refuses generate()'s options."""
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "llmobs.workloads", "--model", "tiny", "--threads", "1",
            "--mode", "forward", "--forward-tokens", "9", "--requests", "3", "--warmup", "2",
            "--torch-profiler", "--no-instrument", "--ready-fd", str(write_fd)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          pass_fds=(write_fd,))  # fmt: skip
    os.close(write_fd)
    with os.fdopen(read_fd) as lines:
        phases = [json.loads(line)["phase"] for line in lines]
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert (summary["requests"], summary["tokens"]) == (3, 27) and summary["cpu_s"] > 0
    assert phases == ["ready", "clock", "done"]
    refused = subprocess.run([*argv[:-2], "--batch", "2"], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2 and "--mode forward runs one row per pass" in refused.stderr
