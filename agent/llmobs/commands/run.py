"""`llmobs-agent run`: the host daemon (the systemd service) - discovers PyTorch/CUDA processes that
match the configured selectors, attaches to them on one shared BPF program, stores and exports.

Configuration: --config FILE (else $LLMOBS_CONFIG, else /etc/llmobs/llmobs-agent.toml if present), the
LLMOBS_* variables and the flags below, in the precedence flags > environment > file > defaults
(docs/daemon.md). `--check-config` validates, prints the effective config with the origin of every
value, and exits (0, or 2 with one line naming the bad key). Progress goes to stderr: one line per
attach, detach, skip and reload.
"""

from __future__ import annotations

import argparse
import os
import sys

from llmobs.errors import AccessDenied
from llmobs.rerun import as_root_hint
from llmobs.settings import add_flags, run_flags

# every flag but --config/--check-config sets one config key; generated from the settings table
FLAGS = run_flags()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE", help="TOML config (default: $LLMOBS_CONFIG or /etc/llmobs/...)"
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate and print the effective config with origins, exit",
    )
    add_flags(parser, FLAGS)


def flags_of(args: argparse.Namespace) -> dict[str, object]:
    return {flag.key: getattr(args, flag.attr, None) for flag in FLAGS}


def _require_capabilities() -> None:
    """One clear line without the capabilities to load and attach, root or not (a root shell under a
    restricted bounding set has none): checked on the effective set, before anything is opened."""
    from llmobs.bpf.session import bpf_capable
    from llmobs.procfs import ProcFS

    if bpf_capable(ProcFS()):
        return
    hint = "run it as the systemd service (systemd/README.md) or with sudo"  # root without capabilities
    if os.geteuid() != 0:  # a user: the exact command to type again as root
        hint = f"run it as the systemd service (systemd/README.md), or {as_root_hint()}"
    raise AccessDenied(
        "`llmobs-agent run` needs root, or the capabilities systemd/llmobs-agent.service grants", hint=hint
    )


def run(args: argparse.Namespace) -> int:
    from llmobs.daemon import config as daemon_config

    def load():
        return daemon_config.load(args.config, flags=flags_of(args))

    config = load()
    if args.check_config:
        print("\n".join(daemon_config.describe(config)))
        return 0
    _require_capabilities()
    from llmobs.daemon.service import Service

    sys.stderr.flush()
    return Service(config, loader=load).run()
