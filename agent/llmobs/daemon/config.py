"""The daemon's configuration: TOML file, LLMOBS_* environment variables and flags, validated once.

Precedence, per key: a flag > its environment variable > the config file > the default. Every value is
parsed and checked here, at load, into a frozen DaemonConfig; the rest of the daemon never sees a raw
string. A bad value is one line naming the key, the value, where it came from and what is allowed
(ConfigError, exit 2). The [otlp] table is handed to llmobs.otlp.config, which applies the same
precedence with the standard OTEL_EXPORTER_OTLP_* variables. SETTINGS is the documented table
(docs/daemon.md prints it; a unit test keeps the two in step).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmobs.errors import ConfigError, LlmobsError
from llmobs.governor.governor import DEFAULT_COST_SCALE

DEFAULT_CONFIG_PATH = Path("/etc/llmobs/llmobs-agent.toml")
CONFIG_ENV = "LLMOBS_CONFIG"  # the config file when --config is not given


# ---- value parsers: each takes a TOML value or a string (env, flag) and raises ValueError(why) ----------
def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value.strip()


def _path(value: object) -> Path:
    text = _text(value)
    if not text:
        raise ValueError("empty path")
    if not os.path.isabs(text):
        raise ValueError("not an absolute path")
    return Path(text)


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(value).lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError("not a boolean")


def _number(value: object, kind: type) -> float | int:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, int | float):
        number = value
    else:
        try:
            number = kind(_text(value))
        except ValueError:
            raise ValueError(f"not {'an integer' if kind is int else 'a number'}") from None
    if kind is int and (isinstance(number, float) and not number.is_integer()):
        raise ValueError("not an integer")
    return kind(number)


def _int_between(low: int, high: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        number = _number(value, int)
        if not low <= number <= high:
            raise ValueError("out of range")
        return int(number)

    return parse


def _float_between(low: float, high: float, low_open: bool = False) -> Callable[[object], float]:
    def parse(value: object) -> float:
        number = float(_number(value, float))
        if number != number or number > high or number < low or (low_open and number == low):
            raise ValueError("out of range")
        return number

    return parse


def _choice(*choices: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        text = _text(value)
        if text not in choices:
            raise ValueError("not one of the choices")
        return text

    return parse


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def _duration_or_off(value: object) -> float | None:
    """Seconds (a number, or text like 90s, 30m, 12h, 7d); 0 turns the feature off (None)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(_text(value).lower())
        if not match:
            raise ValueError("not a duration")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds < 0:
        raise ValueError("negative")
    return seconds or None


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?$")
_SIZE_UNITS = {None: 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_SIZE_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def _size_or_off(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(_text(value).lower())
        if not match:
            raise ValueError("not a size")
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    if size < 0:
        raise ValueError("negative")
    if 0 < size < 1 << 20:
        raise ValueError("smaller than 1 MiB")
    return size or None


def _list(value: object) -> list[str]:
    """A TOML array of strings/ints, or a comma-separated string (env, flag)."""
    if isinstance(value, list):
        items = value
    elif isinstance(value, str):
        items = value.split(",")
    else:
        raise ValueError("expected a list")
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str | int):
            raise ValueError(f"bad list item {item!r}")
        text = str(item).strip()
        if text:
            out.append(text)
    return out


def _profiles(value: object) -> tuple[str, ...]:
    from llmobs.bpf.profiles import parse_profiles

    try:
        return parse_profiles(",".join(_list(value)))
    except ValueError as exc:
        raise ValueError(str(exc).split(";")[0]) from None


def _users(value: object) -> tuple[int, ...]:
    """User names or uids -> uids. A name must exist on this host now: a typo is found at load."""
    uids = []
    for item in _list(value):
        if item.isdigit():
            uids.append(int(item))
            continue
        try:
            uids.append(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise ValueError(f"no user {item!r} on this host") from None
    return tuple(dict.fromkeys(uids))


def _regex(value: object) -> str:
    text = _text(value)
    try:
        re.compile(text)
    except re.error as exc:
        raise ValueError(f"bad regular expression: {exc}") from None
    return text


@dataclass(frozen=True)
class Setting:
    key: str  # "section.name" in the file
    attr: str  # the DaemonConfig field
    default: object
    env: str
    flag: str | None
    parse: Callable[[object], object]
    allowed: str  # what is accepted, for messages and docs
    doc: str
    live: bool = True  # applied by SIGHUP; False: takes effect at the next start


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "store.path",
        "store_path",
        "/var/lib/llmobs/llmobs.duckdb",
        "LLMOBS_DB",
        "--db",
        _path,
        "an absolute file path",
        "the DuckDB store every target's data goes to",
        live=False,
    ),
    Setting(
        "store.retention_age",
        "retention_age_s",
        "7d",
        "LLMOBS_RETENTION_AGE",
        "--retention-age",
        _duration_or_off,
        "a duration like 3600, 90s, 30m, 12h, 7d; 0 keeps everything",
        "rows older than this are deleted (checked every 10 minutes)",
    ),
    Setting(
        "store.retention_bytes",
        "retention_bytes",
        0,
        "LLMOBS_RETENTION_BYTES",
        None,
        _size_or_off,
        "a size like 512MiB or 10GiB (>= 1 MiB); 0 for no limit",
        "the store is trimmed to this size at start (compaction needs the file to itself)",
        live=False,
    ),
    Setting(
        "store.store_prompts",
        "store_prompts",
        False,
        "LLMOBS_STORE_PROMPTS",
        None,
        _bool,
        "true or false",
        "keep raw prompt text (off: prompts are only ever hashed)",
    ),
    Setting(
        "probes.profiles",
        "profiles",
        "cpu,host",
        "LLMOBS_PROFILES",
        "--profile",
        _profiles,
        "a list from cpu, gemm, mem, host, cuda",
        "probe profiles attached to every target",
    ),
    Setting(
        "probes.sample_n",
        "sample_n",
        1,
        "LLMOBS_SAMPLE_N",
        "--sample",
        _int_between(1, 1 << 30),
        "an integer >= 1",
        "events leave the kernel 1 in N (totals stay exact)",
    ),
    Setting(
        "probes.sample_mode",
        "sample_mode",
        "trace",
        "LLMOBS_SAMPLE_MODE",
        "--sample-mode",
        _choice("trace", "cpu"),
        "trace or cpu",
        "trace: keep a request whole; cpu: per-CPU counter hash",
    ),
    Setting(
        "probes.ioctl_paths",
        "ioctl_paths",
        "/dev/nvidia*",
        "LLMOBS_IOCTL_PATHS",
        None,
        _text,
        "a glob over device paths",
        "device files whose ioctls the host profile times",
    ),
    Setting(
        "select.users",
        "users",
        [],
        "LLMOBS_SELECT_USERS",
        "--user",
        _users,
        "user names or uids (a list, or comma-separated); empty: every user",
        "attach only to processes whose effective uid is one of these",
    ),
    Setting(
        "select.cgroup",
        "cgroup",
        "",
        "LLMOBS_SELECT_CGROUP",
        "--cgroup",
        _text,
        "a glob over the cgroup path (e.g. /system.slice/llm-*.service); empty: any",
        "attach only to processes in a matching cgroup (/proc/PID/cgroup)",
    ),
    Setting(
        "select.command",
        "command",
        "",
        "LLMOBS_SELECT_COMMAND",
        "--command",
        _regex,
        "a Python regular expression, searched in the command line; empty: any",
        "attach only to processes whose command line matches",
    ),
    Setting(
        "discovery.interval_s",
        "discovery_interval_s",
        2.0,
        "LLMOBS_DISCOVERY_INTERVAL_S",
        "--interval",
        _float_between(0.05, 3600.0),
        "a number of seconds in [0.05, 3600]",
        "how often /proc is scanned for new and gone processes",
    ),
    Setting(
        "discovery.recheck_s",
        "recheck_s",
        30.0,
        "LLMOBS_DISCOVERY_RECHECK_S",
        None,
        _float_between(0.05, 86400.0),
        "a number of seconds in [0.05, 86400]",
        "a process that did not qualify is looked at again after this long (it may load torch later)",
    ),
    Setting(
        "overhead.budget",
        "overhead_budget",
        0.01,
        "LLMOBS_OVERHEAD_BUDGET",
        "--overhead-budget",
        _float_between(0.0, 1.0),
        "a fraction in [0, 1], e.g. 0.01 for 1%; 0 turns the governor off",
        "the estimated slowdown per workload above which the governor sheds probes (0: never shed)",
    ),
    Setting(
        "overhead.cost_scale",
        "cost_scale",
        DEFAULT_COST_SCALE,
        "LLMOBS_OVERHEAD_COST_SCALE",
        "--cost-scale",
        _float_between(0.0, 100.0, low_open=True),
        "a number in (0, 100]",
        "the calibrated per-hit probe costs are multiplied by this (hits cost more in a workload)",
    ),
    Setting(
        "daemon.run_dir",
        "run_dir",
        "/run/llmobs",
        "LLMOBS_RUN_DIR",
        "--run-dir",
        _path,
        "an absolute directory path",
        "live snapshots for `top` and the daemon's status file",
        live=False,
    ),
    Setting(
        "daemon.max_targets",
        "max_targets",
        64,
        "LLMOBS_MAX_TARGETS",
        None,
        _int_between(1, 4096),
        "an integer in [1, 4096]",
        "at most this many processes are attached at once",
    ),
)
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
    ioctl_paths: str
    users: tuple[int, ...]
    cgroup: str
    command: str
    discovery_interval_s: float
    recheck_s: float
    overhead_budget: float
    cost_scale: float
    run_dir: Path
    max_targets: int
    otlp: object | None = None  # llmobs.otlp.OtlpConfig when an endpoint is configured anywhere
    file: Path | None = None
    # key -> where its value came from: "default", "file", "env LLMOBS_X", "flag --x"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

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
        try:
            values[setting.attr] = setting.parse(raw)
        except ValueError as exc:
            raise ConfigError(
                f"{setting.key} = {raw!r} (from {origin}): {exc}; allowed: {setting.allowed}"
            ) from None
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
