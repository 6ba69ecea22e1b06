"""One BPF map seen from user space through the bpf(2) syscall: keys and values as bytes, sized from the
map's spec, whatever the C declared (a map added to bpf/c needs no code here).

A per-CPU map's value reads as one 8-byte-aligned slot per possible CPU (`value_bytes`); `update`
of such a map takes that whole buffer.
"""

from __future__ import annotations

import ctypes as ct
from array import array
from collections.abc import Iterator

from llmobs.bpf import syscall
from llmobs.bpf.cache import MapSpec

CLEAR_CHUNK = 4096  # keys per batch when a hash is emptied


class BpfMap:
    def __init__(self, fd: int, spec: MapSpec):
        self.fd = fd
        self.spec = spec
        self.name = spec.name
        self.key_size = spec.key_size
        self.max_entries = spec.max_entries
        self.percpu = spec.type in syscall.PERCPU_MAP_TYPES
        self.ncpus = syscall.possible_cpus() if self.percpu else 1
        self.value_bytes = syscall.percpu_value_bytes(spec.value_size) if self.percpu else spec.value_size
        self.is_array = spec.type in (syscall.MAP_ARRAY, syscall.MAP_PERCPU_ARRAY)

    def _key(self, key: bytes) -> ct.Array:
        if len(key) != self.key_size:
            raise ValueError(f"{self.name}: key of {len(key)} bytes, the map's are {self.key_size}")
        return ct.create_string_buffer(key, self.key_size)

    def lookup(self, key: bytes) -> bytes | None:
        value = ct.create_string_buffer(self.value_bytes)
        return value.raw if syscall.map_lookup(self.fd, self._key(key), value) else None

    def update(self, key: bytes, value: bytes, flags: int = syscall.BPF_ANY) -> None:
        if len(value) != self.value_bytes:
            raise ValueError(f"{self.name}: value of {len(value)} bytes, the map's are {self.value_bytes}")
        syscall.map_update(self.fd, self._key(key), ct.create_string_buffer(value, self.value_bytes), flags)

    def delete(self, key: bytes) -> bool:
        return syscall.map_delete(self.fd, self._key(key))

    def iter_keys(self) -> Iterator[bytes]:
        """Every key (hash maps: as they stand while iterating; arrays: every index)."""
        current, nxt = None, ct.create_string_buffer(self.key_size)
        while syscall.map_next_key(self.fd, current, nxt):
            yield nxt.raw
            current = ct.create_string_buffer(nxt.raw, self.key_size)

    def clear(self) -> None:
        """Empties a hash (batches of lookups, then deletes) or zeroes an array."""
        if self.is_array:
            self.zero()
            return
        keys = ct.create_string_buffer(self.key_size * CLEAR_CHUNK)
        values = ct.create_string_buffer(self.value_bytes * CLEAR_CHUNK)
        batch = ct.create_string_buffer(max(self.key_size, 8))
        while True:
            count, _end = syscall.map_lookup_batch(self.fd, None, batch, keys, values, CLEAR_CHUNK)
            if count == 0:
                return
            syscall.map_delete_batch(self.fd, keys, count)

    def zero(self) -> None:
        """Zeroes every slot of an array (or per-CPU array) in one BPF_MAP_UPDATE_BATCH."""
        entries = self.max_entries
        # array() fills the indexes in C: 6 ms for the 131,072 slots of llmobs_call_start, against 42 ms
        # for ctypes' own (*range(entries)), on each start of a session whose program was used before
        keys = (ct.c_uint32 * entries).from_buffer(array("I", range(entries)))
        values = ct.create_string_buffer(self.value_bytes * entries)
        syscall.map_update_batch(self.fd, keys, values, entries)

    def zero_slots(self, indexes: list[int]) -> None:
        """Zeroes these slots of an array, in one BPF_MAP_UPDATE_BATCH."""
        if not indexes:
            return
        keys = (ct.c_uint32 * len(indexes))(*indexes)
        values = ct.create_string_buffer(self.value_bytes * len(indexes))
        syscall.map_update_batch(self.fd, keys, values, len(indexes))

    def read_array(self) -> bytes:
        """Every value of an array map, in index order, in one BPF_MAP_LOOKUP_BATCH (value_bytes each)."""
        entries = self.max_entries
        keys = (ct.c_uint32 * entries)()
        values = ct.create_string_buffer(self.value_bytes * entries)
        batch = ct.c_uint32(0)
        total, first = 0, True
        while total < entries:
            position = None if first else ct.addressof(batch)
            key_at, value_at = ct.addressof(keys) + 4 * total, ct.addressof(values) + self.value_bytes * total
            count, end = syscall.map_lookup_batch(
                self.fd, position, ct.addressof(batch), key_at, value_at, entries - total
            )
            total += count
            first = False
            if end or count == 0:
                break
        return values.raw[: total * self.value_bytes]
