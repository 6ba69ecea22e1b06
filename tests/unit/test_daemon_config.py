"""The daemon's config: precedence flag > env > file > default, and one clear line for every bad value."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
from pathlib import Path

import pytest
from llmobs.daemon import config as cfg
from llmobs.errors import ConfigError, ExitCode

DOCS = Path(__file__).resolve().parents[2] / "docs" / "daemon.md"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def load(path=None, env=None, flags=None):
    return cfg.load(path, env=env or {}, flags=flags)


def test_defaults_without_file(monkeypatch):
    monkeypatch.setattr(cfg, "DEFAULT_CONFIG_PATH", Path("/nonexistent/llmobs.toml"))
    config = load()
    assert config.file is None
    assert config.store_path == Path("/var/lib/llmobs/llmobs.duckdb")
    assert config.profiles == ("cpu", "host")
    assert config.overhead_budget == 0.01
    assert config.store_prompts is False
    assert config.retention_age_s == 7 * 86400
    assert config.otlp is None
    assert set(config.sources.values()) == {"default"}


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = write(tmp_path, '[probes]\nsample_n = 3\nsample_mode = "cpu"\n[select]\ncommand = "from-file"\n')
    env = {"LLMOBS_SAMPLE_N": "5", "LLMOBS_SELECT_COMMAND": "from-env"}
    flags = {"probes.sample_n": "7", "select.command": None}  # None: flag not given
    config = load(path, env, flags)
    assert config.sample_n == 7 and config.sources["probes.sample_n"] == "flag --sample"
    assert config.command == "from-env" and config.sources["select.command"] == "env LLMOBS_SELECT_COMMAND"
    assert config.sample_mode == "cpu" and config.sources["probes.sample_mode"] == f"file {path}"
    assert config.discovery_interval_s == 2.0 and config.sources["discovery.interval_s"] == "default"


def test_config_file_from_environment(tmp_path):
    path = write(tmp_path, '[daemon]\nrun_dir = "/tmp/x-run"\n')
    config = cfg.load(None, env={"LLMOBS_CONFIG": str(path)})
    assert config.file == path and config.run_dir == Path("/tmp/x-run")


def test_empty_environment_value_does_not_override(tmp_path):
    path = write(tmp_path, "[probes]\nsample_n = 3\n")
    assert load(path, {"LLMOBS_SAMPLE_N": " "}).sample_n == 3


def test_typed_values(tmp_path):
    path = write(
        tmp_path,
        '[store]\nretention_age = "12h"\nretention_bytes = "2GiB"\nstore_prompts = true\n'
        '[probes]\nprofiles = ["host", "cpu", "host"]\n[select]\nusers = ["root", 4242]\n'
        'cgroup = "/system.slice/*"\n[overhead]\nbudget = 0.05\n',
    )
    config = load(path)
    assert config.retention_age_s == 12 * 3600
    assert config.retention_bytes == 2 << 30
    assert config.store_prompts is True
    assert config.profiles == ("host", "cpu")
    assert config.users == (0, 4242)
    assert config.cgroup == "/system.slice/*"
    assert config.overhead_budget == 0.05
    assert load(path, {"LLMOBS_RETENTION_AGE": "0"}).retention_age_s is None
    assert load(path, {"LLMOBS_PROFILES": "cuda, mem"}).profiles == ("cuda", "mem")


# every key with a bad value, as the file would give it: the message names key, value and what is allowed
BAD_VALUES = {
    "store.path": "relative/path.duckdb",
    "store.retention_age": "soon",
    "store.retention_bytes": "12 parsecs",
    "store.store_prompts": "maybe",
    "probes.profiles": ["cpu", "gpu-magic"],
    "probes.sample_n": 0,
    "probes.sample_mode": "random",
    "probes.thin": 0,
    "probes.ioctl_paths": 12,
    "select.users": ["no-such-user-llmobs"],
    "select.cgroup": ["not", "a", "string"],
    "select.command": "([unclosed",
    "discovery.interval_s": 0,
    "discovery.recheck_s": "often",
    "overhead.budget": 1.5,
    "overhead.cost_scale": 0,
    "overhead.cpu_priority": "realtime",
    "daemon.run_dir": "",
    "daemon.max_targets": 5000,
    "detector.name": "zscore",
    "detector.alarm_rate": 0.5,
    "detector.fdr": 0,
    "detector.window": 1,
    "detector.alpha": "often",
    "detector.mad_threshold": -1,
    "detector.aftermath": -3,
    "replay.on_anomaly": "sometimes",
    "replay.max_per_minute": 0,
}


def test_every_setting_has_a_bad_value_case():
    assert set(BAD_VALUES) == {s.key for s in cfg.SETTINGS}


def _toml(value) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_bad_value_in_file_is_one_line_naming_key_value_and_allowed(tmp_path, key):
    section, name = key.split(".")
    path = write(tmp_path, f"[{section}]\n{name} = {_toml(BAD_VALUES[key])}\n")
    setting = next(s for s in cfg.SETTINGS if s.key == key)
    with pytest.raises(ConfigError) as caught:
        load(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{key} = {BAD_VALUES[key]!r} (from file {path}): ")
    assert message.endswith(f"allowed: {setting.allowed}")
    assert caught.value.exit_code == ExitCode.USAGE


@pytest.mark.parametrize(
    ("env", "flags", "expected"),
    [
        ({"LLMOBS_OVERHEAD_BUDGET": "-1"}, {}, "overhead.budget = '-1' (from env LLMOBS_OVERHEAD_BUDGET)"),
        ({}, {"discovery.interval_s": "fast"}, "discovery.interval_s = 'fast' (from flag --interval)"),
        ({}, {"probes.sample_n": "2.5"}, "probes.sample_n = '2.5' (from flag --sample): not an integer"),
        ({"LLMOBS_MAX_TARGETS": "-1"}, {}, "daemon.max_targets = '-1' (from env LLMOBS_MAX_TARGETS)"),
        ({"LLMOBS_RETENTION_BYTES": "1000"}, {}, "smaller than 1 MiB"),
    ],
)
def test_bad_value_from_env_or_flag_names_its_origin(env, flags, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load(None, env, flags)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[probes]\nsampel_n = 2\n", "unknown key 'sampel_n' in [probes]; allowed: profiles, sample_n"),
        ("[prob]\nsample_n = 2\n", "unknown table [prob]; allowed: store, probes, select"),
        ("probes = 3\n", "probes must be a table"),
        ("[probes\nsample_n = 2\n", "is not valid TOML"),
    ],
)
def test_bad_file_structure(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load(path)


def test_missing_explicit_file(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"no config file at {tmp_path / 'nope.toml'}")):
        load(tmp_path / "nope.toml")


def test_otlp_from_file_env_and_flag(tmp_path):
    path = write(tmp_path, '[otlp]\nendpoint = "http://127.0.0.1:4317"\nprotocol = "grpc"\n')
    config = load(path)
    assert config.otlp.resolved_endpoint() == "http://127.0.0.1:4317"
    assert config.sources["otlp.endpoint"] == "file"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://10.0.0.1:4317"}
    assert load(path, env).otlp.resolved_endpoint() == "http://10.0.0.1:4317"
    flagged = load(path, env, {"otlp.endpoint": "http://127.0.0.1:9999"})
    assert flagged.otlp.resolved_endpoint() == "http://127.0.0.1:9999"
    assert flagged.sources["otlp.endpoint"] == "flag"


def test_bad_otlp_endpoint_fails_at_load(tmp_path):
    path = write(tmp_path, '[otlp]\nendpoint = "http://no-port-here"\n')
    with pytest.raises(
        ConfigError, match="otlp: gRPC endpoint 'http://no-port-here' needs a host and a port"
    ):
        load(path)


def test_changed_keys_and_describe(tmp_path):
    old = load(write(tmp_path, '[select]\ncommand = "a"\n'))
    new = load(write(tmp_path, '[select]\ncommand = "b"\n[probes]\nsample_n = 2\n'))
    assert old.changed_keys(new) == ["probes.sample_n", "select.command"]
    lines = cfg.describe(new)
    assert f'command = "b"  # file {tmp_path / "agent.toml"}' in lines
    assert 'sample_mode = "trace"  # default' in lines
    assert lines[-1].startswith("# off: no endpoint")


def test_docs_list_every_key_and_variable():
    text = DOCS.read_text()
    for setting in cfg.SETTINGS:
        row = f"| `{setting.key}` |"
        assert row in text, f"docs/daemon.md has no row for {setting.key}"
        line = next(line for line in text.splitlines() if line.startswith(row))
        assert f"`{setting.env}`" in line, f"{setting.key}: docs name another variable"
        if setting.flag:
            assert f"`{setting.flag}`" in line


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmobs.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LLMOBS_CONFIG": "", **(env or {})},
    )


def test_check_config_prints_origins_and_exits_0(tmp_path):
    path = write(tmp_path, '[select]\ncommand = "python.*serve"\n')
    done = run_cli(
        "--config", str(path), "--check-config", "--sample", "4", env={"LLMOBS_SELECT_CGROUP": "/x/*"}
    )
    assert done.returncode == 0, done.stderr
    assert 'command = "python.*serve"  # file ' + str(path) in done.stdout
    assert "sample_n = 4  # flag --sample" in done.stdout
    assert 'cgroup = "/x/*"  # env LLMOBS_SELECT_CGROUP' in done.stdout


def test_check_config_bad_value_exits_2_with_one_error_line(tmp_path):
    path = write(tmp_path, "[overhead]\nbudget = 2\n")
    done = run_cli("--config", str(path), "--check-config")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    allowed = "allowed: a fraction in [0, 1], e.g. 0.01 for 1%; 0 turns the governor off"
    assert lines[0] == f"error: overhead.budget = 2 (from file {path}): out of range; {allowed}"
    assert lines[1].startswith("hint: ") and len(lines) == 2
    assert "Traceback" not in done.stderr


def test_user_names_resolve_to_uids():
    root = pwd.getpwuid(0).pw_name
    assert load(None, {"LLMOBS_SELECT_USERS": f"{root},0,1234"}).users == (0, 1234)
