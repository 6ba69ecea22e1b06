"""The compiled-program cache without a kernel: its key, its file format, corrupt and foreign entries."""

from __future__ import annotations

import os
import stat
import struct

import pytest
from llmobs.bpf.cache import Cache, Entry, Function, MapSpec, cache_key
from llmobs.bpf.compile import map_references, prog_type_of
from llmobs.errors import AccessDenied


def _entry(key: str) -> Entry:
    # r1 = map fd 7 (ld_imm64, src_reg 1), r0 = 0, exit
    insns = (
        struct.pack("<BBhi", 0x18, 0x11, 0, 7) + bytes(8) + bytes.fromhex("b7000000000000009500000000000000")
    )
    spec = MapSpec("llmobs_targets", 2, 4, 16, 4096, 0)
    return Entry(key, [spec], {"uprobe__x": Function("uprobe__x", 2, insns, ((0, 0),))}, "GPL", 0, 1.5)


def test_the_key_changes_with_the_source_and_the_cflags():
    base = cache_key("int x;", ["-I/a"])
    assert cache_key("int x;", ["-I/a"]) == base
    assert cache_key("int y;", ["-I/a"]) != base
    assert cache_key("int x;", ["-I/b"]) != base


def test_an_entry_round_trips_through_its_file(tmp_path):
    cache = Cache(tmp_path / "bpf")
    entry = _entry("k1")
    path = cache.write(entry)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    read = cache.read("k1")
    assert read is not None
    assert read.maps == entry.maps and read.functions == entry.functions and read.compile_s == 1.5
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # written through a rename


@pytest.mark.parametrize(
    "garbage", [b"", b"{not json", b'{"format": 1, "key": "k1"}', b'{"format": 999}', b"\x00\xff" * 50]
)
def test_a_corrupt_entry_reads_as_missing_and_is_removed(tmp_path, garbage):
    cache = Cache(tmp_path / "bpf")
    path = cache.write(_entry("k1"))
    path.write_bytes(garbage)
    assert cache.read("k1") is None
    assert not path.exists()


def test_an_entry_under_another_key_is_not_taken(tmp_path):
    cache = Cache(tmp_path / "bpf")
    path = cache.write(_entry("k1"))
    path.rename(cache.path("k2"))
    assert cache.read("k2") is None


def test_map_references_out_of_range_are_refused(tmp_path):
    cache = Cache(tmp_path / "bpf")
    entry = _entry("k1")
    fn = entry.functions["uprobe__x"]
    entry.functions["uprobe__x"] = Function(fn.name, fn.prog_type, fn.insns, ((0, 5),))  # no map 5
    cache.write(entry)
    assert cache.read("k1") is None


def test_a_directory_others_can_write_is_refused(tmp_path):
    directory = tmp_path / "bpf"
    cache = Cache(directory)
    cache.write(_entry("k1"))
    os.chmod(directory, 0o777)
    with pytest.raises(AccessDenied) as caught:
        cache.read("k1")
    assert "not private" in str(caught.value) and caught.value.hint


def test_map_references_are_found_in_ld_imm64_only():
    insns = (
        struct.pack("<BBhi", 0x18, 0x12, 0, 9) + bytes(8)  # map fd 9 -> map 1
        + struct.pack("<BBhi", 0xB7, 0x00, 0, 9)  # mov r0, 9: not a map reference
        + struct.pack("<BBhi", 0x18, 0x01, 0, 9) + bytes(8)  # a plain 64-bit constant
        + struct.pack("<BBhi", 0x18, 0x21, 0, 4) + bytes(8)  # map fd 4 -> map 0 (PSEUDO_MAP_VALUE)
    )  # fmt: skip
    assert map_references(insns, {4: 0, 9: 1}, "f") == ((0, 1), (5, 0))
    with pytest.raises(ValueError, match="fd 9"):
        map_references(insns, {4: 0}, "f")


def test_program_types_follow_the_function_names():
    assert prog_type_of("tracepoint_sched_switch") == 5
    assert prog_type_of("uprobe__linear") == prog_type_of("uretprobe__sgemm") == 2


def test_eviction_removes_unused_and_least_recently_used_entries(tmp_path, monkeypatch):
    import time

    from llmobs.bpf import cache as cache_module

    monkeypatch.setattr(cache_module, "MAX_ENTRIES", 3)
    cache = Cache(tmp_path / "bpf")
    now = time.time()
    ages = {"old": cache_module.MAX_UNUSED_S + 60, "a": 300, "b": 200, "c": 100}
    for key, age in ages.items():
        os.utime(cache.write(_entry(key)), (now - age, now - age))
    stale_tmp = cache.directory / ".deadbeef.x.tmp"
    stale_tmp.write_text("half an entry")
    os.utime(stale_tmp, (now - cache_module.STALE_TMP_S - 1,) * 2)
    assert cache.read("a") is not None  # a read is a use: "a" becomes the most recently used

    cache.write(_entry("new"))  # a compile's write evicts: "old" is unused too long, "b" the LRU beyond 3

    left = sorted(p.name for p in cache.directory.iterdir())
    assert left == ["a.json", "c.json", "new.json"]


def test_eviction_keeps_a_fresh_entry_and_young_temporaries(tmp_path):
    cache = Cache(tmp_path / "bpf")
    cache.write(_entry("k1"))
    young_tmp = cache.directory / ".cafe.y.tmp"
    young_tmp.write_text("being written")
    assert cache.evict() == []
    assert cache.read("k1") is not None and young_tmp.exists()
