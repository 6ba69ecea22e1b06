"""The layering (pyproject.toml [tool.importlinter], docs/architecture.md) holds, and the check is real:
an upward import, an import of the publisher from the agent side, or a cycle between siblings, each
added to a copy of the tree, breaks the contract that forbids it.

The copy is laid out as an install lays it out (cupti/collector at llmobs/cupti), so the workload-side
CUPTI collector is checked too; a plain `lint-imports` in the checkout sees only agent/llmobs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

LAYERS = "each layer imports only the layers below it"
PRIVATE = "only the public API (llmobs/__init__.py) imports the publisher"
NO_CYCLES = "no import cycle between sibling modules"


def lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)  # found before the editable install's finder
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(CONFIG)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_docs_draw_the_layers_the_contract_checks() -> None:
    """docs/architecture.md's layer diagram is the contract's list, layer for layer."""
    contracts = tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    checked = [" | ".join(name.strip().strip("()") for name in layer.split("|")) for layer in layers]
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The layers", 1)[1].split("```", 2)[1]
    drawn = [re.split(r"\s{2,}", line.strip())[0] for line in block.splitlines() if line.strip()]
    assert drawn == checked


def test_import_llmobs_alone_loads_neither_torch_nor_numpy() -> None:
    """The public API maps its names into llmobs.publisher lazily; each one still resolves."""
    code = (
        "import json, sys, llmobs\n"
        "heavy = sorted({'torch', 'numpy'} & set(sys.modules))\n"
        "modules = sorted({getattr(llmobs, name).__module__ for name in llmobs._LAZY})\n"
        "print(json.dumps({'heavy': heavy, 'modules': modules}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["heavy"] == []
    assert seen["modules"] and all(m.startswith("llmobs.publisher.") for m in seen["modules"])


def installed_layout(tmp_path: Path) -> Path:
    """A folder holding the llmobs namespace as a wheel installs it."""
    site = tmp_path / "site"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "agent" / "llmobs", site / "llmobs", ignore=skip)
    shutil.copytree(ROOT / "cupti" / "collector", site / "llmobs" / "cupti", ignore=skip)
    return site


def add_import(site: Path, module: str, statement: str) -> None:
    path = site / Path(*module.split(".")).with_suffix(".py")
    text = path.read_text()
    assert statement not in text
    path.write_text(text + f"\n\ndef _deliberate_breach():\n    {statement}\n")  # lazy: it still counts


def test_the_checkout_keeps_every_contract() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_installed_layout_keeps_every_contract(tmp_path) -> None:
    result = lint(tmp_path, installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "statement", "contract", "named"),
    [
        # an upward import that is also a cycle: commands -> shm -> commands
        (
            "llmobs.shm.layout",
            "import llmobs.commands.attach",
            LAYERS,
            "llmobs.shm.layout -> llmobs.commands",
        ),
        # the workload-side collector reaching into the agent side
        ("llmobs.cupti.ring", "import llmobs.store.sink", LAYERS, "llmobs.cupti.ring -> llmobs.store.sink"),
        # the agent side importing the workload side (store is above the publisher's layer: only the
        # forbidden contract catches this one)
        ("llmobs.store.sink", "import llmobs.publisher.request", PRIVATE, "llmobs.store.sink"),
        # a cycle inside one package, which the layers between packages cannot see
        ("llmobs.publisher.layer_base", "import llmobs.publisher.attention", NO_CYCLES, "llmobs.publisher"),
    ],
    ids=["upward", "workload-to-agent", "agent-to-publisher", "sibling-cycle"],
)
def test_a_deliberate_breach_breaks_its_contract(tmp_path, module, statement, contract, named) -> None:
    site = installed_layout(tmp_path)
    add_import(site, module, statement)
    result = lint(tmp_path, site)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in " ".join(result.stdout.split()), result.stdout  # lines wrap at 80
    assert named in result.stdout
