"""sd_notify: real AF_UNIX datagram sockets bound by the test (a path and an abstract name)."""

from __future__ import annotations

import os
import socket
import uuid

import pytest
from llmobs.daemon.notify import Notifier


@pytest.fixture
def path_socket(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = str(tmp_path / "notify.sock")
    sock.bind(address)
    sock.settimeout(10)
    yield sock, address
    sock.close()


def receive(sock) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_status_watchdog_stopping_on_a_path_socket(path_socket):
    sock, address = path_socket
    notifier = Notifier({"NOTIFY_SOCKET": address})
    assert notifier.enabled
    assert notifier.ready("2 target(s)")
    assert receive(sock) == ["READY=1", "STATUS=2 target(s)", f"MAINPID={os.getpid()}"]
    assert notifier.watchdog()
    assert receive(sock) == ["WATCHDOG=1"]
    assert notifier.status("line one\nline two")  # a newline would start a new KEY=VALUE
    assert receive(sock) == ["STATUS=line one line two"]
    assert notifier.stopping()
    assert receive(sock)[0] == "STOPPING=1"
    assert (notifier.sent, notifier.failed) == (4, 0)


def test_abstract_socket_name():
    name = f"llmobs-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(10)
        assert Notifier({"NOTIFY_SOCKET": f"@{name}"}).ready("up")
        assert receive(sock)[0] == "READY=1"


def test_no_socket_is_a_quiet_no_op():
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready("up") is False
    assert (notifier.sent, notifier.failed) == (0, 0)


def test_failed_send_is_counted_not_raised(tmp_path):
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert notifier.watchdog() is False
    assert notifier.failed == 1 and "No such file" in notifier.last_error


@pytest.mark.parametrize(
    ("env", "period"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({}, None),
    ],
)
def test_watchdog_period_is_half_of_watchdog_usec(env, period):
    assert Notifier(env).watchdog_s == period


def test_a_supervisor_that_stops_reading_never_blocks_the_sender(path_socket):
    sock, address = path_socket
    notifier = Notifier({"NOTIFY_SOCKET": address})
    results = [notifier.status(f"tick {i}") for i in range(200)]  # nobody reads: the queue fills
    assert results[0] is True and results[-1] is False
    assert notifier.failed > 0 and notifier.sent + notifier.failed == 200
    assert "Resource temporarily unavailable" in notifier.last_error
    assert receive(sock) == ["STATUS=tick 0"]  # what was queued is intact
