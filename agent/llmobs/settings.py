"""The settings table: every key of the agent's configuration, its variable, flag, default and parser.

One table (SETTINGS) is the vocabulary of `run` (file, LLMOBS_* variable, flag: daemon/config.py applies
the precedence) and of `attach` (the same flags, parsers and units for the keys it shares); argparse
options are generated from it (add_flags), so a flag is declared once. A value is parsed and checked by
its setting's parser; a bad one is one ConfigError line naming the key, the value, where it came from
and what is allowed (exit 2). docs/daemon.md prints the table (a unit test keeps the two in step).
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from llmobs import environment
from llmobs.bpf.records import DEFAULT_THIN
from llmobs.diagnostics.detectors import (
    AGENT_DETECTOR,
    DEFAULT_ALARM_RATE,
    MAX_ALARM_RATE,
    MIN_ALARM_RATE,
    DetectorConfig,
    config_of,
)
from llmobs.errors import ConfigError
from llmobs.governor.governor import DEFAULT_COST_SCALE


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
    env: str  # its variable (llmobs.environment)
    flag: str | None  # its `run` flag
    parse: Callable[[object], object]
    allowed: str  # what is accepted, for messages and docs
    doc: str
    live: bool = True  # applied by SIGHUP; False: takes effect at the next start
    metavar: str | None = None  # the flag's value in --help
    flag_help: str | None = None  # the flag's short help (the key is appended)
    dest: str | None = None  # the flag's argparse dest when its name would clash


@dataclass(frozen=True)
class Flag:
    """A command-line option that sets one config key; its value is parsed later, by the key's setting."""

    option: str  # "--sample"
    key: str  # "probes.sample_n"
    metavar: str
    help: str
    dest: str | None = None

    @property
    def attr(self) -> str:
        return self.dest or self.option.lstrip("-").replace("-", "_")


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "store.path",
        "store_path",
        "/var/lib/llmobs/llmobs.duckdb",
        environment.LLMOBS_DB,
        "--db",
        _path,
        "an absolute file path",
        "the DuckDB store every target's data goes to",
        live=False,
        metavar="PATH",
        flag_help="the DuckDB store",
    ),
    Setting(
        "store.retention_age",
        "retention_age_s",
        "7d",
        environment.LLMOBS_RETENTION_AGE,
        "--retention-age",
        _duration_or_off,
        "a duration like 3600, 90s, 30m, 12h, 7d; 0 keeps everything",
        "rows older than this are deleted (checked every 10 minutes)",
        metavar="AGE",
        flag_help="delete rows older than AGE, e.g. 7d; 0 keeps all",
    ),
    Setting(
        "store.retention_bytes",
        "retention_bytes",
        0,
        environment.LLMOBS_RETENTION_BYTES,
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
        environment.LLMOBS_STORE_PROMPTS,
        None,
        _bool,
        "true or false",
        "keep raw prompt text (off: prompts are only ever hashed)",
    ),
    Setting(
        "probes.profiles",
        "profiles",
        "cpu,host",
        environment.LLMOBS_PROFILES,
        "--profile",
        _profiles,
        "a list from cpu, gemm, mem, host, cuda, threadctx",
        "probe profiles attached to every target",
        metavar="LIST",
        flag_help="probe profiles, e.g. cpu,host",
    ),
    Setting(
        "probes.sample_n",
        "sample_n",
        1,
        environment.LLMOBS_SAMPLE_N,
        "--sample",
        _int_between(1, 1 << 30),
        "an integer >= 1",
        "events leave the kernel 1 in N (totals stay exact)",
        metavar="N",
        flag_help="export 1 in N events",
    ),
    Setting(
        "probes.sample_mode",
        "sample_mode",
        "trace",
        environment.LLMOBS_SAMPLE_MODE,
        "--sample-mode",
        _choice("trace", "cpu"),
        "trace or cpu",
        "trace: keep a request whole; cpu: per-CPU counter hash",
        metavar="MODE",
        flag_help="trace or cpu",
    ),
    Setting(
        "probes.thin",
        "thin",
        DEFAULT_THIN,
        environment.LLMOBS_THIN,
        "--thin",
        _int_between(1, 1 << 30),
        "an integer >= 1",
        "linear and page_fault_user ship 1 in N of a step's events (per-step counts stay exact); 1: all",
        metavar="N",
        flag_help="ship 1 in N of a step's linear and page-fault events",
    ),
    Setting(
        "probes.ioctl_paths",
        "ioctl_paths",
        "/dev/nvidia*",
        environment.LLMOBS_IOCTL_PATHS,
        None,
        _text,
        "a glob over device paths",
        "device files whose ioctls the host profile times",
        metavar="GLOB",
        flag_help="device files whose ioctls the host profile times",
    ),
    Setting(
        "select.users",
        "users",
        [],
        environment.LLMOBS_SELECT_USERS,
        "--user",
        _users,
        "user names or uids (a list, or comma-separated); empty: every user",
        "attach only to processes whose effective uid is one of these",
        metavar="LIST",
        flag_help="only processes of these users/uids",
    ),
    Setting(
        "select.cgroup",
        "cgroup",
        "",
        environment.LLMOBS_SELECT_CGROUP,
        "--cgroup",
        _text,
        "a glob over the cgroup path (e.g. /system.slice/llm-*.service); empty: any",
        "attach only to processes in a matching cgroup (/proc/PID/cgroup)",
        metavar="GLOB",
        flag_help="only processes in a matching cgroup",
    ),
    Setting(
        "select.command",
        "command",
        "",
        environment.LLMOBS_SELECT_COMMAND,
        "--command",
        _regex,
        "a Python regular expression, searched in the command line; empty: any",
        "attach only to processes whose command line matches",
        metavar="REGEX",
        flag_help="only matching command lines",
        dest="select_command",  # not `command`: the CLI's subcommand dest
    ),
    Setting(
        "discovery.interval_s",
        "discovery_interval_s",
        2.0,
        environment.LLMOBS_DISCOVERY_INTERVAL_S,
        "--interval",
        _float_between(0.05, 3600.0),
        "a number of seconds in [0.05, 3600]",
        "how often /proc is scanned for new and gone processes",
        metavar="S",
        flag_help="scan /proc every S seconds",
    ),
    Setting(
        "discovery.recheck_s",
        "recheck_s",
        30.0,
        environment.LLMOBS_DISCOVERY_RECHECK_S,
        None,
        _float_between(0.05, 86400.0),
        "a number of seconds in [0.05, 86400]",
        "a process that did not qualify is looked at again after this long (it may load torch later)",
    ),
    Setting(
        "overhead.budget",
        "overhead_budget",
        0.01,
        environment.LLMOBS_OVERHEAD_BUDGET,
        "--overhead-budget",
        _float_between(0.0, 1.0),
        "a fraction in [0, 1], e.g. 0.01 for 1%; 0 turns the governor off",
        "the estimated slowdown per workload above which the governor sheds probes (0: never shed)",
        metavar="F",
        flag_help="max estimated slowdown, a fraction: 0.01 is 1%; 0 turns the governor off",
    ),
    Setting(
        "overhead.cost_scale",
        "cost_scale",
        DEFAULT_COST_SCALE,
        environment.LLMOBS_OVERHEAD_COST_SCALE,
        "--cost-scale",
        _float_between(0.0, 100.0, low_open=True),
        "a number in (0, 100]",
        "the starting value (prior) of the in-situ factor over the calibrated per-hit probe costs; the"
        " governor then learns each target's factor from its own sheds and restores (within [0.5, 8])",
        metavar="X",
        flag_help="the prior of the learned probe-cost factor: each target starts at X",
    ),
    Setting(
        "overhead.cpu_priority",
        "cpu_priority",
        "idle",
        environment.LLMOBS_CPU_PRIORITY,
        "--cpu-priority",
        _choice("idle", "normal"),
        "idle or normal",
        "idle: the agent's threads run under SCHED_IDLE once attached, only on CPU the workload leaves"
        " (a starved agent's losses are counted, never the workload's time); normal: as started",
        live=False,
        metavar="POLICY",
        flag_help="idle (default): the agent runs only on CPU the workload leaves; normal: as started",
    ),
    Setting(
        "daemon.run_dir",
        "run_dir",
        "/run/llmobs",
        environment.LLMOBS_RUN_DIR,
        "--run-dir",
        _path,
        "an absolute directory path",
        "live snapshots for `top` and the daemon's status file",
        live=False,
        metavar="DIR",
        flag_help="live snapshots and status file",
    ),
    Setting(
        "daemon.max_targets",
        "max_targets",
        64,
        environment.LLMOBS_MAX_TARGETS,
        None,
        _int_between(1, 4096),
        "an integer in [1, 4096]",
        "at most this many processes are attached at once",
    ),
    # the token-loss anomaly detectors (docs/diagnostics.md); every target's pipeline gets the same
    Setting(
        "detector.name",
        "detector",
        AGENT_DETECTOR,
        environment.LLMOBS_DETECTOR,
        "--detector",
        _choice("calibrated", "ttest", "mad", "both", "all", "off"),
        "calibrated, ttest, mad, both (ttest and mad), all or off",
        "the token-loss anomaly detectors run on every token step",
        live=False,
        metavar="NAME",
        flag_help="token-loss anomaly detectors: calibrated, ttest, mad, both, all or off",
    ),
    Setting(
        "detector.alarm_rate",
        "alarm_rate",
        DEFAULT_ALARM_RATE,
        environment.LLMOBS_ALARM_RATE,
        "--alarm-rate",
        _float_between(MIN_ALARM_RATE, MAX_ALARM_RATE),
        f"a fraction in [{MIN_ALARM_RATE:g}, {MAX_ALARM_RATE:g}], e.g. 1e-4 for 1 per 10,000 tokens",
        "calibrated: false alarms per clean token; no verdict until a reference holds 1 / rate tokens",
        live=False,
        metavar="RATE",
        flag_help="calibrated detector: false alarms per clean token, e.g. 1e-4",
    ),
    Setting(
        "detector.fdr",
        "fdr",
        DetectorConfig.fdr,
        environment.LLMOBS_DETECTOR_FDR,
        None,
        _float_between(0.0, 0.5, low_open=True),
        "a fraction in (0, 0.5]",
        "calibrated: the Benjamini-Hochberg level of a request's verdict",
        live=False,
    ),
    Setting(
        "detector.window",
        "detector_window",
        DetectorConfig.window,
        environment.LLMOBS_DETECTOR_WINDOW,
        "--detector-window",
        _int_between(2, 4096),
        "an integer in [2, 4096]",
        "ttest, mad: the preceding tokens of the request each loss is compared with",
        live=False,
        metavar="N",
        flag_help="ttest, mad: tokens of the request each loss is compared with",
    ),
    Setting(
        "detector.alpha",
        "alpha",
        DetectorConfig.alpha,
        environment.LLMOBS_DETECTOR_ALPHA,
        "--alpha",
        _float_between(0.0, 0.5, low_open=True),
        "a fraction in (0, 0.5]",
        "ttest: the one-sided significance level",
        live=False,
        metavar="A",
        flag_help="ttest: significance level",
    ),
    Setting(
        "detector.mad_threshold",
        "mad_threshold",
        DetectorConfig.mad_threshold,
        environment.LLMOBS_DETECTOR_MAD_THRESHOLD,
        "--mad-threshold",
        _float_between(0.0, 1000.0, low_open=True),
        "a number in (0, 1000]",
        "mad: the modified z-score above which a token is flagged",
        live=False,
        metavar="Z",
        flag_help="mad: modified z-score to flag",
    ),
    Setting(
        "detector.aftermath",
        "aftermath",
        DetectorConfig.aftermath,
        environment.LLMOBS_DETECTOR_AFTERMATH,
        "--aftermath",
        _int_between(0, 4096),
        "an integer in [0, 4096]; 0: none",
        "calibrated: tokens after a flag that are its consequence unless they stand out in their request",
        live=False,
        metavar="N",
        flag_help="calibrated: tokens after a flag taken as its consequence (0: none)",
    ),
    # the flight recorder's automatic mode (docs/replay.md): the agent replays flagged tokens itself
    Setting(
        "replay.on_anomaly",
        "replay_on_anomaly",
        False,
        environment.LLMOBS_REPLAY_ON_ANOMALY,
        "--replay-on-anomaly",
        _bool,
        "true or false (the flag alone: true)",
        "replay each flagged token in its workload (needs llmobs.Recorder there) and store the verdict",
        live=False,
        metavar="BOOL",
        flag_help="replay flagged tokens in the workload's flight recorder",
    ),
    Setting(
        "replay.max_per_minute",
        "replay_max_per_minute",
        2,
        environment.LLMOBS_REPLAY_MAX_PER_MINUTE,
        "--replay-max-per-minute",
        _int_between(1, 600),
        "an integer in [1, 600]",
        "at most this many automatic replays per target in any minute (the rest are counted, skipped)",
        live=False,
        metavar="N",
        flag_help="at most N automatic replays per target a minute",
    ),
)
REPLAY_KEYS = ("replay.on_anomaly", "replay.max_per_minute")
DETECTOR_KEYS = tuple(s.key for s in SETTINGS if s.key.startswith("detector."))
BY_KEY = {setting.key: setting for setting in SETTINGS}

# The OTLP flags: their keys are llmobs.otlp.config's (it parses them, with the OTEL_* variables).
OTLP_FLAGS = (
    Flag("--otlp", "otlp.endpoint", "ENDPOINT", "export over OTLP to ENDPOINT"),
    Flag("--otlp-protocol", "otlp.protocol", "P", "grpc or http/protobuf"),
)


def flag(key: str, option: str | None = None, help: str | None = None) -> Flag:
    """The flag that sets `key`: its `run` flag, or `option` where a command names it (attach's
    --ioctl-paths), with the setting's metavar and help unless `help` says more."""
    setting = BY_KEY[key]
    name = option or setting.flag
    if not name or not setting.metavar:
        raise ValueError(f"{key} has no flag")
    return Flag(name, key, setting.metavar, help or setting.flag_help or setting.doc, setting.dest)


def run_flags() -> tuple[Flag, ...]:
    """`llmobs-agent run`'s flags, in the table's order, then the OTLP ones."""
    return tuple(flag(s.key) for s in SETTINGS if s.flag) + OTLP_FLAGS


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """One argparse option per flag; the value stays a string (None: not given) until parse_value."""
    for item in flags:
        setting = BY_KEY.get(item.key)
        # a boolean setting's flag alone means true (--replay-on-anomaly); `--flag false` still parses
        alone = {"nargs": "?", "const": "true"} if setting is not None and setting.parse is _bool else {}
        parser.add_argument(
            item.option,
            dest=item.attr,
            metavar=item.metavar,
            default=None,
            help=f"{item.help} ({item.key})".replace("%", "%%"),
            **alone,
        )


def parse_value(setting: Setting, raw: object, origin: str, hint: str | None = None) -> object:
    """`raw` (a file value, a variable's or a flag's text) parsed by its setting, or ConfigError naming
    the key, the value, its origin ("flag --sample", "env LLMOBS_SAMPLE_N") and what is allowed."""
    try:
        return setting.parse(raw)
    except ValueError as exc:
        raise ConfigError(
            f"{setting.key} = {raw!r} (from {origin}): {exc}; allowed: {setting.allowed}", hint=hint
        ) from None


def flag_values(
    args: argparse.Namespace, flags: Iterable[Flag], hint: str | None = None
) -> dict[str, object]:
    """key -> value for flags of settings: the flag's value parsed, or the setting's default when the
    flag was not given (a command without a config file: attach)."""
    values = {}
    for item in flags:
        setting = BY_KEY[item.key]
        raw = getattr(args, item.attr, None)
        origin = f"flag {item.option}" if raw is not None else "default"
        values[item.key] = parse_value(setting, setting.default if raw is None else raw, origin, hint)
    return values


def add_detector_arguments(parser: argparse.ArgumentParser) -> None:
    """The detectors' flags, for the commands that run a pipeline (attach; `run` has them from the
    settings table): one vocabulary, parser and default with the daemon's detector.* keys. Here, not in
    llmobs.diagnostics: the diagnostics layer is below the settings (docs/architecture.md)."""
    add_flags(parser, detector_flags())


def detector_flags() -> list[Flag]:
    """The flags of the detector.* settings that have one."""
    return [flag(key) for key in DETECTOR_KEYS if BY_KEY[key].flag is not None]


def detector_config(args: argparse.Namespace) -> DetectorConfig | None:
    """The DetectorConfig the flags ask for (None: --detector off); ValueError names a bad value."""
    try:
        values = flag_values(args, detector_flags())
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return config_of(values)


def replay_flags() -> list[Flag]:
    """The flags of the replay.* settings (attach; `run` has them from the table)."""
    return [flag(key) for key in REPLAY_KEYS]


def replay_options(values: dict[str, object]):
    """The automatic replays' options from replay.* values (None: replay.on_anomaly off)."""
    if not values["replay.on_anomaly"]:
        return None
    from llmobs.pipeline.auto_replay import ReplayOptions

    return ReplayOptions(max_per_minute=int(values["replay.max_per_minute"]))
