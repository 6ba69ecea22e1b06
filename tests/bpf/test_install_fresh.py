"""`pip install .` on a fresh host: a wheel built from the checkout's files (no generated code, no build
outputs: what a clean clone has), installed into a fresh venv outside the checkout, runs `llmobs-agent
demo` from another directory. The BPF C sources, the demo workload, the protobuf code and the compiled
thread-context library must all come from the wheel; the source tree is not on the path (bpf tier:
the demo attaches probes).

The slowest bpf test (a wheel build, then a demo): one case. Dependencies are not reinstalled: the fresh
venv sees this venv's site-packages (torch, duckdb, bcc's bridge) through a .pth file, after its own, so
`llmobs` itself can only come from the wheel, which the test asserts. The wheel is built without build
isolation (no registry needed): this venv's setuptools and grpcio-tools stand in for the build
requirements pyproject.toml declares, and setup.py generates the protobuf code into the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPS = Path(sysconfig.get_paths()["purelib"])  # this venv's site-packages: the dependencies


def _copy_clean_checkout(dest: Path) -> None:
    """The files git tracks or would track (ignored ones left out: .venv, _pb2 code, egg-info, build/)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is not part of it
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _dependency_paths() -> list[str]:
    """This venv's site-packages and the plain folders its .pth files add (bcc's bridge); not the .pth
    lines that run code (the editable install's finder would put the checkout back on the path)."""
    paths = [str(DEPS)]
    for pth in sorted(DEPS.glob("*.pth")):
        paths += [
            line for line in pth.read_text().splitlines() if line and not line.startswith(("#", "import"))
        ]
    return paths


def test_a_wheel_installed_in_a_fresh_venv_runs_the_demo_from_another_directory(tmp_path):
    source, dist, env_dir, elsewhere = (tmp_path / n for n in ("src", "dist", "venv", "elsewhere"))
    _copy_clean_checkout(source)
    assert not (source / "agent" / "llmobs" / "_proto" / "llmobs_pb2.py").exists()
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
         str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("llmobs_agent-*.whl")
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([python, "-c", purelib], text=True).strip())
    (site / "llmobs-test-deps.pth").write_text("\n".join(_dependency_paths()) + "\n")
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("LLMOBS_")}
    # the thread-context library setup.py compiles (OTEP 4947), loaded as the extension module it is,
    # the OTLP encoder's C gather and the store's C ingest decoder
    where_from = (
        "import llmobs, llmobs._proto.llmobs_pb2 as pb; print(llmobs.__file__); print(pb.__file__)\n"
        "from llmobs.shm import thread_ctx as t; print(t.LIBRARY if t.uses_extension() else 'not-loaded')\n"
        "import llmobs.otlp._wire_gather as g; print(g.__file__)\n"
        "import llmobs.store._event_split as s; print(s.__file__)"
    )
    where = subprocess.run(
        [python, "-c", where_from],
        capture_output=True, text=True, cwd=elsewhere, env=env, timeout=60,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    module_files = where.stdout.split()
    assert len(module_files) == 5 and Path(module_files[2]).is_file(), where.stdout
    for module_file in module_files:
        assert Path(module_file).is_relative_to(site), (module_file, site)
    out = elsewhere / "demo"
    demo = subprocess.run(
        [env_dir / "bin" / "llmobs-agent", "demo", "--model", "tiny", "--requests", "1",
         "--max-new-tokens", "4", "--out", "demo"],
        capture_output=True, text=True, cwd=elsewhere, env=env, timeout=600,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    assert "store: 4 token steps (published 4, lost 0)" in demo.stdout, demo.stdout
    assert (out / "llmobs.duckdb").is_file() and (out / "report.txt").is_file()
