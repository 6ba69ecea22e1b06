"""The daemon's configuration: TOML file, LLMOBS_* environment variables and flags, validated once.

Precedence, per key: a flag > its environment variable > the config file > the default. Every value is
parsed and checked here, at load, into a frozen DaemonConfig; the rest of the daemon never sees a raw
string. A bad value is one line naming the key, the value, where it came from and what is allowed
(ConfigError, exit 2). The [otlp] table is handed to llmobs.otlp.config, which applies the same
precedence with the standard OTEL_EXPORTER_OTLP_* variables. SETTINGS (llmobs.settings, shared with
`attach`) is the documented table (docs/daemon.md prints it; a unit test keeps the two in step).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmobs import environment
from llmobs.errors import ConfigError, LlmobsError
from llmobs.settings import SETTINGS, parse_value

DEFAULT_CONFIG_PATH = Path("/etc/llmobs/llmobs-agent.toml")
CONFIG_ENV = environment.LLMOBS_CONFIG  # the config file when --config is not given


SECTIONS = tuple(dict.fromkeys(s.key.split(".")[0] for s in SETTINGS)) + ("otlp",)


@dataclass(frozen=True)
class DaemonConfig:
    store_path: Path
    retention_age_s: float | None
    retention_bytes: int | None
    store_prompts: bool
    profiles: tuple[str, ...]
    sample_n: int
    sample_mode: str
    thin: int
    ioctl_paths: str
    users: tuple[int, ...]
    cgroup: str
    command: str
    discovery_interval_s: float
    recheck_s: float
    overhead_budget: float
    cost_scale: float
    cpu_priority: str
    run_dir: Path
    max_targets: int
    detector: str  # detector.*: the token-loss anomaly detectors of every target (detector_config())
    alarm_rate: float
    fdr: float
    detector_window: int
    alpha: float
    mad_threshold: float
    aftermath: int
    replay_on_anomaly: bool  # replay.*: automatic replays of flagged tokens (replay_options())
    replay_max_per_minute: int
    otlp: object | None = None  # llmobs.otlp.OtlpConfig when an endpoint is configured anywhere
    file: Path | None = None
    # key -> where its value came from: "default", "file", "env LLMOBS_X", "flag --x"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def detector_config(self):
        """The DetectorConfig every target's pipeline runs (None: detector.name off)."""
        from llmobs.diagnostics.detectors import config_of

        return config_of({s.key: getattr(self, s.attr) for s in SETTINGS if s.key.startswith("detector.")})

    def replay_options(self):
        """The automatic replays every target's pipeline runs (None: replay.on_anomaly off)."""
        from llmobs.settings import REPLAY_KEYS, replay_options

        return replay_options({s.key: getattr(self, s.attr) for s in SETTINGS if s.key in REPLAY_KEYS})

    def changed_keys(self, other: DaemonConfig) -> list[str]:
        """The keys whose values differ (for SIGHUP's log line and what it must redo)."""
        keys = [s.key for s in SETTINGS if getattr(self, s.attr) != getattr(other, s.attr)]
        if self.otlp != other.otlp:
            keys.append("otlp")
        return keys


def read_file(path: Path) -> dict:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}") from None
    except PermissionError:
        raise ConfigError(f"cannot read the config file {path}: permission denied") from None
    except IsADirectoryError:
        raise ConfigError(f"the config file {path} is a directory") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def _flatten(data: dict, path: Path) -> tuple[dict[str, object], dict]:
    """{"store.path": ...} from the file's tables, and its [otlp] table; unknown names are errors."""
    known = {s.key for s in SETTINGS}
    flat: dict[str, object] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown table [{section}]; allowed: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}])")
        if section == "otlp":
            continue
        for name, value in table.items():
            key = f"{section}.{name}"
            if key not in known:
                allowed = ", ".join(s.key.split(".")[1] for s in SETTINGS if s.key.startswith(section + "."))
                raise ConfigError(f"{path}: unknown key {name!r} in [{section}]; allowed: {allowed}")
            flat[key] = value
    otlp = data.get("otlp", {})
    return flat, otlp


def config_path(explicit: str | os.PathLike | None, env: Mapping[str, str]) -> Path | None:
    """--config, else $LLMOBS_CONFIG, else the default file if it exists, else none (defaults only)."""
    if explicit:
        return Path(explicit)
    if env.get(CONFIG_ENV, "").strip():
        return Path(env[CONFIG_ENV].strip())
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None


def load(
    path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> DaemonConfig:
    """The validated config. `flags` maps keys ("probes.sample_n", "otlp.endpoint", ...) to the values
    given on the command line (None: not given). Raises ConfigError (or OtlpConfigError), exit 2."""
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    file = config_path(path, env)
    flat, otlp_table = _flatten(read_file(file), file) if file else ({}, {})
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        raw, origin = setting.default, "default"
        if setting.key in flat:
            raw, origin = flat[setting.key], f"file {file}"
        if env.get(setting.env, "").strip():
            raw, origin = env[setting.env], f"env {setting.env}"
        if setting.key in flags:
            raw, origin = flags[setting.key], f"flag {setting.flag}"
        values[setting.attr] = parse_value(setting, raw, origin)
        sources[setting.key] = origin
    values["otlp"] = _otlp(otlp_table, env, flags, sources)
    return DaemonConfig(**values, file=file, sources=sources)


def _otlp(table: dict, env: Mapping[str, str], flags: Mapping[str, object], sources: dict[str, str]):
    """The OTLP exporter's config when an endpoint is set by a flag, OTEL_* variable or the file."""
    from llmobs.otlp.config import resolve

    cli = {k.split(".", 1)[1]: v for k, v in flags.items() if k.startswith("otlp.")}
    try:
        config = resolve(cli, env, table)
        if "endpoint" not in config.sources:
            return None
        if config.protocol == "grpc":
            config.grpc_target()  # a bad endpoint fails at load, not in the export thread
    except LlmobsError as exc:
        raise ConfigError(f"otlp: {exc}", hint=exc.hint) from None
    for key, origin in config.sources.items():
        sources[f"otlp.{key}"] = origin.replace("env:", "env ").replace("cli", "flag")
    return config


def describe(config: DaemonConfig) -> list[str]:
    """The effective config as TOML-like lines, each with where its value came from (--check-config)."""
    lines = [f"# config file: {config.file or '(none: defaults, environment and flags only)'}"]
    section = None
    for setting in SETTINGS:
        name_section, name = setting.key.split(".")
        if name_section != section:
            section = name_section
            lines.append(f"[{section}]")
        value = getattr(config, setting.attr)
        lines.append(f"{name} = {_show(value)}  # {config.sources.get(setting.key, 'default')}")
    lines.append("[otlp]")
    if config.otlp is None:
        lines.append("# off: no endpoint (set otlp.endpoint, --otlp or OTEL_EXPORTER_OTLP_ENDPOINT)")
    else:
        lines.append(
            f"endpoint = {_show(config.otlp.resolved_endpoint())}  # {config.sources['otlp.endpoint']}"
        )
        lines.append(
            f"protocol = {_show(config.otlp.protocol)}  # {config.sources.get('otlp.protocol', 'default')}"
        )
    return lines


def _show(value: object) -> str:
    if value is None:
        return "0"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # a TOML basic string: backslashes and quotes escaped
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)
