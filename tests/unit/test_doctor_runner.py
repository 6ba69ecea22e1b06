"""The doctor's runner and rendering: failures become rows, hung checks are cut off, the exit code
follows the CPU profile rows, and `--json` is a machine-readable list."""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

import pytest
from llmobs.commands import doctor
from llmobs.errors import ExitCode
from llmobs.hostcheck import CPU_PROFILE_CHECKS, Check, Context, Row, Status, cpu_profile_ok, run_checks
from llmobs.hostcheck.model import Finding
from llmobs.hostcheck.runner import default_checks, run_check


def ok(_ctx: Context) -> Finding:
    return Finding(Status.OK, "fine")


def boom(_ctx: Context) -> Finding:
    raise RuntimeError("the probe exploded")


def test_a_raising_check_is_a_missing_row_and_the_next_check_still_runs(tmp_path: Path) -> None:
    rows = run_checks(Context(root=tmp_path), [Check("a", "A", boom), Check("b", "B", ok)])
    assert [(r.check, r.status) for r in rows] == [("a", Status.MISSING), ("b", Status.OK)]
    assert "RuntimeError: the probe exploded" in rows[0].detail
    assert rows[0].hint


def test_a_hung_check_is_cut_off_at_its_timeout(tmp_path: Path) -> None:
    release = threading.Event()
    started = threading.Event()

    def hang(_ctx: Context) -> Finding:
        started.set()
        release.wait(30)  # stands for a kernel call that never returns
        return Finding(Status.OK, "too late")

    try:
        row = run_check(Context(root=tmp_path), Check("hang", "hang", hang, timeout_s=0.2))
    finally:
        release.set()
    assert started.is_set()
    assert row.status is Status.MISSING
    assert "no answer within 0.2 s" in row.detail
    assert row.elapsed_ms < 10_000


def test_stderr_from_a_failing_check_is_captured_into_its_row(tmp_path: Path, capfd) -> None:
    def noisy(_ctx: Context) -> Finding:
        # Written to the file descriptor, as bcc's C code does, not through sys.stderr.
        os.write(2, b"/virtual/main.c:3:1: error: unknown type name 'u64x'\n1 error generated.\n")
        return Finding(Status.MISSING, "compile failed", "fix it")

    row = run_check(Context(root=tmp_path), Check("noisy", "noisy", noisy))
    assert "[stderr: /virtual/main.c:3:1: error: unknown type name 'u64x']" in row.detail
    assert capfd.readouterr().err == ""


def test_closers_run_once_even_when_a_check_fails_and_a_closer_raises(tmp_path: Path) -> None:
    closed: list[str] = []

    def opens(ctx: Context) -> Finding:
        ctx.on_close(lambda: closed.append("first"))
        ctx.on_close(lambda: (_ for _ in ()).throw(OSError("already gone")))
        return Finding(Status.OK, "opened")

    run_checks(Context(root=tmp_path), [Check("opens", "opens", opens), Check("boom", "boom", boom)])
    assert closed == ["first"]


def rows_with(**statuses: Status) -> list[Row]:
    rows = [Row(cid, cid, Status.OK, "fine", required=True) for cid in CPU_PROFILE_CHECKS]
    rows += [Row("nvml", "NVML", Status.MISSING, "no driver", "install the NVIDIA driver")]
    return [
        Row(r.check, r.title, statuses.get(r.check, r.status), r.detail, r.hint, r.required) for r in rows
    ]


def test_cpu_profile_verdict() -> None:
    assert cpu_profile_ok(rows_with())
    assert cpu_profile_ok(rows_with(privileges=Status.DEGRADED))
    assert not cpu_profile_ok(rows_with(ringbuf=Status.MISSING))
    assert not cpu_profile_ok([r for r in rows_with() if r.check != "uprobe"])  # absent = not shown to work


@pytest.mark.parametrize(
    ("rows", "code"),
    [(rows_with(), ExitCode.OK), (rows_with(uprobe=Status.MISSING), ExitCode.HOST_UNSUPPORTED)],
)
def test_exit_code_and_json(monkeypatch, capsys, rows: list[Row], code: int) -> None:
    monkeypatch.setattr(doctor, "run_checks", lambda **_: rows)
    assert doctor.run(argparse.Namespace(json=True)) == code
    printed = json.loads(capsys.readouterr().out)
    assert [r["check"] for r in printed] == [r.check for r in rows]
    assert {r["status"] for r in printed} <= {"OK", "MISSING", "DEGRADED"}
    assert set(printed[0]) == {
        "check",
        "title",
        "status",
        "detail",
        "hint",
        "required_for_cpu_profile",
        "elapsed_ms",
    }


def test_table_shows_hints_only_for_rows_that_need_action() -> None:
    table = doctor.render_table(rows_with(tracepoint=Status.MISSING))
    lines = table.splitlines()
    nvml = next(i for i, line in enumerate(lines) if line.startswith("NVML"))
    assert "MISSING" in lines[nvml] and "no driver" in lines[nvml]
    assert lines[nvml + 1].strip() == "-> install the NVIDIA driver"
    assert sum("->" in line for line in lines) == 1  # the OK rows and the hint-less MISSING row have none
    assert "cannot run the agent's CPU probe profile (missing: tracepoint)" in table
    assert "CPU probe profile can run" in doctor.render_table(rows_with())


def test_every_default_check_on_an_unprivileged_fake_host_is_a_row(tmp_path: Path) -> None:
    """Not root: the privileged rows say MISSING with `run as root`, nothing crashes, and the GPU rows
    are not tried (a fake root cannot load libraries)."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/status").write_text(
        "Uid:\t65534\t65534\t65534\t65534\nCapEff:\t0000000000000000\n"
    )
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.18.0\n")
    (tmp_path / "proc/mounts").write_text("")
    rows = run_checks(Context(root=tmp_path))
    assert [r.check for r in rows] == [c.check for c in default_checks()]
    by_id = {r.check: r for r in rows}
    for cid in CPU_PROFILE_CHECKS:
        assert by_id[cid].status is Status.MISSING, by_id[cid]
        assert "run as root" in by_id[cid].hint, by_id[cid]
    assert not cpu_profile_ok(rows)
    assert all("check failed" not in r.detail for r in rows), [r.detail for r in rows]
