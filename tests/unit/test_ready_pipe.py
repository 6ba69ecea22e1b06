"""bench/ready_pipe.py, the one reader of a held target's --ready-fd status lines (HeldWorkload,
HeldServer and the tests that hold a workload themselves), on a real pipe."""

from __future__ import annotations

import os
import threading

import pytest

from bench.ready_pipe import read_json_line


@pytest.fixture
def pipe():
    read_fd, write_fd = os.pipe()
    fds = {"r": read_fd, "w": write_fd}
    yield fds
    for fd in fds.values():
        if fd >= 0:
            os.close(fd)


def _close_writer(fds: dict) -> None:
    os.close(fds["w"])
    fds["w"] = -1


def test_a_line_written_in_pieces_is_read_whole(pipe) -> None:
    os.write(pipe["w"], b'{"phase": "re')
    writer = threading.Timer(0.0, os.write, (pipe["w"], b'ady", "pid": 7}\n'))
    writer.start()
    assert read_json_line(pipe["r"], timeout=30) == {"phase": "ready", "pid": 7}
    writer.join()


def test_of_lines_that_arrive_together_the_last_is_returned(pipe) -> None:
    os.write(pipe["w"], b'{"phase": "ready"}\n{"phase": "done"}\n')
    assert read_json_line(pipe["r"], timeout=30) == {"phase": "done"}


def test_a_target_that_exits_first_fails_with_what_it_wrote(pipe) -> None:
    os.write(pipe["w"], b'{"phase"')
    _close_writer(pipe)
    with pytest.raises(
        AssertionError, match=r"^the server exited before it reported \(got b'\{\"phase\"'\)$"
    ):
        read_json_line(pipe["r"], timeout=30, who="the server")


def test_a_silent_target_fails_once_the_timeout_is_spent(pipe) -> None:
    with pytest.raises(AssertionError, match=r"^the workload did not report within 0\.05 s \(got b''\)$"):
        read_json_line(pipe["r"], timeout=0.05)
