"""scripts/setup.sh run by a user: with sudo it re-runs itself through sudo (saying so); without sudo it
stops with one error line and one hint line before changing anything. The user is `nobody` (setpriv)
when the tests run as root. PATH holds only what the script needs before that point, so whether this
host has sudo does not decide which branch runs; the sudo branch uses a stand-in that records its
arguments (this host's sudo, if any, would ask nobody for a password)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
BASH = shutil.which("bash")


def _as_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run the script as nobody")
    return [shutil.which("setpriv"), "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]


@pytest.fixture
def bin_dir():
    """A PATH folder that nobody can reach (pytest's tmp_path is under a 0700 folder of root's)."""
    with tempfile.TemporaryDirectory(prefix="llmobs-setup-path-") as folder:
        os.chmod(folder, 0o755)
        for tool in ("id", "dirname"):  # what the script runs before it decides
            os.symlink(shutil.which(tool), os.path.join(folder, tool))
        yield Path(folder)


def _run(bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": str(bin_dir), "HOME": "/"}
    return subprocess.run(
        [*_as_user(), BASH, str(SETUP), *args], capture_output=True, text=True, env=env, timeout=60, cwd="/"
    )


def test_without_root_or_sudo_it_stops_with_an_error_and_a_hint(bin_dir):
    done = _run(bin_dir)
    assert done.returncode == 1 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [
        "[setup] error: setup needs root (apt packages, kernel headers) and sudo is not installed",
        f"[setup] hint: run it in a root shell: su -c {SETUP}",
    ]


def test_a_user_with_sudo_is_re_run_through_it(bin_dir):
    record = bin_dir / "sudo-args"
    (bin_dir / "sudo").write_text(f'#!{BASH}\nprintf "%s\\n" "$@" > {record}\n')
    (bin_dir / "sudo").chmod(0o755)
    record.touch(mode=0o666)
    record.chmod(0o666)
    done = _run(bin_dir, "--an-arg")
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout
        == "[setup] not root: re-running through sudo (it installs apt packages and links kernel headers)\n"
    )
    assert record.read_text().splitlines() == ["--", "env", "PYTHON=python3", "bash", str(SETUP), "--an-arg"]
