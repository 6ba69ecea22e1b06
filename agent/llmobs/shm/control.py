"""Agent side of the control block: post a command to a workload, read its acknowledgement, and
advertise how far the agent has read (reader_tail) so lag is visible to both sides.

Writes go through pwrite on the map file (never an mmap, see reader.py); the workload handles a
command at the start of its next token step and acknowledges with ack_seq == cmd_seq.
"""

from __future__ import annotations

import os
import struct
import time

from llmobs.errors import AccessDenied, NotTracked
from llmobs.shm import layout
from llmobs.shm.writer import map_path

_C = layout.CONTROL.offsets
_U64 = struct.Struct("<Q")


class ControlClient:
    def __init__(self, pid: int, shm_dir: str = layout.SHM_DIR):
        self.pid = pid
        self.path = map_path(pid, shm_dir)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotTracked(f"process {pid} publishes no llmobs map ({self.path} does not exist)") from None
        except PermissionError:
            raise AccessDenied(f"cannot open {self.path} for writing commands: permission denied") from None
        self.base = layout.CONTROL_OFFSET

    def _read_u64(self, field: str) -> int:
        return _U64.unpack(os.pread(self.fd, 8, self.base + _C[field]))[0]

    def post(self, cmd: int, arg: int = 0) -> int:
        """Write a command (cmd and arg first, cmd_seq last); returns its cmd_seq."""
        seq = max(self._read_u64("cmd_seq"), self._read_u64("ack_seq")) + 1
        os.pwrite(self.fd, struct.pack("<IIQ", cmd, 0, arg), self.base + _C["cmd"])
        os.pwrite(self.fd, _U64.pack(seq), self.base + _C["cmd_seq"])
        return seq

    def ack(self) -> dict:
        raw = os.pread(self.fd, layout.CONTROL.size, self.base)
        values = struct.unpack_from("<QIIQQIIQQ", raw)
        keys = ("cmd_seq", "cmd", "cmd_flags", "cmd_arg", "ack_seq", "ack_status", "ack_pid", "ack_step_seq",
                "done_step_seq")  # fmt: skip
        return dict(zip(keys, values, strict=True))

    def wait_ack(self, seq: int, timeout: float = 5.0) -> dict | None:
        """Poll (the agent may wait; the workload never does) until the workload acknowledges `seq`."""
        deadline = time.monotonic() + timeout
        while True:
            ack = self.ack()
            if ack["ack_seq"] >= seq:
                return ack
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)

    def advertise_tail(self, tail: int) -> None:
        """Tell the workload (and `inspect`) the next token-step position this reader will read."""
        write_reader_tail(self.fd, tail)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_reader_tail(fd: int, tail: int) -> None:
    """Store (reader_pid, reader_tail, reader_heartbeat_ns) into the map open at `fd`: one pwrite, which
    the workload never waits on. At exit it removes its map only once reader_tail reached steps_head."""
    os.pwrite(
        fd,
        struct.pack("<QQQ", os.getpid(), tail, time.monotonic_ns()),
        layout.CONTROL_OFFSET + _C["reader_pid"],
    )
