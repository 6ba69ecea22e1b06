"""The loader without bcc in the process: a program compiled in a child and cached, loaded with bpf(2),
attached with perf_event_open to a real process, counts exactly its calls; the cache hits, misses,
and recovers from a corrupt or a refused entry; detaching leaves nothing in the kernel."""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from llmobs.bpf import loader, perf
from llmobs.bpf.cache import Cache, cache_key
from llmobs.bpf.elfsym import open_elf
from llmobs.bpf.maps import BpfMap
from llmobs.errors import MissingLibrary
from test_uprobe_count import SYMBOL, Target, bpftool_json, our_perf_uprobes, target_binary, targets  # noqa: F401

# Calls per process in a hash, and a tracepoint program beside it (so both program types load).
COUNTER = r"""
BPF_HASH(calls, u32, u64, 64);

int uprobe__on_target(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 zero = 0, *count = calls.lookup_or_try_init(&tgid, &zero);
    if (count)
        __sync_fetch_and_add(count, 1);
    return 0;
}

int tracepoint_noop(void *args)
{
    return 0;
}
"""


def _counts(loaded) -> dict[int, int]:
    table = BpfMap(loaded.map_fds["calls"], loaded.specs["calls"])
    return {
        int.from_bytes(key, "little"): int.from_bytes(table.lookup(key), "little")
        for key in table.iter_keys()
    }


def _offset(binary: Path) -> int:
    return open_elf(str(binary)).find(SYMBOL.decode()).file_offset


@pytest.fixture
def cache(tmp_path) -> Cache:
    return Cache(tmp_path / "bpf")


def test_a_loaded_uprobe_counts_exactly_the_calls_and_leaves_nothing(target_binary, targets, cache):  # noqa: F811
    if shutil.which("bpftool") is None:
        pytest.fail("bpftool is needed to see the probe from outside (apt-get install bpftool)")
    watched, other = targets(), targets()
    loaded, stats = loader.load(COUNTER, [], cache)
    try:
        assert not stats.cache_hit and stats.compile_s > 0
        link = perf.attach_uprobe(
            loaded.prog_fds["uprobe__on_target"], str(target_binary), _offset(target_binary), watched.pid
        )
        watched.call(1000)
        other.call(500)  # same file and function, another process: not counted
        assert _counts(loaded) == {watched.pid: 1000}
        attached = our_perf_uprobes(target_binary)
        assert len(attached) == 1, attached
        prog_ids = {entry["prog_id"] for entry in attached}
        perf.detach(link)
        assert our_perf_uprobes(target_binary) == []
        watched.call(10)  # detached: no longer counted
        assert _counts(loaded) == {watched.pid: 1000}
    finally:
        loaded.close()
    assert not prog_ids & {prog["id"] for prog in bpftool_json("prog", "show")}


def test_a_tracepoint_program_attaches_and_detaches(cache):
    loaded, _stats = loader.load(COUNTER, [], cache)
    try:
        link = perf.attach_tracepoint(loaded.prog_fds["tracepoint_noop"], "sched:sched_switch")
        ours = [e for e in bpftool_json("perf") if e.get("pid") == os.getpid() and e.get("fd") == link.fd]
        assert len(ours) == 1 and ours[0].get("tracepoint") == "sched_switch", ours
        perf.detach(link)
        assert not [e for e in bpftool_json("perf") if e.get("pid") == os.getpid()]
    finally:
        loaded.close()


def test_the_second_load_is_a_cache_hit_without_a_compile(cache):
    first, stats1 = loader.load(COUNTER, [], cache)
    first.close()
    second, stats2 = loader.load(COUNTER, [], cache)
    second.close()
    assert not stats1.cache_hit and stats2.cache_hit and stats2.compile_s == 0
    path = cache.path(cache_key(COUNTER, []))
    assert (
        stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(cache.directory.stat().st_mode) == 0o700
    )
    assert [p.name for p in cache.directory.iterdir()] == [path.name]
    other = COUNTER.replace("64);", "128);")
    assert cache_key(other, []) != cache_key(COUNTER, [])


def test_a_corrupt_entry_is_compiled_again(cache):
    loader.load(COUNTER, [], cache)[0].close()
    cache.path(cache_key(COUNTER, [])).write_text('{"format": 1, "truncated')
    loaded, stats = loader.load(COUNTER, [], cache)
    loaded.close()
    assert not stats.cache_hit and stats.compile_s > 0
    assert cache.read(cache_key(COUNTER, [])) is not None


def test_an_entry_the_verifier_refuses_is_removed_and_compiled_again(cache):
    loader.load(COUNTER, [], cache)[0].close()
    path = cache.path(cache_key(COUNTER, []))
    data = json.loads(path.read_text())
    data["functions"]["tracepoint_noop"]["insns"] = base64.b64encode(
        bytes.fromhex("9500000000000000")
    ).decode()
    path.write_text(json.dumps(data))  # well-formed, but `exit` with r0 unset: the verifier says no
    loaded, stats = loader.load(COUNTER, [], cache)
    loaded.close()
    assert stats.cache_hit and stats.recompiled and stats.compile_s > 0
    assert (
        json.loads(path.read_text())["functions"]["tracepoint_noop"]["insns"]
        != data["functions"]["tracepoint_noop"]["insns"]
    )


def test_a_compile_error_is_one_line_naming_the_compiler(cache):
    with pytest.raises(MissingLibrary) as caught:
        loader.load("int broken(struct pt_regs *ctx) { return undefined_thing; }", [], cache)
    message = str(caught.value)
    assert message.startswith("cannot compile the BPF program") and "\n" not in message
    assert caught.value.hint


def test_the_agent_side_never_imports_bcc():
    """Loading from the cache, attaching and reading maps: none of it imports bcc (libbcc is ~60 MB)."""
    code = (
        "import sys; from llmobs.bpf import program, session, aggregates, calibrate, loader, perf, maps;"
        " from llmobs.daemon import fleet; from llmobs.commands import attach;"
        " assert 'bcc' not in sys.modules, 'bcc imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_reset_after_own_calibration_zeroes_its_slots_and_after_a_target_everything():
    """reset_maps after only this process was a target (calibration) zeroes its threads' start slots,
    the counters and the hashes - not the 131 k start slots; after any other target, every map."""
    import threading

    from llmobs.bpf.profiles import probes_of
    from llmobs.bpf.program import ProbeProgram, start_slot

    program = ProbeProgram(probes_of(("cpu",)))
    try:
        starts, counters = program.maps["llmobs_call_start"], program.maps["llmobs_counters"]
        dirty = b"\x07" * starts.value_bytes

        def slot(index: int) -> bytes:
            return starts.lookup(index.to_bytes(4, "little"))

        own, elsewhere = (
            start_slot(threading.get_native_id(), 3),
            start_slot(threading.get_native_id() + 1, 3),
        )
        program.set_target(os.getpid(), 0)  # as calibration does, from this thread
        for index in (own, elsewhere):
            starts.update(index.to_bytes(4, "little"), dirty)
        counters.update(bytes(4), b"\x05" * counters.value_bytes)
        program.remove_target(os.getpid())
        program.reset_maps()
        assert slot(own) == bytes(starts.value_bytes)  # the calibrating thread's slot: zeroed
        assert slot(elsewhere) == dirty  # no other thread was a target: left as it was
        assert program.counters()[0] == 0

        program.set_target(os.getpid() + 1, 0)  # a real target (another process): everything is reset
        program.reset_maps()
        assert slot(elsewhere) == bytes(starts.value_bytes)
        assert program.targets() == {}
        program.reset_maps()  # nothing dirty since: a no-op
    finally:
        program.close()
