"""The systemd unit passes `systemd-analyze verify` (offline: PID 1 here is not systemd), declares the
privileges and limits the README documents, ships a default config the daemon accepts, and the daemon
without its capabilities says so in one line (exit 4)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from llmobs.daemon import config as cfg

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD / "llmobs-agent.service"
CAPS = {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}


def service_section() -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str
    parser.read_string(UNIT.read_text())
    return dict(parser["Service"])


def test_systemd_analyze_verify_passes_with_no_warning(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this host (apt-get install systemd)")
    # verify checks that ExecStart exists: point it at this environment's console script
    script = Path(sys.executable).with_name("llmobs-agent")
    assert script.exists(), f"{script}: install the package (pip install -e .)"
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/llmobs-agent", str(script)))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on settings it ignores ("Invalid CPU quota ..., ignoring"): any output is a failure
    assert done.returncode == 0 and (done.stdout + done.stderr).strip() == "", done.stdout + done.stderr


def test_verify_catches_a_broken_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this host (apt-get install systemd)")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("CPUQuota=50%", "CPUQuota=fifty"))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert "Invalid CPU quota 'fifty'" in done.stdout + done.stderr


def test_unit_declares_least_privileges_and_limits():
    service = service_section()
    assert service["Type"] == "notify"
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert set(service["CapabilityBoundingSet"].split()) == CAPS
    assert set(service["AmbientCapabilities"].split()) <= CAPS
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service["ProtectHome"] == "read-only"
    assert set(service["ReadWritePaths"].split()) == {"/var/lib/llmobs", "/run/llmobs"}
    assert "PrivateDevices" not in service  # the maps live in the host's /dev/shm
    for limit in ("MemoryMax", "CPUQuota"):
        assert service[limit]
    readme = (SYSTEMD / "README.md").read_text()
    for cap in CAPS:
        assert cap in readme


def test_default_config_is_valid_and_matches_the_defaults():
    config = cfg.load(SYSTEMD / "llmobs-agent.toml", env={})
    defaults = cfg.load(None, env={"LLMOBS_CONFIG": "/dev/null"})
    for setting in cfg.SETTINGS:
        assert getattr(config, setting.attr) == getattr(defaults, setting.attr), setting.key
    assert config.otlp is None
    # the unit's paths are the config's
    service = service_section()
    assert str(config.store_path.parent) in service["ReadWritePaths"].split()
    assert str(config.run_dir) in service["ReadWritePaths"].split()


def test_without_capabilities_one_line_and_exit_4(tmp_path):
    command = [sys.executable, "-m", "llmobs.cli", "run", "--db", str(tmp_path / "s.duckdb")]
    if os.geteuid() == 0:  # root: the same check with an empty capability bounding set
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is needed to drop root's capabilities")
        command = ["setpriv", "--bounding-set=-all", "--", *command]
    env = {**os.environ, "LLMOBS_CONFIG": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 4, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "error: `llmobs-agent run` needs root, or the capabilities systemd/llmobs-agent.service grants",
        "hint: run it as the systemd service (systemd/README.md) or with sudo",
    ]
    assert not (tmp_path / "s.duckdb").exists()  # refused before opening anything
