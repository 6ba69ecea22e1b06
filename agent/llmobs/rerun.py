"""This very command line, as the user should type it again as root: the hint of every refusal for want
of privileges names the exact command to run (`sudo .venv/bin/llmobs-agent demo ...`), not a rule.

The agent never re-executes itself through sudo: a tool that raises its own privileges unasked would
surprise whoever wraps it (a service manager, a script); it says what to run and exits 4.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys

_CLI_MODULE = "llmobs.cli"


def current_command(argv: list[str] | None = None) -> list[str]:
    """sys.argv as a runnable command: the console script as it was typed, `python -m llmobs.cli` when
    run as a module (its argv[0] is then the module's file, not something to type)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv or not argv[0]:
        return [sys.executable, "-m", _CLI_MODULE]
    program, rest = argv[0], argv[1:]
    if program.endswith(os.sep + os.path.join("llmobs", "cli.py")):
        return [sys.executable, "-m", _CLI_MODULE, *rest]
    if program.endswith(".py"):
        return [sys.executable, program, *rest]
    return [program, *rest]


def as_root_hint(argv: list[str] | None = None, has_sudo: bool | None = None) -> str:
    """`run it as root: sudo CMD` where sudo is installed, else the same through `su` (a root shell)."""
    command = shlex.join(current_command(argv))
    alternative = "or grant CAP_BPF and CAP_PERFMON"
    if has_sudo is None:
        has_sudo = shutil.which("sudo") is not None
    if has_sudo:
        return f"run it as root: sudo {command} ({alternative})"
    return f"run it as root: su -c {shlex.quote(command)} (sudo is not installed; {alternative})"
