"""The distribution lists every package of the `llmobs` namespace: an editable install finds an unlisted
subpackage anyway, so only a wheel install (the daemon's) would notice one missing."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_llmobs_package_is_in_the_distribution():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in relative:
                found.add(".".join((package, *relative)))
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed but not in the tree: {sorted(listed - found)}"


def test_nothing_at_the_top_level_shadows_nvidia_cupti():
    assert not (ROOT / "cupti" / "__init__.py").exists()
