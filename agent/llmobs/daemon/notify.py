"""sd_notify without a dependency: datagrams to $NOTIFY_SOCKET (READY=1, WATCHDOG=1, STATUS=, STOPPING=1).

The protocol is one AF_UNIX datagram of newline-separated KEY=VALUE lines; a socket name starting with
'@' is in the abstract namespace (a leading NUL byte). systemd sets $NOTIFY_SOCKET for Type=notify
units, and $WATCHDOG_USEC (and $WATCHDOG_PID) when WatchdogSec= is set; the service must then send
WATCHDOG=1 more often than that, conventionally every half of it. Outside systemd nothing is set and
every call is a no-op. A failed send is counted, never raised, and a send never waits: the daemon must
neither die nor stall for its supervisor's sake.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = None
        if address.startswith("@"):
            self.address = b"\0" + address[1:].encode()
        elif address.startswith("/"):
            self.address = address
        self.watchdog_s = _watchdog_period(env)
        self.sent = 0
        self.failed = 0
        self.last_error: str | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """One datagram with these KEY=VALUE lines; False (counted) when it could not be sent."""
        if self.address is None:
            return False
        payload = "\n".join(line.replace("\n", " ") for line in lines).encode()
        try:
            # non-blocking: a supervisor that stops reading fills the socket's queue (10 datagrams by
            # default), and a blocking send would then freeze the drain loop
            flags = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
            with socket.socket(socket.AF_UNIX, flags) as sock:
                sock.sendto(payload, self.address)
        except OSError as exc:
            self.failed += 1
            self.last_error = str(exc)
            return False
        self.sent += 1
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def reloading(self) -> bool:
        return self.send("RELOADING=1", "STATUS=reloading the configuration")

    def stopping(self, status: str = "draining: final harvest and commit") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")


def _watchdog_period(env: Mapping[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when no watchdog is asked
    for this process (unset, malformed, or $WATCHDOG_PID names another process)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    watchdog_pid = env.get("WATCHDOG_PID", "")
    if usec <= 0 or (watchdog_pid and watchdog_pid != str(os.getpid())):
        return None
    return usec / 2e6
