"""The compiled-program cache: what bcc made of an assembled C unit, kept on disk per source and kernel.

An entry is one JSON file named by its key, the sha256 of everything the compiled bytes depend on:
the assembled source, the cflags, the kernel release (the unit includes its headers), bcc's version
and the map ABI's layout hash. It holds each BPF function's instructions after bcc's rewriting, with
the places that reference a map (ld_imm64, src_reg BPF_PSEUDO_MAP_FD) listed so a loader can write in
its own map fds, and each map's spec, so the loader creates the maps itself (llmobs.bpf.loader).

Entries are loaded into the kernel as root, so the directory must be ours alone: created 0700, every
file written 0600 through a temporary file and a rename (a reader never sees half an entry), and a
directory or entry another user could have written is refused.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from llmobs import environment
from llmobs.errors import AccessDenied

FORMAT = 1  # bump when the entry's fields change: older entries then miss
DIR_MODE, FILE_MODE = 0o700, 0o600
# Eviction, when an entry is written (a compile: every other attach only reads): an entry is ~25 KB,
# one per (probe set, source, kernel, bcc), so a host that upgrades kernels or agents for years would
# otherwise keep them all. A read refreshes the entry's mtime: age is time since last use.
MAX_ENTRIES = 64
MAX_UNUSED_S = 30 * 86400
STALE_TMP_S = 3600  # a temporary file this old was left by a killed writer


def cache_dir() -> Path:
    """$LLMOBS_BPF_CACHE_DIR, else /var/cache/llmobs/bpf for root, else ~/.cache/llmobs/bpf."""
    configured = os.environ.get(environment.LLMOBS_BPF_CACHE_DIR)
    if configured:
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/var/cache/llmobs/bpf")
    return Path.home() / ".cache" / "llmobs" / "bpf"


@lru_cache(maxsize=1)
def bcc_version() -> str:
    """bcc's version, read from its package without importing it (importing bcc loads libbcc)."""
    spec = importlib.util.find_spec("bcc")
    if spec is None or not spec.submodule_search_locations:
        return "none"
    for location in spec.submodule_search_locations:
        with contextlib.suppress(OSError):
            text = (Path(location) / "version.py").read_text()
            match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
            if match:
                return match.group(1)
    return "unknown"


def cache_key(source: str, cflags: list[str]) -> str:
    from llmobs.shm.layout import LAYOUT_HASH

    material = json.dumps([FORMAT, source, list(cflags), os.uname().release, bcc_version(), LAYOUT_HASH])
    return hashlib.sha256(material.encode()).hexdigest()


@dataclass(frozen=True)
class MapSpec:
    name: str  # bcc's table name (the kernel keeps its first 15 bytes)
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int


@dataclass(frozen=True)
class Function:
    name: str
    prog_type: int
    insns: bytes
    map_refs: tuple[tuple[int, int], ...]  # (instruction index of an ld_imm64, index into Entry.maps)


@dataclass
class Entry:
    key: str
    maps: list[MapSpec]
    functions: dict[str, Function]
    license: str = "GPL"
    kern_version: int = 0
    compile_s: float = 0.0
    notes: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "key": self.key,
                "license": self.license,
                "kern_version": self.kern_version,
                "compile_s": self.compile_s,
                "notes": self.notes,
                "maps": [vars(spec) for spec in self.maps],
                "functions": {
                    name: {
                        "prog_type": fn.prog_type,
                        "insns": base64.b64encode(fn.insns).decode(),
                        "map_refs": [list(ref) for ref in fn.map_refs],
                    }
                    for name, fn in self.functions.items()
                },
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Entry:
        """Raises ValueError (KeyError, TypeError included) on anything that is not a whole entry."""
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"entry format {data.get('format')!r}, want {FORMAT}")
        maps = [MapSpec(**spec) for spec in data["maps"]]
        functions = {}
        for name, fn in data["functions"].items():
            insns = base64.b64decode(fn["insns"], validate=True)
            refs = tuple((int(i), int(m)) for i, m in fn["map_refs"])
            if len(insns) % 8 or any(not 0 <= m < len(maps) or not 0 <= i < len(insns) // 8 for i, m in refs):
                raise ValueError(f"function {name}: instructions or map references out of range")
            functions[name] = Function(name, int(fn["prog_type"]), insns, refs)
        return cls(data["key"], maps, functions, data["license"], int(data["kern_version"]),
                   float(data.get("compile_s", 0.0)), data.get("notes", {}))  # fmt: skip


def _check_private(path: Path, is_dir: bool) -> None:
    """Refuses a cache path another user could have written (we load what it holds into the kernel)."""
    st = path.lstat()
    kind_ok = stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)
    if not kind_ok or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise AccessDenied(
            f"the BPF program cache {path} is not private to uid {os.geteuid()} "
            f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
            hint=f"remove {path}, or set {environment.LLMOBS_BPF_CACHE_DIR} to a directory of yours",
        )


class Cache:
    """Entries under one directory (cache_dir() unless given)."""

    def __init__(self, directory: Path | None = None):
        self.directory = Path(directory) if directory is not None else cache_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def ensure_dir(self) -> Path:
        """The directory, created 0700 when missing; refused if it is not ours alone."""
        try:
            self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        except OSError as exc:
            raise AccessDenied(
                f"cannot create the BPF program cache {self.directory}: {exc.strerror}",
                hint=f"set {environment.LLMOBS_BPF_CACHE_DIR} to a writable directory",
            ) from None
        _check_private(self.directory, is_dir=True)
        return self.directory

    def read(self, key: str) -> Entry | None:
        """The entry, None when there is none; a corrupt one (not JSON, wrong key, truncated) is
        removed and reads as None, so it is compiled again."""
        path = self.path(key)
        try:
            _check_private(self.directory, is_dir=True)
            _check_private(path, is_dir=False)
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            entry = Entry.from_json(raw.decode())
            if entry.key != key:
                raise ValueError("entry key does not match its file name")
            with contextlib.suppress(OSError):
                os.utime(path)  # used now: what eviction keeps
            return entry
        except (ValueError, KeyError, TypeError):
            self.remove(key)
            return None

    def write(self, entry: Entry) -> Path:
        """Writes atomically: a 0600 temporary file in the same directory, fsync'ed, renamed in place."""
        return self.write_text(entry.key, entry.to_json())

    def write_text(self, key: str, text: str) -> Path:
        """`text` as the file of `key`, written as write() writes an entry (also the calibration's
        per-boot measurement, llmobs.bpf.calibrate, which lives and is evicted beside the programs)."""
        directory = self.ensure_dir()
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as handle:
                os.fchmod(handle.fileno(), FILE_MODE)
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.evict(keep=key)
        return self.path(key)

    def check_entry(self, key: str) -> None:
        """Raises AccessDenied unless the directory and the file of `key` are ours alone
        (FileNotFoundError when there is none)."""
        _check_private(self.directory, is_dir=True)
        _check_private(self.path(key), is_dir=False)

    def evict(self, keep: str = "", now: float | None = None) -> list[str]:
        """Removes entries unused for MAX_UNUSED_S, then the least recently used beyond MAX_ENTRIES,
        and temporary files older than STALE_TMP_S; never `keep`. Returns the names removed."""
        now = time.time() if now is None else now
        entries, removed = [], []
        with contextlib.suppress(OSError):
            for item in os.scandir(self.directory):
                with contextlib.suppress(OSError):
                    mtime = item.stat(follow_symlinks=False).st_mtime
                    if item.name.endswith(".tmp") and item.name.startswith("."):
                        if now - mtime > STALE_TMP_S:
                            os.unlink(item.path)
                            removed.append(item.name)
                    elif item.name.endswith(".json") and item.name != f"{keep}.json":
                        entries.append((mtime, item))
        entries.sort(key=lambda pair: pair[0], reverse=True)  # most recently used first
        room = MAX_ENTRIES - (1 if keep else 0)
        for index, (mtime, item) in enumerate(entries):
            if index >= room or now - mtime > MAX_UNUSED_S:
                with contextlib.suppress(OSError):
                    os.unlink(item.path)
                    removed.append(item.name)
        return removed

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()
