"""Which tracefs uprobe events count as left behind by a dead agent."""

from __future__ import annotations

from llmobs.bpf.cleanup import stale_bcc_events

EVENTS = """\
p:uprobes/p__proc_9_root_lib_libc10_so_0x91f10_bcc_4242 /proc/9/root/lib/libc10.so:0x0000000000091f10
r:uprobes/r__proc_9_root_lib_libc10_so_0x91f10_bcc_4242 /proc/9/root/lib/libc10.so:0x0000000000091f10
p:uprobes/p__usr_lib_libcuda_so_0x1000_bcc_777 /usr/lib/libcuda.so:0x0000000000001000
p:probe_libc/malloc /usr/lib/x86_64-linux-gnu/libc.so.6:0x00000000000a0b10
"""


def test_only_dead_bcc_agents_are_stale():
    stale = stale_bcc_events(EVENTS, alive=lambda pid: pid == 777)
    assert stale == [
        "uprobes/p__proc_9_root_lib_libc10_so_0x91f10_bcc_4242",
        "uprobes/r__proc_9_root_lib_libc10_so_0x91f10_bcc_4242",
    ]
    assert stale_bcc_events(EVENTS, alive=lambda pid: True) == []
    assert stale_bcc_events("", alive=lambda pid: False) == []
