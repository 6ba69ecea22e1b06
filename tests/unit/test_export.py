"""`llmobs-agent export`: Parquet (one file per table, same rows) and Perfetto (Chrome trace JSON)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from llmobs.cli import main
from llmobs.clock import WallClock
from llmobs.errors import ExitCode
from llmobs.pipeline.correlate import correlate
from llmobs.store import DuckDBStore, schema, synthetic
from llmobs.store.perfetto import PROBE_TRACK_BASE, REQUEST_TRACK_BASE

from tests.unit.interleaved_steps import REQUESTS as INTERLEAVED
from tests.unit.interleaved_steps import interleaved_steps


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("e") / "e.duckdb"
    steps = synthetic.token_steps(pid=77, requests=3, tokens_per_request=4, seed=1)
    loss = steps["loss"].to_numpy().copy()
    loss[0] = np.nan  # a step without a target: must come out as null, JSON has no NaN
    steps = steps.set_column(steps.schema.get_field_index("loss"), "loss", pa.array(loss))
    with DuckDBStore(path) as store:
        assert store.export({"token_steps": steps, "events": synthetic.events_for_steps(steps, seed=2)}).ok
        store.upsert_process(77, 1, exe="/usr/bin/python3")
        store.record_clock_fit("realtime", WallClock.measure(8))
        correlate(store.connection)
    return path


def test_parquet_has_one_file_per_table_with_every_row(db, tmp_path, capsys):
    out = tmp_path / "pq"
    assert main(["export", "--db", str(db), "--parquet", str(out)]) == 0
    _, err = capsys.readouterr()
    assert "token_steps" in err  # progress lines name each table
    expected = {"schema_migrations", *schema.TIME_COLUMN}
    assert {p.stem for p in out.glob("*.parquet")} == expected
    with DuckDBStore(db, read_only=True) as store:
        for table in expected - {"schema_migrations"}:
            assert pq.read_table(out / f"{table}.parquet").num_rows == store.count(table), table
        original = store.query("SELECT * FROM token_steps ORDER BY trace_id, step")
    exported = pq.read_table(out / "token_steps.parquet").sort_by(
        [("trace_id", "ascending"), ("step", "ascending")]
    )
    assert exported["token_id"].to_pylist() == original["token_id"].to_pylist()


def _load(path):
    trace = json.loads(path.read_text())
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"}
    for event in trace["traceEvents"]:
        assert {"ph", "pid", "name"} <= set(event)
        if event["ph"] != "M":
            assert isinstance(event["ts"], float | int)
        if event["ph"] == "X":
            assert event["dur"] >= 0 and "tid" in event
    return trace


def test_perfetto_trace_has_request_probe_and_off_cpu_tracks(db, tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert main(["export", "--db", str(db), "--perfetto", str(path)]) == 0
    trace = _load(path)
    events = trace["traceEvents"]
    tokens = [e for e in events if e.get("cat") == "token"]
    assert len(tokens) == 12
    assert {e["tid"] for e in tokens} == {REQUEST_TRACK_BASE + i for i in range(3)}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert all(names[(77, REQUEST_TRACK_BASE + i)].startswith("request ") for i in range(3))
    process = [e for e in events if e["name"] == "process_name"]
    assert process == [
        {
            "ph": "M",
            "name": "process_name",
            "pid": 77,
            "tid": 0,
            "args": {"name": "/usr/bin/python3 (pid 77)"},
        }
    ]
    # A token slice spans its step exactly (microseconds) and carries its rollup.
    with DuckDBStore(db, read_only=True) as store:
        first = store.query("SELECT * FROM token_steps ORDER BY trace_id, step LIMIT 1").to_pylist()[0]
        per_probe = dict(
            store.connection.execute(
                "SELECT probe, count(*) FROM (SELECT probe FROM mem_events UNION ALL"
                " SELECT probe FROM host_events) GROUP BY probe"
            ).fetchall()
        )
        nan_start = store.connection.execute(
            "SELECT t_start_ns FROM token_steps WHERE isnan(loss)"
        ).fetchall()[0][0]
    slice0 = tokens[0]
    assert (
        slice0["ts"] == first["t_start_ns"] / 1000
        and slice0["dur"] == (first["t_end_ns"] - first["t_start_ns"]) / 1000
    )
    assert slice0["args"]["allocations"] == 6
    no_loss = [e for e in tokens if e["args"]["loss"] is None]
    assert len(no_loss) == 1 and no_loss[0]["ts"] == nan_start / 1000
    # Probe tracks: every sampled event except sched_switch, which becomes an off-CPU slice on its thread.
    by_name = Counter(e["name"] for e in events if e["ph"] != "M" and e.get("tid", 0) >= PROBE_TRACK_BASE)
    assert by_name == Counter({p: n for p, n in per_probe.items() if p != "sched_switch"})
    off_cpu = [e for e in events if e.get("cat") == "off-cpu"]
    assert len(off_cpu) == per_probe["sched_switch"] and all(e["tid"] in (77, 78) for e in off_cpu)
    assert all(e["dur"] == 30.0 for e in off_cpu)
    assert trace["otherData"]["clock"] == "CLOCK_MONOTONIC" and "realtime_offset_ns" in trace["otherData"]
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == 2 * 12


def test_perfetto_window_keeps_only_overlapping_steps_and_events(db, tmp_path):
    with DuckDBStore(db, read_only=True) as store:
        steps = store.query("SELECT t_start_ns, t_end_ns FROM token_steps ORDER BY t_start_ns").to_pylist()
    since, until = steps[3]["t_start_ns"], steps[6]["t_end_ns"]
    path = tmp_path / "window.json"
    assert (
        main(
            [
                "export",
                "--db",
                str(db),
                "--perfetto",
                str(path),
                "--since",
                str(since),
                "--until",
                str(until),
                "-q",
            ]
        )
        == 0
    )
    events = _load(path)["traceEvents"]
    tokens = [e for e in events if e.get("cat") == "token"]
    expected = [s for s in steps if s["t_end_ns"] >= since and s["t_start_ns"] <= until]
    assert len(tokens) == len(expected) == 4
    timed = [e for e in events if e["ph"] in ("i", "X") and e.get("cat") != "token"]
    assert timed and all(since / 1000 <= e["ts"] <= until / 1000 for e in timed)


def test_export_of_a_missing_store_is_a_store_error(tmp_path, capsys):
    missing = tmp_path / "none.duckdb"
    assert main(["export", "--db", str(missing), "--parquet", str(tmp_path / "p")]) == ExitCode.STORE_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"error: no store at {missing}") and err.count("error: ") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, error, hint",
    [
        ([], "nothing to export", "give --parquet DIR and/or --perfetto FILE"),
        (
            ["--parquet", "{tmp}/p", "--since", "5"],
            "--since/--until apply to --perfetto only",
            "add --perfetto FILE, or drop --since/--until",
        ),
        (
            ["--parquet", "{tmp}/p", "--until", "5"],
            "--since/--until apply to --perfetto only",
            "add --perfetto FILE, or drop --since/--until",
        ),
        (
            ["--perfetto", "{tmp}/t.json", "--since", "9", "--until", "5"],
            "--until 5 is before --since 9",
            "swap the two times",
        ),
    ],
)
def test_export_argument_mistakes_are_usage_errors(tmp_path, capsys, args, error, hint):
    """Exit 2 with one error and one hint line, said before the store is opened: the --db named here
    does not exist, so a store error (11) would mean the arguments were checked too late."""
    argv = ["export", "--db", str(tmp_path / "none.duckdb"), *(a.format(tmp=tmp_path) for a in args)]
    assert main(argv) == ExitCode.USAGE == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: {error}\nhint: {hint}\n"
    assert not (tmp_path / "p").exists() and not (tmp_path / "t.json").exists()


def test_perfetto_gives_each_interleaved_served_request_one_whole_track(tmp_path):
    """Served requests whose steps interleave across passes (one joining late): one track per request,
    holding every step of it in order, whichever row of each pass it was."""
    db = tmp_path / "i.duckdb"
    with DuckDBStore(db) as store:
        store.append({"token_steps": interleaved_steps(88)})
        correlate(store.connection)
    path = tmp_path / "interleaved.json"
    assert main(["export", "--db", str(db), "--perfetto", str(path), "-q"]) == 0
    events = _load(path)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    tracks: dict[int, list[tuple[int, int]]] = {}
    for e in events:
        if e.get("cat") == "token":
            tracks.setdefault(e["tid"], []).append((e["args"]["step"], e["args"]["step_seq"]))
    assert len(tracks) == len(INTERLEAVED)
    by_trace = {names[tid].split()[1]: steps for tid, steps in tracks.items()}
    for _, trace, tenant, passes in INTERLEAVED.values():
        assert by_trace[trace[:12]] == list(enumerate(passes)), trace
        assert any(n.startswith(f"request {trace[:12]} {tenant}/") for n in names.values())
