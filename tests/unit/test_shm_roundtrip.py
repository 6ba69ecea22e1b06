"""Writer and reader of the map in one process: layout, context cell, rings, names, control, errors."""

from __future__ import annotations

import math
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from llmobs.errors import AccessDenied, MalformedMap, NoSuchProcess, NotTracked
from llmobs.shm import layout
from llmobs.shm.control import ControlClient
from llmobs.shm.hashing import name_hash, trace_hex, trace_id, trace_words
from llmobs.shm.reader import ShmReader
from llmobs.shm.writer import ShmWriter, register_command_handler


@pytest.fixture
def writer(tmp_path):
    w = ShmWriter(shm_dir=str(tmp_path), names_capacity=8, steps_capacity=8, cupti_capacity=4, model_id="m1")
    yield w
    w.close()


def _publish(w: ShmWriter, n: int, step: int, *, seq: int | None = None, value: float = 1.0) -> None:
    block = torch.zeros((n, 7), dtype=torch.float32)
    block[:, 0] = value
    ints = torch.tensor([[3, 7, 7]] * n, dtype=torch.int32)
    block[:, 4:] = ints.view(torch.float32)
    w.publish_steps(
        block, step_seq=seq or w.begin_step(1, 2, 3, 4), t_start=10, t_end=25, trace_hi=[0xAB] * n,
        trace_lo=[0xCD] * n, tenant_hash=0, session_hash=0, model_hash=0, step=step,
        position=np.arange(n) + 100, batch_row=np.arange(n), kv_len=5, flags=layout.FLAG_HAS_TARGET,
    )  # fmt: skip


def test_file_header_and_permissions(writer, tmp_path):
    st = os.stat(writer.path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert writer.path == str(tmp_path / f"llmobs.{os.getpid()}")
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        h = r.header
        assert (
            h["magic"] == layout.MAGIC
            and h["abi_version"] == layout.ABI_VERSION
            and h["layout_size"] == st.st_size
        )
        assert h["writer_pid"] == os.getpid() and h["state"] == layout.STATE_LIVE
        assert h["steps_capacity"] == 8 and h["clock_id"] == layout.CLOCK_MONOTONIC
        r.read_names()
        assert r.name(h["model_hash"]) == "m1"
    writer.close()
    assert not os.path.exists(writer.path)


def test_context_cell_seqlock_and_untracked(writer, tmp_path):
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        assert r.context()["step_seq"] == 0
        seq = writer.begin_step(0x0102030405060708, 0x1112131415161718, name_hash("t"), name_hash("s"))
        ctx = r.context()
        assert seq == 1 and ctx["step_seq"] == 1 and ctx["seq"] % 2 == 0
        assert ctx["trace_id"] == "01020304050607081112131415161718"
        assert ctx["tenant_hash"] == name_hash("t")
        with open(writer.path, "rb") as f:
            raw = f.read()
        assert int.from_bytes(raw[layout.CTX_OFFSET + 24 : layout.CTX_OFFSET + 32], "little") == 1
        writer.clear_context()
        after = r.context()
        assert after["step_seq"] == 0 and after["seq"] > ctx["seq"]
        assert writer.begin_step(1, 1, 0, 0) == 2


def test_steps_roundtrip_small_and_large_batches(writer, tmp_path):
    _publish(writer, 2, step=0, value=1.5)
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        b = r.read_steps(0)
        assert (len(b), b.lost, b.corrupt, b.next_cursor) == (2, 0, 0, 2)
        row = b.rows()[1]
        assert (
            row["loss"] == 1.5 and row["target_rank"] == 3 and row["token_id"] == 7 and row["target_id"] == 7
        )
        assert row["position"] == 101 and row["batch_row"] == 1 and row["kv_len"] == 5
        assert row["latency_ns"] == 15 and row["trace_id"] == trace_hex(0xAB, 0xCD)
        assert row["model_id"] == "" and row["pid"] == os.getpid()
        _publish(writer, 5, step=1)  # > SMALL_BATCH? no: exercise the wrap with the numpy path below
        _publish(
            writer, 9, step=2
        )  # larger than the ring (8): chunked, the reader loses what was overwritten
        b2 = r.read_steps(b.next_cursor)
        assert b2.lost + len(b2) == 14 and len(b2) == 8 and b2.corrupt == 0
        assert b2.next_cursor == 16


def test_lapped_reader_counts_exact_losses(writer, tmp_path):
    for i in range(20):
        _publish(writer, 1, step=i, value=float(i))
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        b = r.read_steps(0)
        assert b.lost == 12 and len(b) == 8 and b.corrupt == 0
        assert list(b.columns["loss"]) == [float(i) for i in range(12, 20)]
        assert list(b.columns["step"]) == list(range(12, 20))


def test_record_being_written_stops_the_reader(writer, tmp_path):
    _publish(writer, 1, step=0)
    pos = writer.steps_head
    _publish(writer, 1, step=1)
    writer.steps["seq"][pos] = 2 * pos + 1  # as if the writer were between its two sequence writes
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        b = r.read_steps(0)
        assert len(b) == 1 and b.next_cursor == pos
        writer.steps["seq"][pos] = 2 * pos + 2
        b = r.read_steps(b.next_cursor)
        assert len(b) == 1 and b.next_cursor == pos + 1


def test_pending_device_copies_commit_in_order_without_blocking(writer, tmp_path):
    """The CUDA path's commit logic (the copy itself needs a GPU: tests/gpu covers it)."""

    class Event:
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    _publish(writer, 1, step=0)
    pos = writer.steps_head
    _publish(writer, 1, step=1)
    _publish(writer, 1, step=2)
    writer.steps["seq"][pos : pos + 2] = [2 * pos + 1, 2 * pos + 3]  # as left by the CUDA path until done
    first, second = Event(), Event()
    writer._pending.extend([(first, pos, 1), (second, pos + 1, 1)])
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        assert writer.poll_pending() == 0 and len(r.read_steps(0)) == 1
        second.done = True
        assert writer.poll_pending() == 0  # the older copy is not done: nothing may commit out of order
        first.done = True
        assert writer.poll_pending() == 2 and len(r.read_steps(0)) == 3
        pos = writer.steps_head
        _publish(writer, 1, step=3)
        writer.steps["seq"][pos] = 2 * pos + 1
        writer._pending.append((Event(), pos, 1))
        assert writer.poll_pending() == 0
        assert writer.poll_pending(wait=True) == 1 and len(r.read_steps(0)) == 4  # end of request / exit


def test_names_are_published_once_and_truncated_at_a_char_boundary(writer, tmp_path):
    long = "é" * 100  # 200 utf-8 bytes
    h = writer.name(layout.NAME_SESSION, long)
    assert writer.name(layout.NAME_SESSION, long) == h and writer.names_head == 2  # m1 + this one
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        r.read_names()
        assert r.names[h] == "é" * 52 and h == name_hash(long)
    for i in range(10):  # overflow the 8-record names ring: a name overwritten is published again
        writer.name(layout.NAME_OTHER, f"n{i}")
    assert writer.name(layout.NAME_SESSION, long) == h and writer.names_head == 13


def test_control_block_commands_are_acknowledged(writer, tmp_path):
    with ControlClient(os.getpid(), shm_dir=str(tmp_path)) as c:
        seq = c.post(layout.CMD_PING)
        assert c.ack()["ack_seq"] == 0  # nothing happens until the workload's next step
        writer.begin_step(1, 1, 0, 0)
        ack = c.ack()
        assert ack["ack_seq"] == seq and ack["ack_status"] == layout.ACK_OK and ack["ack_pid"] == os.getpid()
        seq = c.post(layout.CMD_COLLECT_CUPTI, 3)
        writer.begin_step(1, 1, 0, 0)
        expected = layout.ACK_UNSUPPORTED if torch.cuda.is_available() else layout.ACK_NO_GPU
        assert c.ack()["ack_seq"] == seq and c.ack()["ack_status"] == expected
        seq = c.post(77)
        writer.begin_step(1, 1, 0, 0)
        assert c.ack()["ack_status"] == layout.ACK_UNKNOWN_COMMAND

        calls = []
        register_command_handler(
            layout.CMD_COLLECT_CUPTI, lambda w, n: (layout.ACK_OK, lambda: calls.append(n))
        )
        try:
            seq = c.post(layout.CMD_COLLECT_CUPTI, 2)
            start = writer.begin_step(1, 1, 0, 0)
            ack = c.ack()
            assert (
                ack["ack_status"] == layout.ACK_OK
                and ack["ack_step_seq"] == start
                and ack["done_step_seq"] == 0
            )
            writer.begin_step(1, 1, 0, 0)
            assert c.ack()["done_step_seq"] == 0
            writer.begin_step(1, 1, 0, 0)
            assert c.ack()["done_step_seq"] == start + 2 and calls == [2]
        finally:
            from llmobs.shm import writer as writer_module

            writer_module._command_handlers.pop(layout.CMD_COLLECT_CUPTI, None)
        c.advertise_tail(5)
        with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
            assert r.control()["reader_tail"] == 5 and r.control()["reader_pid"] == os.getpid()


def test_trace_id_is_the_documented_hash():
    import hashlib

    ids = [1, 2, 300, -5]
    expected = hashlib.sha256(np.array(ids, dtype="<i8").tobytes()).digest()[:16]
    assert trace_id(ids) == expected == trace_id(torch.tensor(ids))
    hi, lo = trace_words(expected)
    assert trace_hex(hi, lo) == expected.hex()


# --- errors: one clear exception each -----------------------------------------------------------------
def test_missing_process_and_untracked_process(tmp_path):
    with pytest.raises(NoSuchProcess, match="no process"):
        ShmReader(2**22 + 12345, shm_dir=str(tmp_path))
    with pytest.raises(NotTracked, match="publishes no llmobs map"):
        ShmReader(os.getpid(), shm_dir=str(tmp_path))


def test_stale_map_of_a_dead_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(proc.stdout)
    (tmp_path / f"llmobs.{dead}").write_bytes(b"x")
    with pytest.raises(NoSuchProcess, match="stale map"):
        ShmReader(dead, shm_dir=str(tmp_path))


def test_stale_map_of_a_reused_pid(writer, tmp_path):
    start = writer.mm[40:48]
    writer.mm[40:48] = (int.from_bytes(start, "little") + 1).to_bytes(8, "little")
    with pytest.raises(NotTracked, match="stale"):
        ShmReader(os.getpid(), shm_dir=str(tmp_path))


def test_wrong_mode_owner_and_symlink(writer, tmp_path):
    os.chmod(writer.path, 0o644)
    with pytest.raises(MalformedMap, match="mode 0644"):
        ShmReader(os.getpid(), shm_dir=str(tmp_path))
    os.chmod(writer.path, 0o600)
    if os.getuid() == 0:
        os.chown(writer.path, 54321, -1)
        with pytest.raises(MalformedMap, match="owned by uid 54321"):
            ShmReader(os.getpid(), shm_dir=str(tmp_path))
        os.chown(writer.path, 0, -1)
    os.rename(writer.path, writer.path + ".real")
    os.symlink(writer.path + ".real", writer.path)
    with pytest.raises(MalformedMap, match="symbolic link"):
        ShmReader(os.getpid(), shm_dir=str(tmp_path))
    os.unlink(writer.path)
    os.rename(writer.path + ".real", writer.path)


def test_truncated_under_the_reader_is_a_clear_error_not_sigbus(writer, tmp_path):
    _publish(writer, 3, step=0)
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        os.truncate(writer.path, 1024)  # the rings are now beyond EOF
        with pytest.raises(MalformedMap, match="shrank"):
            r.read_steps(0)
    os.truncate(writer.path, writer.size)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a reader as another user")
def test_access_denied_for_another_user(writer, tmp_path):
    os.chmod(tmp_path, 0o755)
    rfd, wfd = os.pipe()
    child = os.fork()
    if child == 0:  # the reader as user `nobody`: it may see the file but not open it
        try:
            os.setuid(65534)
            ShmReader(os.getppid(), shm_dir=str(tmp_path))
            os.write(wfd, b"OPENED")
        except AccessDenied as exc:
            os.write(wfd, f"DENIED {exc}".encode())
        except BaseException as exc:
            os.write(wfd, f"OTHER {exc!r}".encode())
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        result = f.read().decode()
    os.waitpid(child, 0)
    assert result.startswith("DENIED cannot read"), result


def test_nan_loss_without_target_roundtrips(writer, tmp_path):
    block = torch.zeros((1, 7))
    block[0, 0] = float("nan")
    block[0, 4:] = torch.tensor([[-1, 9, -1]], dtype=torch.int32).view(torch.float32)
    writer.publish_steps(block, step_seq=writer.begin_step(0, 0, 0, 0), t_start=1, t_end=1, trace_hi=[0],
                         trace_lo=[0], tenant_hash=0, session_hash=0, model_hash=0, step=0, position=[0],
                         batch_row=[0], kv_len=-1, flags=0)  # fmt: skip
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        row = r.read_steps(0).rows()[0]
        assert math.isnan(row["loss"]) and row["target_id"] == -1 and row["target_rank"] == -1


def test_stale_maps_are_found_and_removed(writer, tmp_path):
    from llmobs.shm.reader import remove_stale_maps, stale_maps

    code = "import os; print(os.getpid())"
    dead = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    (tmp_path / f"llmobs.{dead}").write_bytes(b"x")  # a process that is gone
    (tmp_path / "llmobs.notapid").write_bytes(b"x")  # not ours to judge
    assert stale_maps(str(tmp_path)) == [str(tmp_path / f"llmobs.{dead}")]  # our own live map is not stale
    start = writer.mm[40:48]
    writer.mm[40:48] = (int.from_bytes(start, "little") + 1).to_bytes(8, "little")  # as if the pid was reused
    assert sorted(remove_stale_maps(str(tmp_path))) == sorted([writer.path, str(tmp_path / f"llmobs.{dead}")])
    assert sorted(os.listdir(tmp_path)) == ["llmobs.notapid"]
