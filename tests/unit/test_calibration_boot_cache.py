"""The calibration's per-boot cache: a later attach in the same boot reads the measurement instead of
spending 80-400 ms of its start on it; another boot, program or handler set measures again."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from llmobs import environment
from llmobs.bpf import calibrate
from llmobs.bpf.calibrate import ClassCosts, Handler


@pytest.fixture
def boot(tmp_path, monkeypatch):
    monkeypatch.setenv(environment.LLMOBS_BPF_CACHE_DIR, str(tmp_path / "cache"))
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("11111111-2222-3333-4444-555555555555\n")
    monkeypatch.setattr(calibrate, "BOOT_ID_PATH", str(boot_id))
    calibrate.reset_cache()
    yield boot_id
    calibrate.reset_cache()


HANDLERS = [
    Handler("linear", "uprobe__linear", None),
    Handler("alloc_cpu", "uprobe__alloc_cpu", "uretprobe__alloc_cpu"),
]


def _measured() -> ClassCosts:
    return ClassCosts(
        empty={"emulated": 700.0, "stepped": 21_000.0},
        empty_return={"emulated": 1_000.0, "stepped": 21_300.0},
        handlers={"linear": 810.0, "alloc_cpu": 1_250.0},
        baseline_ns={"emulated": 3.0, "stepped": 9.0},
        took_s=0.25,
        rounds=5,
    )


def test_a_measurement_is_read_back_in_the_same_boot_only(boot):
    calibrate.write_boot_cache("int prog;", HANDLERS, _measured())
    again = calibrate.read_boot_cache("int prog;", HANDLERS)
    assert again is not None and again.source == "measured"
    assert again.empty == _measured().empty and again.handlers == _measured().handlers
    assert again.took_s == 0.0 and "this boot's measurement" in again.note  # what attach prints
    assert calibrate.read_boot_cache("int other;", HANDLERS) is None  # another program
    assert calibrate.read_boot_cache("int prog;", HANDLERS[:1]) is None  # another handler set
    boot.write_text("99999999-2222-3333-4444-555555555555\n")  # a reboot
    assert calibrate.read_boot_cache("int prog;", HANDLERS) is None


def test_a_file_another_user_could_write_is_not_read(boot):
    calibrate.write_boot_cache("int prog;", HANDLERS, _measured())
    files = [p for p in (boot.parent / "cache").iterdir() if p.name.startswith("calibration-")]
    assert len(files) == 1 and oct(files[0].stat().st_mode & 0o777) == oct(0o600)
    assert calibrate.read_boot_cache("int prog;", HANDLERS) is not None
    os.chmod(files[0], 0o666)
    assert calibrate.read_boot_cache("int prog;", HANDLERS) is None
    files[0].write_text("{not json")
    os.chmod(files[0], 0o600)
    assert calibrate.read_boot_cache("int prog;", HANDLERS) is None


def test_calibrate_measures_once_per_boot(boot, monkeypatch):
    """The first attach measures and keeps it; a second agent process (the process cache reset) reads
    it back without measuring."""
    runs = []

    def measure(program, handlers, rounds=5):
        runs.append([h.key for h in handlers])
        return _measured()

    monkeypatch.setattr(calibrate, "measure", measure)
    program = SimpleNamespace(source="int prog;")
    resolved = []  # probe_cost of no probe: only the classes are exercised here
    monkeypatch.setattr(calibrate, "handlers_of", lambda _resolved, _durations: HANDLERS)
    calibrate.calibrate(program, resolved)
    assert runs == [["linear", "alloc_cpu"]]
    calibrate.reset_cache()  # a new agent process
    calibrate.calibrate(program, resolved)
    assert runs == [["linear", "alloc_cpu"]]
    classes = calibrate.class_costs()
    assert classes.handlers == _measured().handlers and "this boot's measurement" in classes.note
