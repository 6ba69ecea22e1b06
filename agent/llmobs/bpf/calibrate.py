"""Start-up calibration: what one hit of each attached probe costs the workload, where it sits.

A uprobe hit costs the trap (the kernel either emulates the probed instruction - push, jmp: ~1-2 us
here - or single-steps a copy of it - endbr64, mov: ~20-30 us) plus the handler's own work. Both are
measured once per agent start, in the agent's own process, on a calibration target that needs no
compiler: a few functions written as raw x86-64 bytes into a file and mapped executable, so uprobes
can sit on them like on any library:

  loop(fn, n, args)  calls fn n times (the timing covers n calls and one ctypes call);
  emulated slots     push %rbp; mov %rsp,%rbp; xor %eax,%eax; pop %rbp; ret  (probe at +0: emulated)
  stepped slots      endbr64; then the same                                  (probe at +0: single-stepped)

Each slot carries at most one probe, so everything is attached once and the rounds interleave: an
unprobed slot of each class, an empty uprobe (and an empty uprobe+uretprobe) of each class, and the
REAL handler of every attached uprobe on an emulated slot, with the agent itself made a target of the
program for the duration (so the handler runs its whole path: tag read, exact aggregate, sample, ring).
Per-hit cost of a slot = its median ns per call minus the unprobed slot of its class.

A probe's cost at its real site is then: real handler (measured on an emulated slot) + the difference
single-stepped minus emulated if its site is single-stepped. Its ratio is against an empty uprobe of
the same legs at the same kind of site. Results are cached for the process lifetime per (library
build-id, file offset of the site); the class measurement itself runs once per process.

The caller runs this before the session's ring is drained and its maps reset (AttachSession.start
with Options(calibrate=True)): the calibration's own events are discarded there.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import os
import statistics
import struct
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from llmobs import environment
from llmobs.bpf import perf, syscall

# ---- the calibration target: raw machine code --------------------------------------------------------------
# loop(rdi=fn, rsi=n, rdx=args): push rbx/r12; rbx=fn; r12=n; rdi,rsi,rcx,r8,r9 = rdx (a pointer to an
# int 1, so handlers that read pointer arguments - sgemm's m, n, k - read real memory); call *rbx n times.
_LOOP = bytes.fromhex(
    "53" "4154" "4889fb" "4989f4" "4889d7" "4889d6" "4889d1" "4989d0" "4989d1"
    "ffd3" "49ffcc" "75f9" "415c" "5b" "c3"
)  # fmt: skip
_EMULATED = bytes.fromhex("554889e531c05dc3")  # push %rbp first: emulated by the kernel
_STEPPED = bytes.fromhex("f30f1efa") + _EMULATED  # endbr64 first: single-stepped
SLOT_BYTES = 64  # each function at its own offset: one uprobe per (file, offset)
DATA_OFFSET = 4096 - 64  # the int the argument registers point at
# A context cell (seq 0, trace 0, step CELL_STEP) the handlers read as a target's: a step, so the hits are
# tagged as a workload's are inside a forward pass, and a thinned probe (probes.thin) is measured thinned
CELL_OFFSET = 4096 - 192
CELL_STEP = 1
FILE_BYTES = 4096
MAX_HANDLER_SLOTS = 16

EMULATED, STEPPED = "emulated", "stepped"
# Used only when calibration could not run (reported as source "default"): docs/probes.md's numbers.
DEFAULT_TRAP_NS = {EMULATED: 1500.0, STEPPED: 25000.0}
DEFAULT_RETURN_NS = 1500.0
DEFAULT_HANDLER_NS = 300.0

# The baseline, an empty uprobe program (the cost of the trap alone): `r0 = 0; exit`, loaded as raw
# instructions, since compiling even an empty C unit with bcc takes ~0.2 s here.
_EMPTY_INSNS = bytes.fromhex("b7000000000000009500000000000000")


def _load_empty_program() -> int:
    return syscall.prog_load(syscall.PROG_KPROBE, _EMPTY_INSNS, "llmobs_cal_empty")


@dataclass(frozen=True)
class ProbeCost:
    """One hit of a probe: its cost to the workload (ns), and against an empty probe at such a site."""

    probe: str
    site: str  # library:symbol+offset, or the tracepoint
    site_class: str  # emulated | stepped | tracepoint
    legs: str  # entry | entry+return
    cost_ns: float
    empty_ns: float  # an empty uprobe with the same legs at the same kind of site
    source: str  # measured | default

    @property
    def ratio(self) -> float:
        return self.cost_ns / self.empty_ns if self.empty_ns > 0 else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": round(self.ratio, 3)}


@dataclass
class ClassCosts:
    """The measured per-hit costs (ns) of one calibration run."""

    empty: dict[str, float]  # site class -> empty entry uprobe
    empty_return: dict[str, float]  # site class -> empty uprobe + uretprobe
    handlers: dict[str, float] = field(default_factory=dict)  # handler key -> cost on an emulated slot
    baseline_ns: dict[str, float] = field(default_factory=dict)  # unprobed call, per class
    took_s: float = 0.0
    rounds: int = 0
    source: str = "measured"
    note: str = ""


# ---- the code file -----------------------------------------------------------------------------------------
# Fixed slots, then one emulated slot per measured handler. Each slot carries at most one probe (or an
# entry+return pair), so everything is attached once and the rounds interleave.
FIXED_SLOTS = {
    "base_e": (0, EMULATED),  # unprobed: the call itself
    "base_s": (1, STEPPED),
    "empty_e": (2, EMULATED),  # an empty entry uprobe
    "empty_s": (3, STEPPED),
    "empty_ret_e": (4, EMULATED),  # an empty uprobe + uretprobe
    "empty_ret_s": (5, STEPPED),
}
FIRST_HANDLER_SLOT = len(FIXED_SLOTS)


def _slot_offset(index: int) -> int:
    return SLOT_BYTES * (index + 1)


def code_image(handler_slots: int) -> bytes:
    """The file: the loop at 0, one function per slot, the argument int at DATA_OFFSET."""
    image = bytearray(b"\xcc" * FILE_BYTES)  # int3 wherever nothing should run
    image[0 : len(_LOOP)] = _LOOP
    classes = dict(FIXED_SLOTS.values())
    for index in range(FIRST_HANDLER_SLOT + handler_slots):
        code = _STEPPED if classes.get(index) == STEPPED else _EMULATED
        base = _slot_offset(index)
        image[base : base + len(code)] = code
    image[DATA_OFFSET : DATA_OFFSET + 8] = struct.pack("<q", 1)
    image[CELL_OFFSET : CELL_OFFSET + 64] = bytes(64)
    image[CELL_OFFSET + 24 : CELL_OFFSET + 32] = struct.pack("<Q", CELL_STEP)  # llmobs_ctx_cell.step_seq
    return bytes(image)


class CodeFile:
    """The calibration functions in a file mapped executable into this process (uprobes need a file)."""

    PROT_READ, PROT_EXEC, MAP_PRIVATE = 1, 4, 2

    def __init__(self, handler_slots: int):
        self.path = self._write(code_image(handler_slots))
        libc = ct.CDLL(None, use_errno=True)
        libc.mmap.restype = ct.c_void_p
        libc.mmap.argtypes = (ct.c_void_p, ct.c_size_t, ct.c_int, ct.c_int, ct.c_int, ct.c_long)
        libc.munmap.argtypes = (ct.c_void_p, ct.c_size_t)
        self._libc = libc
        fd = os.open(self.path, os.O_RDONLY)
        try:
            address = libc.mmap(None, FILE_BYTES, self.PROT_READ | self.PROT_EXEC, self.MAP_PRIVATE, fd, 0)
        finally:
            os.close(fd)
        if address in (None, ct.c_void_p(-1).value):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise OSError(ct.get_errno(), f"mmap PROT_EXEC of {self.path} (a noexec mount?)")
        self.address = address
        self._loop = ct.CFUNCTYPE(ct.c_long, ct.c_void_p, ct.c_long, ct.c_void_p)(address)

    @staticmethod
    def _write(image: bytes) -> str:
        """A private file per run (uprobes are per inode: another agent's probes must not meet ours)."""
        for directory in (os.environ.get(environment.LLMOBS_CACHE_DIR), "/run/llmobs", tempfile.gettempdir()):
            if not directory:
                continue
            try:
                os.makedirs(directory, exist_ok=True)
                fd, path = tempfile.mkstemp(prefix=f"llmobs-calibrate.{os.getpid()}.", dir=directory)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(image)
                return path
            except OSError:
                continue
        raise OSError("no writable directory for the calibration target")

    def run(self, slot: int, calls: int) -> float:
        """CPU ns per call of `slot`: `calls` calls in one native loop. Thread CPU time, not wall time:
        the traps are charged to the calling thread, and a preemption on a busy host is not."""
        began = time.thread_time_ns()
        self._loop(self.address + _slot_offset(slot), calls, self.address + DATA_OFFSET)
        return (time.thread_time_ns() - began) / calls

    def close(self) -> None:
        self._libc.munmap(self.address, FILE_BYTES)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


# ---- attaching BPF programs to the code file ---------------------------------------------------------------
class _Probes:
    """uprobes of given program fds on slots of the code file, for this process only."""

    def __init__(self, path: str):
        self.path = path
        self.events: list[perf.PerfLink] = []

    def attach(self, prog_fd: int, slot: int, is_return: bool) -> None:
        self.events.append(perf.attach_uprobe(prog_fd, self.path, _slot_offset(slot), os.getpid(), is_return))

    def close(self) -> None:
        for link in self.events:
            perf.detach(link)
        self.events.clear()

    def close_in_background(self, then=None) -> threading.Thread:
        """Each uprobe's release waits for an RCU grace period (~0.1 s here): off the caller's path."""

        def run():
            self.close()
            if then is not None:
                then()

        thread = threading.Thread(target=run, name="llmobs-calibrate-close", daemon=True)
        thread.start()
        return thread


@dataclass(frozen=True)
class Handler:
    """The BPF functions one probe runs per hit: its entry program and, when timed, its return program."""

    key: str  # e.g. "alloc_cpu" or "sgemm+durations"
    entry: str
    ret: str | None


def handlers_of(resolved, durations: bool) -> list[Handler]:
    """The real handler of each resolved uprobe, as AttachSession/ProbeProgram would attach it."""
    found: dict[str, Handler] = {}
    for item in resolved:
        probe = item.probe
        optional = durations and probe.optional_duration
        key = f"{probe.name}+durations" if optional else probe.name
        entry = f"uprobe__{probe.name}_timed" if optional else f"uprobe__{probe.name}"
        ret = f"uretprobe__{probe.name}" if probe.timed or optional else None
        found.setdefault(key, Handler(key, entry, ret))
    return list(found.values())[:MAX_HANDLER_SLOTS]


# ---- measuring ---------------------------------------------------------------------------------------------
_lock = threading.Lock()
_classes: ClassCosts | None = None  # measured once per process
_site_cache: dict[tuple[bytes, int, str], ProbeCost] = {}
_closing: threading.Thread | None = None  # the last measurement's probes being released


def wait_released(timeout: float = 10.0) -> bool:
    """Waits until the calibration's own uprobes are gone from the kernel (tests, clean exits)."""
    if _closing is not None:
        _closing.join(timeout)
        return not _closing.is_alive()
    return True


def measure(
    program=None, handlers: list[Handler] = (), rounds: int = 5, calls: tuple[int, int] = (1000, 100)
):
    """Measures the empty-probe costs per site class and each handler's cost on an emulated slot.

    `program` is a loaded ProbeProgram whose handler functions are measured (None: classes only);
    calls = (calls per round on emulated slots, on stepped slots). Returns ClassCosts.
    """
    began = time.perf_counter()
    handlers = list(handlers)
    code = CodeFile(handler_slots=len(handlers))
    probes = _Probes(code.path)
    made_target = False
    empty_fd = -1
    slots = dict(FIXED_SLOTS)
    try:
        empty_fd = _load_empty_program()
        for name, (slot, _cls) in FIXED_SLOTS.items():
            if name.startswith("empty"):
                probes.attach(empty_fd, slot, False)
                if name.startswith("empty_ret"):
                    probes.attach(empty_fd, slot, True)
        if program is not None and handlers:
            # the handlers run their whole path for this process, the context-cell read included
            program.set_target(os.getpid(), code.address + CELL_OFFSET)
            made_target = True
            for index, handler in enumerate(handlers):
                slot = FIRST_HANDLER_SLOT + index
                probes.attach(program.prog_fd(handler.entry), slot, False)
                if handler.ret:
                    probes.attach(program.prog_fd(handler.ret), slot, True)
                slots[f"h:{handler.key}"] = (slot, EMULATED)
        samples: dict[str, list[float]] = {name: [] for name in slots}
        for slot, _cls in slots.values():  # warm-up: fault the pages in, settle the caches
            code.run(slot, 10)
        for _ in range(rounds):
            for name, (slot, cls) in slots.items():
                samples[name].append(code.run(slot, calls[cls == STEPPED]))
    finally:
        if made_target:
            program.remove_target(os.getpid())
            _forget_own_totals(program)
        code.close()

        def release_program():
            if empty_fd >= 0:
                os.close(empty_fd)

        global _closing
        _closing = probes.close_in_background(release_program)
    med = {name: statistics.median(values) for name, values in samples.items()}
    base = {EMULATED: med["base_e"], STEPPED: med["base_s"]}

    def over(name: str, cls: str) -> float:
        return max(med[name] - base[cls], 1.0)

    return ClassCosts(
        empty={EMULATED: over("empty_e", EMULATED), STEPPED: over("empty_s", STEPPED)},
        empty_return={EMULATED: over("empty_ret_e", EMULATED), STEPPED: over("empty_ret_s", STEPPED)},
        handlers={h.key: over(f"h:{h.key}", EMULATED) for h in handlers},
        baseline_ns=base,
        took_s=time.perf_counter() - began,
        rounds=rounds,
    )


def _forget_own_totals(program) -> None:
    """Deletes the calibration's exact totals (this process's keys) from the program's aggregates."""
    from llmobs.bpf import aggregates

    aggs = program.maps["llmobs_aggs"]
    keys, _values = aggregates.read_totals(aggs.fd, program.agg_entries, aggs.ncpus)
    mine = keys["pid"] == os.getpid()
    if mine.any():
        aggregates.delete_keys(None, program.map_fd("llmobs_aggs"), keys[mine])


def default_costs(note: str) -> ClassCosts:
    return ClassCosts(
        empty=dict(DEFAULT_TRAP_NS),
        empty_return={k: v + DEFAULT_RETURN_NS for k, v in DEFAULT_TRAP_NS.items()},
        source="default",
        note=note,
    )


def class_costs() -> ClassCosts | None:
    """The process-wide measurement, if one ran."""
    return _classes


# ---- per-probe costs ---------------------------------------------------------------------------------------
@lru_cache(maxsize=128)
def _build_id_cached(path: str, _identity: tuple[int, int, int]) -> bytes:
    """The GNU build-id note of an ELF file (b"" when it has none)."""
    with open(path, "rb") as handle:
        header = handle.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2:
            return b""
        shoff = struct.unpack_from("<Q", header, 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
        handle.seek(shoff)
        table = handle.read(shentsize * shnum)
        for index in range(shnum):
            sh_type, _flags, _addr, offset, size = struct.unpack_from("<IQQQQ", table, index * shentsize + 4)
            if sh_type != 7 or size > 4096:  # SHT_NOTE
                continue
            handle.seek(offset)
            notes = handle.read(size)
            pos = 0
            while pos + 12 <= len(notes):
                namesz, descsz, note_type = struct.unpack_from("<III", notes, pos)
                name_end = pos + 12 + (namesz + 3) // 4 * 4
                desc = notes[name_end : name_end + descsz]
                if note_type == 3 and notes[pos + 12 : pos + 12 + namesz].rstrip(b"\0") == b"GNU":
                    return desc
                pos = name_end + (descsz + 3) // 4 * 4
    return b""


def build_id(path: str) -> bytes:
    try:
        st = os.stat(path)
        return _build_id_cached(path, (st.st_ino, st.st_size, int(st.st_mtime_ns)))
    except OSError:
        return b""


def probe_cost(resolved, classes: ClassCosts, durations: bool = False) -> ProbeCost:
    """The per-hit cost of one resolved uprobe at its site, cached per (build-id, offset, handler)."""
    probe = resolved.probe
    optional = durations and probe.optional_duration
    handler_key = f"{probe.name}+durations" if optional else probe.name
    offset = resolved.symbol.file_offset + resolved.placement.offset
    key = (build_id(resolved.path) or resolved.path.encode(), offset, handler_key)
    with _lock:
        cached = _site_cache.get(key)
    if cached is not None and cached.source == classes.source:
        return cached
    cls = EMULATED if resolved.placement.emulated else STEPPED
    timed = probe.timed or optional
    empty = (classes.empty_return if timed else classes.empty)[cls]
    handler = classes.handlers.get(handler_key)
    source = classes.source
    if handler is None:  # not measured (default costs, or a probe beyond the handler slots)
        handler = (classes.empty_return if timed else classes.empty)[EMULATED] + DEFAULT_HANDLER_NS
        source = "default"
    cost = handler + (classes.empty[STEPPED] - classes.empty[EMULATED] if cls == STEPPED else 0.0)
    site = f"{os.path.basename(resolved.path)}:{resolved.symbol.name}+{resolved.placement.offset}"
    result = ProbeCost(probe.name, site, cls, "entry+return" if timed else "entry", cost, empty, source)
    with _lock:
        _site_cache[key] = result
    return result


def calibrate(program, resolved, durations: bool = False, rounds: int = 5) -> dict[str, ProbeCost]:
    """Per-probe costs of `resolved` uprobes: measures the classes and handlers once per process (the
    handlers of later sessions with new probes are measured then), or reads them from an earlier
    attach's measurement in this boot (below); falls back to documented defaults when the measurement
    cannot run (no executable temp dir, no uprobe PMU)."""
    global _classes
    handlers = handlers_of(resolved, durations)
    with _lock:
        classes = _classes
    if classes is None and program is not None:
        classes = read_boot_cache(program.source, handlers)
    missing = [h for h in handlers if classes is None or h.key not in classes.handlers]
    if classes is None or classes.source != "measured" or missing:
        try:
            fresh = measure(program, missing if classes is not None else handlers, rounds=rounds)
            if classes is not None and classes.source == "measured":
                classes.handlers.update(fresh.handlers)
                classes.took_s += fresh.took_s
            else:
                classes = fresh
            if program is not None:
                write_boot_cache(program.source, handlers, classes)
        except Exception as exc:  # never stop an attach for a calibration: estimate with the defaults
            classes = classes or default_costs(f"calibration failed: {exc}")
    with _lock:
        _classes = classes
    return {item.probe.name: probe_cost(item, classes, durations) for item in resolved}


# ---- the per-boot cache ------------------------------------------------------------------------------------
# A measurement costs 80-400 ms of the attach, and the first event waits behind it. It measures the host,
# not the target: within one boot the same kernel runs the same compiled handlers at the same cost, up
# to the measurement's own noise. So it is kept next to the compiled programs (the same private
# directory, written atomically, evicted with them), keyed by the boot id, the kernel release, the
# program's source and the handlers measured; a later attach in the same boot reads it instead of
# measuring again (its note says so). A new boot, kernel or agent build measures afresh.
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
BOOT_CACHE_FORMAT = 1


def _boot_cache_key(source: str, handlers: list[Handler]) -> str | None:
    import hashlib
    import json

    try:
        with open(BOOT_ID_PATH) as handle:
            boot_id = handle.read().strip()
    except OSError:
        return None
    keys = sorted(h.key for h in handlers)
    material = json.dumps([BOOT_CACHE_FORMAT, boot_id, os.uname().release, source, keys])
    return "calibration-" + hashlib.sha256(material.encode()).hexdigest()


def read_boot_cache(source: str, handlers: list[Handler]) -> ClassCosts | None:
    """This boot's earlier measurement of these handlers, or None (none, unreadable, not ours)."""
    import json

    from llmobs.bpf.cache import Cache

    key = _boot_cache_key(source, handlers)
    if key is None:
        return None
    cache = Cache()
    try:
        cache.check_entry(key)
        data = json.loads(cache.path(key).read_text())
        classes = ClassCosts(**data["classes"])
    except Exception:  # missing, corrupt or not private: measured again (and rewritten)
        return None
    if classes.source != "measured" or any(h.key not in classes.handlers for h in handlers):
        return None
    took = time.strftime("%H:%M:%S", time.localtime(data.get("measured_at", 0)))
    classes.note = f"read from this boot's measurement at {took} ({classes.took_s * 1000:.0f} ms then)"
    classes.took_s = 0.0
    return classes


def write_boot_cache(source: str, handlers: list[Handler], classes: ClassCosts) -> None:
    """Keeps a measurement for later attaches in this boot; a failure only costs the next one a
    measurement."""
    import json

    from llmobs.bpf.cache import Cache

    key = _boot_cache_key(source, handlers)
    if key is None or classes.source != "measured":
        return
    text = json.dumps({"key": key, "measured_at": time.time(), "classes": asdict(classes)})
    with contextlib.suppress(Exception):
        Cache().write_text(key, text)


def reset_cache() -> None:
    """Forget every measurement (tests)."""
    global _classes
    with _lock:
        _classes = None
        _site_cache.clear()


def describe(costs: dict[str, ProbeCost], classes: ClassCosts | None) -> list[str]:
    """One line per probe, for attach's output and docs."""
    lines = []
    if classes is not None:
        lines.append(
            f"calibration ({classes.source}, {classes.took_s * 1000:.0f} ms): empty uprobe "
            f"{classes.empty[EMULATED]:,.0f} ns emulated, {classes.empty[STEPPED]:,.0f} ns single-stepped"
            + (f"; {classes.note}" if classes.note else "")
        )
    for cost in costs.values():
        lines.append(
            f"cost {cost.probe:<12} {cost.cost_ns:>8,.0f} ns/hit = {cost.ratio:4.2f}x an empty {cost.legs} "
            f"uprobe, {cost.site_class} site ({cost.site}; {cost.source})"
        )
    return lines
