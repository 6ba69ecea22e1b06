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
import sys

from llmobs.errors import AccessDenied

CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 21, 38, 39

# flag dest -> config key (the flags override these keys; docs/daemon.md lists them)
FLAG_KEYS = {
    "db": "store.path",
    "retention_age": "store.retention_age",
    "profile": "probes.profiles",
    "sample": "probes.sample_n",
    "sample_mode": "probes.sample_mode",
    "user": "select.users",
    "cgroup": "select.cgroup",
    "select_command": "select.command",  # not `command`: the CLI's subcommand dest
    "interval": "discovery.interval_s",
    "overhead_budget": "overhead.budget",
    "cost_scale": "overhead.cost_scale",
    "run_dir": "daemon.run_dir",
    "otlp": "otlp.endpoint",
    "otlp_protocol": "otlp.protocol",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE", help="TOML config (default: $LLMOBS_CONFIG or /etc/llmobs/...)"
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="validate and print the effective config with origins, exit",
    )
    parser.add_argument("--db", metavar="PATH", help="the DuckDB store (store.path)")
    parser.add_argument(
        "--retention-age", metavar="AGE", help="delete rows older than AGE, e.g. 7d (0: keep)"
    )
    parser.add_argument("--profile", metavar="LIST", help="probe profiles, e.g. cpu,host (probes.profiles)")
    parser.add_argument("--sample", metavar="N", help="export 1 in N events (probes.sample_n)")
    parser.add_argument("--sample-mode", metavar="MODE", help="trace or cpu (probes.sample_mode)")
    parser.add_argument("--user", metavar="LIST", help="only processes of these users/uids (select.users)")
    parser.add_argument(
        "--cgroup", metavar="GLOB", help="only processes in a matching cgroup (select.cgroup)"
    )
    parser.add_argument(
        "--command",
        dest="select_command",
        metavar="REGEX",
        help="only matching command lines (select.command)",
    )
    parser.add_argument("--interval", metavar="S", help="scan /proc every S seconds (discovery.interval_s)")
    parser.add_argument(
        "--overhead-budget", metavar="F", help="max estimated slowdown, e.g. 0.01 (overhead.budget)"
    )
    parser.add_argument(
        "--cost-scale", metavar="X", help="multiply the calibrated probe costs by X (overhead.cost_scale)"
    )
    parser.add_argument("--run-dir", metavar="DIR", help="live snapshots and status file (daemon.run_dir)")
    parser.add_argument("--otlp", metavar="ENDPOINT", help="export over OTLP to ENDPOINT (otlp.endpoint)")
    parser.add_argument("--otlp-protocol", metavar="P", help="grpc or http/protobuf (otlp.protocol)")


def flags_of(args: argparse.Namespace) -> dict[str, object]:
    return {key: getattr(args, dest, None) for dest, key in FLAG_KEYS.items()}


def _require_capabilities() -> None:
    """One clear line without the capabilities to load and attach, root or not (a root shell under a
    restricted bounding set has none): checked on the effective set, before anything is opened."""
    from llmobs.procfs import ProcFS

    caps = ProcFS().effective_caps("self")
    if caps & (1 << CAP_SYS_ADMIN) or (caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON)):
        return
    raise AccessDenied(
        "`llmobs-agent run` needs root, or the capabilities systemd/llmobs-agent.service grants",
        hint="run it as the systemd service (systemd/README.md) or with sudo",
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
