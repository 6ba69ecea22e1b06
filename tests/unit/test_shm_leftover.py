"""Maps left at exit (issue 13, item 6): the writer keeps its map at exit only while an agent on the host
has not read every token step (llmobs.shm.leftover, bounded), and the agent reads such a map once, by
path, then removes it (ShmSource.drain for its target, ingest_stale_maps for the rest)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from llmobs.errors import MalformedMap, NotTracked
from llmobs.pipeline.leftovers import ingest_stale_maps
from llmobs.pipeline.sources import ShmSource
from llmobs.shm import layout, leftover
from llmobs.shm.control import ControlClient
from llmobs.shm.identity import ProcessIdentity
from llmobs.shm.presence import ReaderPresence, marker_path, reader_present
from llmobs.shm.reader import ShmReader
from llmobs.shm.writer import ShmWriter
from llmobs.store.sink import DuckDBStore

STEPS = 5
# An exited workload: publishes STEPS token steps after "go" and exits (its writer's atexit decides).
WORKLOAD = f"""
import sys, torch, llmobs
print("ready", flush=True)
sys.stdin.readline()
with llmobs.request(torch.tensor([[1, 2]]), tenant="left") as req:
    for i in range({STEPS}):
        req.begin_step()
        req.step(torch.arange(8, dtype=torch.float32).view(1, 8), torch.tensor([i]))
"""


def _publish(w: ShmWriter, n: int) -> None:
    for _ in range(n):
        block = torch.zeros((1, 7), dtype=torch.float32)
        w.publish_steps(
            block, step_seq=w.begin_step(1, 2, 0, 0), t_start=10, t_end=20, trace_hi=[1], trace_lo=[2],
            tenant_hash=0, session_hash=0, model_hash=0, step=0, position=[0], batch_row=[0], kv_len=-1,
            flags=0,
        )  # fmt: skip


@pytest.fixture
def presence(tmp_path):
    with ReaderPresence.announce(str(tmp_path)) as p:
        yield p


def _never_a_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1  # above pid_max: no process can have it


# --- the workload side ------------------------------------------------------------------------------
def test_the_map_stays_while_a_present_agent_has_not_read_every_step(tmp_path, presence):
    w = ShmWriter(shm_dir=str(tmp_path), steps_capacity=8)
    _publish(w, 3)
    with ControlClient(os.getpid(), str(tmp_path)) as control:
        control.advertise_tail(2)  # one step unread
    w.close()
    assert os.path.exists(w.path)
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        assert r.header["state"] == layout.STATE_CLOSED and r.header["steps_head"] == 3


def test_the_map_goes_once_the_reader_caught_up(tmp_path, presence):
    w = ShmWriter(shm_dir=str(tmp_path), steps_capacity=8)
    _publish(w, 3)
    source = ShmSource(os.getpid(), str(tmp_path))
    assert len(source.poll()["step"]) == 3  # the poll advertises its cursor in the control block
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        assert r.control()["reader_tail"] == 3 and r.control()["reader_pid"] == os.getpid()
    w.close()
    assert not os.path.exists(w.path)
    source.close()


def test_a_viewer_does_not_advertise(tmp_path, presence):
    w = ShmWriter(shm_dir=str(tmp_path), steps_capacity=8)
    _publish(w, 3)
    viewer = ShmSource(os.getpid(), str(tmp_path), advertise=False)  # `top`: it stores nothing
    assert len(viewer.poll()["step"]) == 3
    w.close()
    assert os.path.exists(w.path)  # still there for an agent that stores
    viewer.close()


def test_the_map_goes_when_no_agent_is_present_or_nothing_was_published(tmp_path):
    lonely = ShmWriter(shm_dir=str(tmp_path), steps_capacity=8)
    _publish(lonely, 3)
    lonely.close()  # steps unread, but no agent would ever read them
    assert not os.path.exists(lonely.path)
    with ReaderPresence.announce(str(tmp_path)):
        empty = ShmWriter(shm_dir=str(tmp_path), steps_capacity=8)
        empty.close()  # an agent is there, but there is nothing to read
        assert not os.path.exists(empty.path)


def test_a_dead_agents_marker_or_another_users_is_no_presence(tmp_path):
    marker = marker_path(_never_a_pid(), str(tmp_path))
    with open(marker, "w") as f:
        f.write("12345\n")  # an agent that was SIGKILLed: its pid is gone
    assert not reader_present(str(tmp_path))
    live = marker_path(os.getpid(), str(tmp_path))
    with open(live, "w") as f:
        f.write("1\n")  # our pid, but not our start time: a reused pid
    assert not reader_present(str(tmp_path))
    with ReaderPresence.announce(str(tmp_path)) as p:  # cleans the dead one, writes ours
        assert reader_present(str(tmp_path)) and not os.path.exists(marker)
        os.chown(p.path, 12345, 12345)  # owned by neither root nor us: not trusted
        assert not reader_present(str(tmp_path))
    assert not os.path.exists(live)


@pytest.mark.parametrize("already_left", [leftover.MAX_LEFT_MAPS - 1, leftover.MAX_LEFT_MAPS])
def test_at_most_max_left_maps_stay(tmp_path, presence, already_left):
    first = _never_a_pid()
    for i in range(already_left):  # maps of exited processes, not yet swept
        (tmp_path / f"{layout.FILE_PREFIX}{first + i}").write_bytes(b"\0" * 4096)
    w = ShmWriter(shm_dir=str(tmp_path), steps_capacity=8)
    _publish(w, 1)
    w.close()
    assert os.path.exists(w.path) == (already_left < leftover.MAX_LEFT_MAPS)


def test_at_most_max_left_bytes_stay(tmp_path, presence, monkeypatch):
    w = ShmWriter(shm_dir=str(tmp_path), steps_capacity=8)
    _publish(w, 1)
    monkeypatch.setattr(leftover, "MAX_LEFT_BYTES", w.size - 1)  # this map alone would exceed the bound
    w.close()
    assert not os.path.exists(w.path)


# --- the agent side: an exited workload's map, read once and removed -----------------------------------
@pytest.fixture
def exited(tmp_path, presence):
    """(pid, identity seen while alive) of a workload that published STEPS steps and exited."""
    env = dict(os.environ, LLMOBS_SHM_DIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKLOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "ready"
    identity = ProcessIdentity.of(proc.pid)
    proc.stdin.write("go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / f"{layout.FILE_PREFIX}{proc.pid}").exists()  # left for us: nobody read it
    return proc.pid, identity


def test_drain_reads_an_exited_workloads_map_once_then_removes_it(tmp_path, exited):
    pid, identity = exited
    source = ShmSource(pid, str(tmp_path), identity=identity)
    steps = source.drain()
    assert steps is not None and list(steps["step"]) == list(range(STEPS))
    assert set(steps["tenant"]) == {"left"} and source.error is None
    assert source.removed_map == str(tmp_path / f"{layout.FILE_PREFIX}{pid}")
    assert not os.path.exists(source.removed_map)
    assert source.drain_layers() is None  # still readable through the descriptor after the unlink
    source.close()
    again = ShmSource(pid, str(tmp_path), identity=identity)
    assert again.drain() is None  # ingested once: nothing is left to read twice
    again.close()


def test_a_left_map_must_match_the_process_that_was_attached(tmp_path, exited):
    pid, identity = exited
    later = dataclasses.replace(identity, start_ticks=identity.start_ticks + 1)
    with pytest.raises(NotTracked, match="another process with pid"):
        ShmReader(pid, shm_dir=str(tmp_path), final_read=True, writer=later)
    other_user = dataclasses.replace(identity, uid=identity.uid + 1)
    with pytest.raises(MalformedMap, match="owned by uid"):
        ShmReader(pid, shm_dir=str(tmp_path), final_read=True, writer=other_user)
    source = ShmSource(pid, str(tmp_path), identity=later)
    assert source.drain() is None and "another process" in source.waiting  # said in the summary
    assert os.path.exists(tmp_path / f"{layout.FILE_PREFIX}{pid}")  # refused, so not removed either


def test_ingest_stale_maps_stores_the_steps_then_removes_the_map(tmp_path, exited):
    pid, _ = exited
    dead_junk = tmp_path / f"{layout.FILE_PREFIX}{_never_a_pid()}"
    dead_junk.write_bytes(b"x")  # a malformed map of a gone process: removed, as before
    store = DuckDBStore(tmp_path / "s.duckdb")
    try:
        handled = {left.pid: left for left in ingest_stale_maps(store, shm_dir=str(tmp_path))}
        assert handled[pid].steps == STEPS and handled[pid].error is None
        rows = store.query("SELECT step FROM token_steps WHERE pid = ? ORDER BY step", [pid])
        assert np.array_equal(rows.column(0).to_numpy(), np.arange(STEPS))
        assert not list(tmp_path.glob(f"{layout.FILE_PREFIX}*"))
        assert ingest_stale_maps(store, shm_dir=str(tmp_path)) == []  # once
    finally:
        store.shutdown(30)


def test_ingest_stale_maps_leaves_the_callers_own_targets(tmp_path, exited):
    pid, _ = exited
    store = DuckDBStore(tmp_path / "s.duckdb")
    try:
        assert ingest_stale_maps(store, skip_pids={pid}, shm_dir=str(tmp_path)) == []
        assert (tmp_path / f"{layout.FILE_PREFIX}{pid}").exists()
    finally:
        store.shutdown(30)


def test_a_map_whose_owner_the_selectors_would_not_observe_is_removed_unread(tmp_path, exited):
    pid, _ = exited
    store = DuckDBStore(tmp_path / "s.duckdb")
    try:
        owners: list[int] = []

        def nobody_selected(uid: int) -> bool:
            owners.append(uid)
            return False

        handled = {
            left.pid: left
            for left in ingest_stale_maps(store, shm_dir=str(tmp_path), accept_uid=nobody_selected)
        }
        assert owners == [os.getuid()]  # asked about the map file's owner
        assert handled[pid].steps == 0 and handled[pid].error.startswith("not selected")
        assert store.query("SELECT count(*) FROM token_steps").column(0)[0].as_py() == 0
        assert not list(tmp_path.glob(f"{layout.FILE_PREFIX}*"))  # removed all the same
    finally:
        store.shutdown(30)
