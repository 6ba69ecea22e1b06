"""The `llmobs-agent` command line: one subcommand per module in llmobs.commands.

Each command module exposes `configure(parser)` and `run(args) -> int`. Modules are imported only
when their command runs, so `llmobs-agent doctor` never pays for torch or bcc it does not use.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import sys
import traceback

from llmobs.errors import ExitCode, LlmobsError, UsageError
from llmobs.logtext import one_line

# name -> (module, one-line help). Order is the order `--help` shows.
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("llmobs.commands.doctor", "show what this host can do (privileges, eBPF, GPU)"),
    "inspect": ("llmobs.commands.inspect", "print the header, counters and last steps of a process's map"),
    "attach": ("llmobs.commands.attach", "attach eBPF probes to a running PyTorch process"),
    "query": ("llmobs.commands.query", "SQL or a canned view (slowest steps, probes, tenants)"),
    "export": ("llmobs.commands.export", "export the store to Parquet (per table) or a Perfetto trace"),
    "otlp": ("llmobs.commands.otlp", "export the store over OTLP (gRPC/HTTP) to Tempo or any OTel backend"),
    "trace": ("llmobs.commands.trace", "collect CUPTI GPU activity of a process for K token steps"),
    "top": ("llmobs.commands.top", "live view of attached processes: tokens/s, latency, loss, work per step"),
    "demo": ("llmobs.commands.demo", "run SmolLM2 under the agent; per-token report, trace, plot"),
    "explain": ("llmobs.commands.explain", "one token step: loss, detector verdicts, evidence, root cause"),
    "replay": ("llmobs.commands.replay", "replay a token step in the live workload: reproduced or drift"),
    "compare": ("llmobs.commands.compare", "two variants on the same traffic: per metric, with intervals"),
    "mirror": ("llmobs.commands.mirror", "mirror HTTP traffic: the primary answers, a shadow gets a copy"),
    "run": ("llmobs.commands.run", "the host daemon: discover, attach, store and export (systemd service)"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line and one `hint:` line (exit 2) like every other
    error of the CLI, not argparse's usage block; its subparsers are of this class too."""

    def error(self, message: str):
        _print_error(UsageError(message, hint=f"see `{self.prog} --help` (usage: {self._short_usage()})"))
        sys.exit(ExitCode.USAGE)

    def _short_usage(self) -> str:
        """`llmobs-agent query [options] [SQL]`: the positionals, the options left to --help."""
        formatter = self._get_formatter()
        positionals = [
            formatter._format_args(action, action.dest)
            for action in self._actions
            if not action.option_strings
        ]
        return " ".join([self.prog, "[options]", *positionals])


def _print_error(exc: LlmobsError) -> None:
    print(f"error: {one_line(str(exc))}", file=sys.stderr)  # it may quote a process's comm
    if exc.hint:
        print(f"hint: {one_line(exc.hint)}", file=sys.stderr)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `only`, only that command's options are configured (the others list
    their one-line help): importing every command module costs ~2 s and ~100 MB here (DuckDB, gRPC,
    pyarrow), which an agent would carry resident for its whole life."""
    parser = ArgumentParser(
        prog="llmobs-agent",
        description="Token-level observability of PyTorch LLM workloads (eBPF + CUPTI).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        command_parser.set_defaults(_module=module_name)
        if only is not None and name != only:
            continue
        try:
            importlib.import_module(module_name).configure(command_parser)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            command_parser.set_defaults(_missing=True)
    parser.commands = sub.choices  # name -> its parser
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command named on the command line (the first non-option word), None when none is."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    return word if word in COMMANDS else None


# The agent's own commands load numpy with one OpenBLAS thread: it multiplies no matrices, and by default
# OpenBLAS starts a thread per core at import (0.1 s of CPU on 2 cores here, more threads and buffers
# on a GPU server). Set only for that import: the workloads these commands start keep their defaults.
_AGENT_COMMANDS = frozenset({"attach", "run"})


def _import_numpy_single_threaded() -> None:
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


def _return_freed_memory() -> None:
    """glibc's malloc raises its mmap threshold each time a large block is freed, so the agent's
    per-drain arrays end up on the heap, whose free holes stay resident; fixed thresholds return
    them. Measured on `attach --db` at 10k events/s: RSS 167-171 -> 161 MB (idle 147 -> 143)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 128 << 10)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 << 10)
    except (OSError, AttributeError):  # not glibc: its defaults stay
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters of glibc's malloc.h


class _NoPandas:
    """An import finder that refuses pandas: pyarrow imports it, when it is installed, on the first
    array it builds (its pandas shim looks at every input), and the agent uses none of it. Measured:
    0.46-0.67 s on the path from the probes being attached to the first drain (the pipeline's first
    pa.array) and +43 MB of RSS for the whole run. pyarrow and DuckDB work without pandas (a supported
    install); only the agent's own process is affected: the workloads it starts import what they like."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError("the llmobs agent does not load pandas", name=name)
        return None


def _without_pandas() -> None:
    if "pandas" not in sys.modules and _NoPandas not in sys.meta_path:
        sys.meta_path.insert(0, _NoPandas)


def main(argv: list[str] | None = None) -> int:
    command = _command_in(sys.argv[1:] if argv is None else argv)
    if command in _AGENT_COMMANDS:
        _return_freed_memory()
        _without_pandas()
        _import_numpy_single_threaded()
    parser = build_parser(command)
    args, extras = parser.parse_known_args(argv)
    if extras:  # said by the command's parser, so the hint names that command's --help
        command_parser = parser.commands.get(args.command, parser)
        command_parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if not args.command:
        parser.print_help()
        return ExitCode.USAGE
    try:
        if getattr(args, "_missing", False):
            raise UsageError(
                f"`{args.command}` is not built yet in this version", hint="see `llmobs-agent --help`"
            )
        return int(importlib.import_module(args._module).run(args) or 0)
    except LlmobsError as exc:
        _print_error(exc)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return ExitCode.OK
    except Exception:  # a bug: show it, but with our exit code
        traceback.print_exc()
        return ExitCode.FAILURE


if __name__ == "__main__":
    sys.exit(main())
