"""The demo workloads are package modules (`python -m llmobs.workloads`, installed with the agent), and
the agent's command modules do not import them, nor torch or transformers, until a workload runs."""

from __future__ import annotations

import json
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
    summaries = []
    for command in (["-m", "llmobs.workloads"], [str(ROOT / "scripts" / "workload.py")]):
        done = subprocess.run(
            [sys.executable, *command, "--model", "tiny", "--requests", "1", "--max-new-tokens", "2",
             "--threads", "1", "--no-instrument"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        summaries.append(json.loads(done.stdout.splitlines()[-1]))
    assert [(s["model"], s["requests"], s["tokens"]) for s in summaries] == [("tiny-gpt2", 1, 2)] * 2
