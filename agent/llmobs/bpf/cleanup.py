"""Removes uprobe events a killed agent may have left in tracefs.

On this kernel bcc creates uprobes through the perf `uprobe` PMU (perf_event_open): nothing is
written to tracefs, and the kernel drops the probe when the agent's fd closes, SIGKILL included.
On kernels without that PMU, bcc falls back to writing `p:<name>` lines to
/sys/kernel/tracing/uprobe_events, named `..._bcc_<agent pid>`; a SIGKILLed agent leaves those
behind (their BPF programs are gone, but the breakpoints stay). The next attach removes every such
entry whose agent pid is no longer alive.
"""

from __future__ import annotations

import os
import re

UPROBE_EVENTS = "/sys/kernel/tracing/uprobe_events"
# "p:uprobes/p__proc_12_root_usr_lib_libc10_so_0x91f10_bcc_4242 /path:0x..." -> (group/name, 4242)
_BCC_EVENT = re.compile(r"^[pr]:(\S+_bcc_(\d+))\s", re.M)


def stale_bcc_events(text: str, alive) -> list[str]:
    """Event names in uprobe_events text made by bcc for a pid that `alive(pid)` says is gone."""
    return [name for name, pid in _BCC_EVENT.findall(text) if not alive(int(pid))]


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def remove_stale_uprobes(path: str = UPROBE_EVENTS) -> list[str]:
    """Removes leftover bcc uprobe events of dead agents; returns their names (best effort)."""
    try:
        with open(path) as handle:
            stale = stale_bcc_events(handle.read(), _alive)
    except OSError:
        return []
    removed = []
    for name in stale:
        try:
            with open(path, "a") as handle:
                handle.write(f"-:{name}\n")
            removed.append(name)
        except OSError:
            continue  # still in use (a live perf event) or already gone
    return removed
