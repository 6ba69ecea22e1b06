"""The one build step pyproject.toml cannot declare: the protobuf code is generated into the package
being built (it is never committed), so `pip install .` from a clean checkout ships llmobs._proto."""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProto(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install imports the tree's own, made by scripts/setup.sh
            return
        out = Path(self.build_lib) / "llmobs" / "_proto"
        generate = [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(out)]
        subprocess.run(generate, check=True)


setup(cmdclass={"build_py": BuildPyWithProto})
