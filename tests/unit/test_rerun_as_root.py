"""Without root, the commands that attach probes (demo, attach, run) refuse in one `error:` line and one
`hint:` line that names the exact command to type again as root (`sudo .venv/bin/llmobs-agent ...`, or
through `su` where sudo is not installed), and exit 4. The refusal is real: the command runs as
`nobody` (setpriv) when the tests run as root, as this user otherwise."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from llmobs.rerun import as_root_hint, current_command

ROOT = Path(__file__).resolve().parents[2]
AGENT = ".venv/bin/llmobs-agent"  # as the README writes it, from the checkout
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]


def test_the_command_is_the_console_script_as_typed_or_the_module():
    assert current_command([AGENT, "demo", "--out", "a b"]) == [AGENT, "demo", "--out", "a b"]
    module_file = str(ROOT / "agent" / "llmobs" / "cli.py")
    assert current_command([module_file, "attach", "--pid", "7"]) == [
        sys.executable, "-m", "llmobs.cli", "attach", "--pid", "7",
    ]  # fmt: skip
    assert current_command(["bench/x.py", "--n", "1"]) == [sys.executable, "bench/x.py", "--n", "1"]


def test_the_hint_uses_sudo_where_it_is_installed_and_su_where_not():
    argv = [AGENT, "demo", "--out", "my demo"]
    assert as_root_hint(argv, has_sudo=True).startswith(
        "run it as root: sudo .venv/bin/llmobs-agent demo --out 'my demo' ("
    )
    quoted_twice = shlex.quote(".venv/bin/llmobs-agent demo --out 'my demo'")  # su -c takes one word
    assert as_root_hint(argv, has_sudo=False).startswith(
        f"run it as root: su -c {quoted_twice} (sudo is not installed"
    )


def _unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run a command as nobody")
    return AS_NOBODY


@pytest.mark.parametrize(
    "args",
    [["demo", "--model", "tiny", "--out", "{tmp}/demo"], ["attach", "--pid", str(os.getpid())], ["run"]],
    ids=["demo", "attach", "run"],
)
def test_a_user_is_told_the_exact_command_to_run_as_root(tmp_path, args):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    env = {**os.environ, "LLMOBS_CONFIG": ""}
    done = subprocess.run(
        [*_unprivileged(), AGENT, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert done.returncode == 4, done.stderr
    error, hint = done.stderr.strip().splitlines()
    assert error.startswith("error: ") and "needs root" in error, error
    typed = shlex.join([AGENT, *args])
    rerun = f"sudo {typed}" if shutil.which("sudo") else f"su -c {shlex.quote(typed)}"
    assert hint.startswith("hint: ") and f"run it as root: {rerun} (" in hint, hint
    assert not (tmp_path / "demo").exists()  # refused before anything was made
