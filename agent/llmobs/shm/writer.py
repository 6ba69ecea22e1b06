"""The workload side of the map: creates /dev/shm/llmobs.<pid> and publishes into it, wait-free.

The writer never waits for the agent. Rings overwrite their oldest records; a reader that falls
behind counts exactly the positions it never saw. Each record is guarded by a sequence word written
2*pos+1 before and 2*pos+2 after its fields, so a torn or overwritten record is always detected.
On CUDA the device block of a record is copied with non_blocking=True and the record is committed
only once a CUDA event recorded after the copy has completed, polled without blocking.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from llmobs import environment
from llmobs.shm import layout, thread_ctx
from llmobs.shm.hashing import name_hash
from llmobs.shm.identity import process_start_ticks
from llmobs.shm.leftover import keep_at_exit

_U64 = struct.Struct("<Q")
# trace_id_hi, trace_id_lo, step_seq, tenant_hash, session_hash, v3: rows, flags, tokens (cell offset 8)
_CELL_BODY = struct.Struct("<QQQQQIII")
# step_seq .. kv_len, device block, flags, v3: tokens_in_pass, request_seq (offset 8)
_STEP_BODY = struct.Struct("<QQQQQQQQIIii28sIII")
# v3 request-events record from offset 8: step_seq .. t_end_ns (11 words), then 8 u32 fields
_REQUEST_BODY = struct.Struct("<QQQQQQQQQQQIIIIIIII")
_NAME_HEAD = struct.Struct("<QII")  # hash, kind, length at name record offset 8
_CONTROL_CMD = struct.Struct("<QIIQ")  # cmd_seq, cmd, cmd_flags, cmd_arg
_CONTROL_ACK = struct.Struct("<IIQQ")  # ack_status, ack_pid, ack_step_seq, done_step_seq at +32
_CUPTI_BODY = struct.Struct("<QQQQQIII")  # step_seq .. stream_id at CUPTI record offset 8
_LAYER_VALUE_WORD = layout.LAYER_RECORD.offsets["value"] // 4  # float32 index of `value` in a record

_H = layout.HEADER.offsets
_C = layout.CONTROL.offsets
# word indexes (offset / 8) of the words the hot path stores, resolved once
_W_CELL = layout.CTX_OFFSET >> 3
_W_HEARTBEAT = _H["heartbeat_ns"] >> 3
_W_STEPS_HEAD = _H["steps_head"] >> 3
_W_CMD_SEQ = layout.CONTROL_OFFSET >> 3
_STEP_SIZE = layout.STEP_RECORD.size
MAX_PENDING_STEPS = 256  # CUDA steps whose copies may still be in flight; more are dropped, not waited on
SMALL_BATCH = 8  # up to this many records are written with struct.pack_into; more with numpy

# control command handlers: cmd -> fn(writer, arg) -> (ack status, stop callback or None)
CommandHandler = Callable[["ShmWriter", int], tuple[int, Callable[[], None] | None]]
_command_handlers: dict[int, CommandHandler] = {}


def register_command_handler(cmd: int, handler: CommandHandler) -> None:
    """Let an in-process component (the CUPTI collector) carry out an agent command."""
    _command_handlers[cmd] = handler


def map_path(pid: int, shm_dir: str = layout.SHM_DIR) -> str:
    return os.path.join(shm_dir, f"{layout.FILE_PREFIX}{pid}")


class ShmWriter:
    """One process's map. Create with ShmWriter.create(); publish with begin_step / publish_steps."""

    def __init__(
        self,
        *,
        shm_dir: str = layout.SHM_DIR,
        names_capacity: int = layout.DEFAULT_NAMES_CAPACITY,
        steps_capacity: int = layout.DEFAULT_STEPS_CAPACITY,
        cupti_capacity: int = layout.DEFAULT_CUPTI_CAPACITY,
        layers_capacity: int = layout.DEFAULT_LAYERS_CAPACITY,
        requests_capacity: int = layout.DEFAULT_REQUESTS_CAPACITY,
        model_id: str | None = None,
    ):
        for cap in (names_capacity, steps_capacity, cupti_capacity, layers_capacity, requests_capacity):
            if not layout.is_valid_capacity(cap):
                raise ValueError(f"ring capacity {cap} must be a power of two in 1..{layout.MAX_CAPACITY}")
        self.pid = os.getpid()
        self.path = map_path(self.pid, shm_dir)
        regions = layout.regions(names_capacity, steps_capacity, cupti_capacity, layers_capacity,
                                 requests_capacity)  # fmt: skip
        self.size = regions.layout_size
        # A file with our pid can only be a stale one from a dead process whose pid we now reuse.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, layout.FILE_MODE)
        try:
            os.fchmod(fd, layout.FILE_MODE)  # the umask may have cleared bits; 0600 exactly
            os.ftruncate(fd, self.size)
            # MAP_POPULATE: fault every page in now (~1 ms once), not one page per 32 records later
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, self.size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # Every word another process polls (sequence words, heads, the cell's seq, ack_seq) is stored
        # through these typed views: one aligned 8-byte store. struct.pack_into would first zero the
        # bytes and then write them (CPython memsets its output), and a reader could see that zero.
        self.words = np.frombuffer(self.mm, dtype="<u8")
        self.words32 = np.frombuffer(self.mm, dtype="<u4")
        self.names_offset = regions.names_offset
        self.steps_offset = regions.steps_offset
        self.cupti_offset = regions.cupti_offset
        self.layers_offset = regions.layers_offset
        self.layers_capacity = layers_capacity
        self.requests_offset = regions.requests_offset
        self.requests_capacity = requests_capacity
        self.requests_head = 0
        self.requests_dropped = 0
        self._request_seq = 0  # the last request_seq handed out (next_request_seq)
        self.names_capacity = names_capacity
        self.steps_capacity = steps_capacity
        self.cupti_capacity = cupti_capacity
        self.steps = np.ndarray(
            (steps_capacity,), layout.STEP_RECORD.dtype, buffer=self.mm, offset=self.steps_offset
        )
        self._lock = threading.Lock()  # serialises claims between the workload's own threads only
        self.step_seq = 0
        self._cell_seq = 0  # only ever grows: a seqlock whose counter went back could pass a torn read
        self.steps_head = 0
        self.names_head = 0
        self.cupti_head = 0
        self.layers_head = 0
        self.layers_dropped = 0
        self.layers = np.ndarray(
            (layers_capacity,), layout.LAYER_RECORD.dtype, buffer=self.mm, offset=self.layers_offset
        )
        self._layer_values = None
        self._pending_layers: collections.deque = collections.deque()  # CUDA layer records awaiting copies
        self.steps_dropped = 0
        self._names: dict[int, int] = {}  # hash -> position it was last published at
        self._factors: dict[tuple[int, str], tuple[str, int]] = {}  # (model hash, key) -> (value, position)
        self._pending: collections.deque = collections.deque()  # CUDA steps awaiting their copy
        self._device_view = None
        self._cuda_registered = False
        self._acked_cmd_seq = 0
        self._cmd_until: int | None = None
        self._cmd_stop: Callable[[], None] | None = None
        # called with step_seq at each step start (after commands are handled) and 0 at clear_context:
        # the CUPTI collector pushes the step as CUPTI's external correlation id while it collects
        self.step_hook: Callable[[int], None] | None = None
        self.closed = False
        self._write_header(regions, model_id)

    # --- creation and teardown ------------------------------------------------------------------
    def _write_header(self, regions: layout.Regions, model_id: str | None) -> None:
        hdr = np.zeros((), layout.HEADER.dtype)
        hdr["abi_version"] = layout.ABI_VERSION
        hdr["header_size"] = layout.HEADER.size
        hdr["layout_size"] = self.size
        hdr["layout_hash"] = layout.LAYOUT_HASH
        hdr["writer_pid"] = self.pid
        hdr["writer_uid"] = os.getuid()
        hdr["writer_start_ticks"] = process_start_ticks()
        hdr["clock_id"] = layout.CLOCK_MONOTONIC
        hdr["state"] = layout.STATE_LIVE
        hdr["created_ns"] = time.monotonic_ns()
        hdr["ctx_offset"] = layout.CTX_OFFSET
        hdr["control_offset"] = layout.CONTROL_OFFSET
        hdr["names_offset"] = regions.names_offset
        hdr["names_capacity"] = self.names_capacity
        hdr["name_record_size"] = layout.NAME_RECORD.size
        hdr["steps_offset"] = regions.steps_offset
        hdr["steps_capacity"] = self.steps_capacity
        hdr["step_record_size"] = layout.STEP_RECORD.size
        hdr["cupti_offset"] = regions.cupti_offset
        hdr["cupti_capacity"] = self.cupti_capacity
        hdr["cupti_record_size"] = layout.CUPTI_RECORD.size
        hdr["layers_offset"] = regions.layers_offset
        hdr["layers_capacity"] = self.layers_capacity
        hdr["layer_record_size"] = layout.LAYER_RECORD.size
        hdr["requests_offset"] = regions.requests_offset
        hdr["requests_capacity"] = self.requests_capacity
        hdr["request_record_size"] = layout.REQUEST_RECORD.size
        raw = hdr.tobytes()
        self.mm[8 : layout.HEADER.size] = raw[8:]
        self.words[0] = layout.MAGIC  # last: a reader never sees a half-written header
        if model_id:
            self.set_model(model_id)

    def close(self, unlink: bool = True) -> None:
        """Commit what the device has finished, mark the map closed and remove the file - unless an agent
        on this host has not read every token step yet: then the file stays for it to read once and
        remove (llmobs.shm.leftover; bounded, never blocks)."""
        if self.closed or os.getpid() != self.pid:  # a forked child never tears down its parent's map
            return
        self.closed = True
        try:
            self.poll_pending(wait=True)
            self.words32[_H["state"] >> 2] = layout.STATE_CLOSED
        finally:
            if unlink and not self._keep_for_reader():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)

    def _keep_for_reader(self) -> bool:
        """Whether the map stays at exit for an agent that has not read every token step yet."""
        try:
            base = layout.CONTROL_OFFSET
            reader_pid = int(self.words[(base + _C["reader_pid"]) >> 3])
            reader_tail = int(self.words[(base + _C["reader_tail"]) >> 3])
            return keep_at_exit(self.path, self.size, self.steps_head, reader_pid, reader_tail)
        except Exception:  # never raises into the workload's exit: the map is removed as always
            return False

    def set_model(self, model_id: str | None) -> None:
        """The process's default model id, shown by `inspect` before any step."""
        self.words[_H["model_hash"] >> 3] = self.name(layout.NAME_MODEL, model_id)

    # --- names ------------------------------------------------------------------------------------
    def name(self, kind: int, text: str | None) -> int:
        """Hash of `text`, publishing the string once (again if the names ring has overwritten it)."""
        h = name_hash(text)
        if not h:
            return 0
        pos = self._names.get(h)
        if pos is not None and self.names_head - pos < self.names_capacity:
            return h
        self._publish_name(h, kind, text)
        return h

    def name_request(self, request_seq: int, request_id: str) -> None:
        """v3: the engine's id of request `request_seq` (a NAME_REQUEST record: `hash` is request_seq)."""
        if request_seq and request_id:
            self._publish_name(request_seq, layout.NAME_REQUEST, request_id)

    def name_trace_context(self, request_seq: int, text: str) -> None:
        """v3: request `request_seq` joined its caller's trace (a NAME_TRACE_CONTEXT record: `hash` is
        request_seq; text "<traceparent> <prompt-hash trace id>", docs/shm-abi.md)."""
        if request_seq and text:
            self._publish_name(request_seq, layout.NAME_TRACE_CONTEXT, text)

    def name_request_label(self, request_seq: int, key: str, value: str) -> None:
        """Label `key`=`value` of request `request_seq` (a NAME_REQUEST_LABEL record: `hash` is
        request_seq, text "key=value"; key 'variant' is its variant). Validate first
        (llmobs.publisher.labels): this only publishes."""
        if request_seq and key:
            self._publish_name(request_seq, layout.NAME_REQUEST_LABEL, f"{key}={value}")

    def name_request_intent(self, request_seq: int, record: bytes) -> None:
        """The intent fingerprint of request `request_seq` (a NAME_REQUEST_INTENT record: `hash` is
        request_seq; `record` is llmobs.publisher.intent.Intent.pack(), at most NAME_TEXT_BYTES bytes,
        binary: docs/shm-abi.md, "Intent")."""
        if request_seq and record and len(record) <= layout.NAME_TEXT_BYTES:
            self._publish_record(request_seq, layout.NAME_REQUEST_INTENT, bytes(record))

    def name_model_factor(self, model_hash: int, key: str, value: str) -> None:
        """Factor `key`=`value` of the model whose name hash is `model_hash` (a NAME_MODEL_FACTOR record).
        Published once per (model, key, value), again when the names ring has overwritten it: cheap to
        call at every request."""
        if not model_hash or not key:
            return
        known = self._factors.get((model_hash, key))
        if known is not None and known[0] == value and self.names_head - known[1] < self.names_capacity:
            return
        pos = self._publish_name(model_hash, layout.NAME_MODEL_FACTOR, f"{key}={value}")
        if len(self._factors) < 4096:  # bounded: past it a factor is republished per call (still correct)
            self._factors[(model_hash, key)] = (value, pos)

    def side_step_seq(self) -> int:
        """A step_seq for a forward pass on a background thread (llmobs.shadow's scoring pass): drawn
        from the one counter, but the context cell, the control block and the step hook are left to
        the live thread (the pass tags its own thread through its OTEP 4947 record instead). The live
        begin_step's unlocked `step_seq + 1` has no eval-breaker check between its load and its store,
        so under the GIL the two never draw the same number."""
        with self._lock:
            self.step_seq = seq = self.step_seq + 1
        return seq

    def next_request_seq(self) -> int:
        """A process-wide request number (u32, never 0): every publisher of this map draws from one
        counter, so two engines in one process never give two requests the same request_seq."""
        with self._lock:
            self._request_seq = (self._request_seq + 1) & 0xFFFFFFFF or 1
            return self._request_seq

    def _publish_name(self, h: int, kind: int, text: str) -> int:
        data = text.encode("utf-8")[: layout.NAME_TEXT_BYTES].decode("utf-8", "ignore").encode("utf-8")
        pos = self._publish_record(h, kind, data)
        if kind < layout.NAME_REQUEST:  # request ids and contexts: published once each, never looked up
            self._names[h] = pos
        if kind == layout.NAME_TENANT:
            thread_ctx.remember_tenant(h, text)
        return pos

    def _publish_record(self, h: int, kind: int, data: bytes) -> int:
        """One names-ring record of `data` (at most NAME_TEXT_BYTES bytes); returns its position."""
        with self._lock:
            pos = self.names_head
            off = self.names_offset + (pos & (self.names_capacity - 1)) * layout.NAME_RECORD.size
            self.words[off >> 3] = 2 * pos + 1
            self.names_head = pos + 1
            self.words[_H["names_head"] >> 3] = self.names_head
            _NAME_HEAD.pack_into(self.mm, off + 8, h, kind, len(data))
            self.mm[off + 24 : off + 24 + len(data)] = data
            self.words[off >> 3] = 2 * pos + 2
        return pos

    # --- the current-context cell -------------------------------------------------------------------
    def begin_step(self, trace_hi: int, trace_lo: int, tenant_hash: int, session_hash: int, rows: int = 0,
                   flags: int = 0, tokens: int = 0) -> int:  # fmt: skip
        """Start a token step (one forward pass): bump step_seq and publish the context the eBPF probes tag
        events with. v3: `rows`, `tokens` and the LLMOBS_CTX_* `flags` of a mixed pass (0 = not told)."""
        words = self.words
        self.step_seq = seq = self.step_seq + 1
        odd = self._cell_seq + 1  # the cell's seqlock: odd while writing, even when stable
        words[_W_CELL] = odd
        _CELL_BODY.pack_into(
            self.mm, layout.CTX_OFFSET + 8, trace_hi, trace_lo, seq, tenant_hash, session_hash, rows, flags,
            tokens,
        )  # fmt: skip
        self._cell_seq = odd + 1
        words[_W_CELL] = odd + 1
        words[_W_HEARTBEAT] = time.monotonic_ns()
        thread_ctx.attach(self.pid, trace_hi, trace_lo, seq, tenant_hash)  # OTEP 4947: this thread's step
        if self._pending or self._pending_layers:
            self.poll_pending()
        if words[_W_CMD_SEQ] != self._acked_cmd_seq or self._cmd_until is not None:
            self._poll_control()
        if self.step_hook is not None:
            self.step_hook(seq)
        return seq

    def clear_context(self) -> None:
        """Between requests: the cell says "untracked" (step_seq 0) so idle work is not misattributed."""
        mm = self.mm
        cell = layout.CTX_OFFSET
        odd = self._cell_seq + 1
        self.words[cell >> 3] = odd
        _CELL_BODY.pack_into(mm, cell + 8, 0, 0, 0, 0, 0, 0, 0, 0)
        self._cell_seq = odd + 1
        self.words[cell >> 3] = odd + 1
        thread_ctx.detach()
        if self.step_hook is not None:
            self.step_hook(0)

    # --- the control block ------------------------------------------------------------------------
    def _poll_control(self) -> None:
        base = layout.CONTROL_OFFSET
        cmd_seq = int(self.words[base >> 3])
        if self._cmd_until is not None and self.step_seq >= self._cmd_until:
            self._finish_command()
        if cmd_seq == self._acked_cmd_seq:
            return
        _, cmd, _, arg = _CONTROL_CMD.unpack_from(self.mm, base)
        self._handle_command(cmd_seq, cmd, arg)

    def _handle_command(self, cmd_seq: int, cmd: int, arg: int) -> None:
        stop = None
        if cmd in _command_handlers:
            try:
                status, stop = _command_handlers[cmd](self, arg)
            except Exception:  # a failing collector must not break the workload
                status = layout.ACK_UNSUPPORTED
        elif cmd == layout.CMD_PING:
            status = layout.ACK_OK
        elif cmd == layout.CMD_COLLECT_CUPTI:
            status = layout.ACK_NO_GPU if not _cuda_available() else layout.ACK_UNSUPPORTED
        elif cmd == layout.CMD_REPLAY:  # known, but no flight recorder was ever installed here
            status = layout.ACK_UNSUPPORTED
        else:
            status = layout.ACK_UNKNOWN_COMMAND
        done = 0
        if status == layout.ACK_OK and cmd == layout.CMD_COLLECT_CUPTI and arg:
            self._cmd_until, self._cmd_stop = self.step_seq + arg, stop
        else:
            done = self.step_seq
        base = layout.CONTROL_OFFSET
        _CONTROL_ACK.pack_into(self.mm, base + _C["ack_status"], status, self.pid, self.step_seq, done)
        self.words[(base + _C["ack_seq"]) >> 3] = cmd_seq  # last: the agent's signal
        self._acked_cmd_seq = cmd_seq

    def _finish_command(self) -> None:
        stop, self._cmd_stop, self._cmd_until = self._cmd_stop, None, None
        if stop is not None:
            with contextlib.suppress(Exception):
                stop()
        self.words[(layout.CONTROL_OFFSET + _C["done_step_seq"]) >> 3] = self.step_seq

    # --- token-step records -------------------------------------------------------------------------
    def device_view(self):
        """A torch float32 [capacity, 7] view of every record's device block, backed by the map."""
        if self._device_view is None:
            import torch

            words = layout.STEP_RECORD.size // 4
            flat = torch.frombuffer(
                self.mm, dtype=torch.float32, count=self.steps_capacity * words, offset=self.steps_offset
            )
            first = layout.DEVICE_BLOCK_OFFSET // 4
            self._device_view = flat.view(self.steps_capacity, words)[
                :, first : first + layout.DEVICE_BLOCK_WORDS
            ]
        return self._device_view

    def _register_with_cuda(self) -> None:
        """Pin the map so device->map copies are truly asynchronous (pageable memory would sync)."""
        self._cuda_registered = True
        try:
            import torch

            view = self.device_view()
            ptr = view.data_ptr() - self.steps_offset - layout.DEVICE_BLOCK_OFFSET
            torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0)
        except Exception:  # still correct without pinning, only slower
            pass

    def publish_steps(
        self,
        block,
        *,
        step_seq: int,
        t_start: int,
        t_end: int,
        trace_hi,
        trace_lo,
        tenant_hash: int,
        session_hash: int,
        model_hash: int,
        step,
        position,
        batch_row,
        kv_len,
        flags,
        tokens_in_pass=0,
        request_seq=0,
    ) -> int:
        """Publish len(block) records. `block` is a float32 [n, 7] tensor on any device (the device
        block: loss, entropy, target_prob, top1_prob and int32 rank/token/target bits). The per-row
        host fields (tenant/session/model hashes, flags, tokens_in_pass, request_seq included: a mixed
        pass has rows of many requests) are ints or sequences of n. Returns the records dropped."""
        n = int(block.shape[0])
        cap = self.steps_capacity
        if n > cap:  # more than the ring holds: publish in chunks (the reader loses the older ones)
            dropped = 0
            for lo in range(0, n, cap):
                hi = min(n, lo + cap)
                dropped += self.publish_steps(
                    block[lo:hi], step_seq=step_seq, t_start=t_start, t_end=t_end,
                    trace_hi=_take(trace_hi, lo, hi), trace_lo=_take(trace_lo, lo, hi),
                    tenant_hash=_take(tenant_hash, lo, hi), session_hash=_take(session_hash, lo, hi),
                    model_hash=_take(model_hash, lo, hi), step=_take(step, lo, hi),
                    position=_take(position, lo, hi), batch_row=_take(batch_row, lo, hi),
                    kv_len=_take(kv_len, lo, hi), flags=_take(flags, lo, hi),
                    tokens_in_pass=_take(tokens_in_pass, lo, hi), request_seq=_take(request_seq, lo, hi),
                )  # fmt: skip
            return dropped
        cuda = block.is_cuda
        if cuda:
            flags = np.asarray(flags, np.uint32) | layout.FLAG_DEVICE_CUDA
            if not self._cuda_registered:
                self._register_with_cuda()
            if len(self._pending) >= MAX_PENDING_STEPS:
                self.poll_pending()
                if len(self._pending) >= MAX_PENDING_STEPS:  # the device is far behind: drop, never wait
                    self.steps_dropped += n
                    self.words[_H["steps_dropped"] >> 3] = self.steps_dropped
                    return n
        elif n <= SMALL_BATCH:
            self._publish_small_cpu(
                block,
                n,
                step_seq,
                t_start,
                t_end,
                trace_hi,
                trace_lo,
                tenant_hash,
                session_hash,
                model_hash,
                step,
                position,
                batch_row,
                kv_len,
                flags,
                tokens_in_pass,
                request_seq,
            )
            return 0
        with self._lock:
            pos = self.steps_head
            slot = pos & (cap - 1)
            first = min(n, cap - slot)  # records before the ring wraps
            seqs = 2 * np.arange(pos, pos + n, dtype=np.uint64) + 1
            self.steps["seq"][slot : slot + first] = seqs[:first]
            self.steps["seq"][: n - first] = seqs[first:]
            self.steps_head = pos + n
            self.words[_H["steps_head"] >> 3] = self.steps_head
            # the device block: one asynchronous copy into the map (two when the ring wraps)
            view = self.device_view()
            if first == n:
                view[slot : slot + n].copy_(block, non_blocking=True)
            else:
                view[slot:].copy_(block[:first], non_blocking=True)
                view[: n - first].copy_(block[first:], non_blocking=True)
            self._fill_many(
                slot,
                first,
                n,
                step_seq,
                t_start,
                t_end,
                trace_hi,
                trace_lo,
                tenant_hash,
                session_hash,
                model_hash,
                step,
                position,
                batch_row,
                kv_len,
                flags,
                tokens_in_pass,
                request_seq,
            )
            if cuda:  # committed by poll_pending() once the copy is done, never waited for
                import torch

                event = torch.cuda.Event()
                event.record()
                self._pending.append((event, pos, n))
            else:
                self._commit_many(pos, n)
        return 0

    def _publish_small_cpu(
        self,
        block,
        n,
        step_seq,
        t_start,
        t_end,
        trace_hi,
        trace_lo,
        tenant_hash,
        session_hash,
        model_hash,
        step,
        position,
        batch_row,
        kv_len,
        flags,
        tokens_in_pass,
        request_seq,
    ) -> None:
        """The common decode case (a few rows, CPU tensors): the device block is already in host memory
        and a copy would be synchronous anyway, so each record body (host fields, the 28-byte block,
        flags) is written with one pack_into between its two sequence stores."""
        raw = (block.detach() if block.requires_grad else block).numpy().tobytes()
        mm, words, cap = self.mm, self.words, self.steps_capacity
        scalar = isinstance(step, int) and isinstance(kv_len, int)
        same = all(isinstance(v, int) for v in (tenant_hash, session_hash, model_hash, flags, tokens_in_pass,
                                                request_seq))  # fmt: skip
        with self._lock:
            pos = self.steps_head
            offs = [self.steps_offset + ((pos + i) & (cap - 1)) * _STEP_SIZE for i in range(n)]
            for i, off in enumerate(offs):
                words[off >> 3] = 2 * (pos + i) + 1
            self.steps_head = pos + n
            words[_W_STEPS_HEAD] = pos + n
            for i, off in enumerate(offs):
                if same:
                    tenant, session, model, fl, tokens, req = (tenant_hash, session_hash, model_hash, flags,
                                                               tokens_in_pass, request_seq)  # fmt: skip
                else:
                    tenant, session, model, fl, tokens, req = (
                        int(_at(v, i)) for v in (tenant_hash, session_hash, model_hash, flags, tokens_in_pass,
                                                 request_seq)
                    )  # fmt: skip
                _STEP_BODY.pack_into(
                    mm, off + 8, step_seq, int(trace_hi[i]), int(trace_lo[i]), t_start, t_end,
                    tenant, session, model,
                    step if scalar else int(_at(step, i)), int(position[i]), int(batch_row[i]),
                    kv_len if scalar else int(_at(kv_len, i)), raw[28 * i : 28 * i + 28], fl, tokens, req,
                )  # fmt: skip
            for i, off in enumerate(offs):
                words[off >> 3] = 2 * (pos + i) + 2

    def _fill_many(
        self,
        slot,
        first,
        n,
        step_seq,
        t_start,
        t_end,
        trace_hi,
        trace_lo,
        tenant_hash,
        session_hash,
        model_hash,
        step,
        position,
        batch_row,
        kv_len,
        flags,
        tokens_in_pass=0,
        request_seq=0,
    ) -> None:
        values = {
            "step_seq": step_seq, "trace_id_hi": trace_hi, "trace_id_lo": trace_lo, "t_start_ns": t_start,
            "t_end_ns": t_end, "tenant_hash": tenant_hash, "session_hash": session_hash,
            "model_hash": model_hash, "step": step, "position": position, "batch_row": batch_row,
            "kv_len": kv_len, "flags": flags, "tokens_in_pass": tokens_in_pass, "request_seq": request_seq,
        }  # fmt: skip
        for name, value in values.items():
            # a list in the field's own dtype: a list of Python ints mixing trace words below and above
            # 2**63 would otherwise become float64 and lose the words' low bits
            arr = np.asarray(value, self.steps.dtype[name]) if isinstance(value, list) else np.asarray(value)
            arr = np.broadcast_to(arr, (n,))
            self.steps[name][slot : slot + first] = arr[:first]
            if first < n:
                self.steps[name][: n - first] = arr[first:]

    def _commit_many(self, pos: int, n: int) -> None:
        cap = self.steps_capacity
        slot = pos & (cap - 1)
        first = min(n, cap - slot)
        seqs = 2 * np.arange(pos, pos + n, dtype=np.uint64) + 2
        self.steps["seq"][slot : slot + first] = seqs[:first]
        if first < n:
            self.steps["seq"][: n - first] = seqs[first:]

    def poll_pending(self, wait: bool = False) -> int:
        """Commit CUDA steps whose copies have completed, in order, without blocking. wait=True (at the
        end of a request and at exit, never per step) first waits for the newest copy, so an idle
        process leaves no step uncommitted."""
        if wait:
            for pending in (self._pending, self._pending_layers):
                if pending:
                    pending[-1][0].synchronize()
        committed = 0
        while self._pending and self._pending[0][0].query():
            _, pos, n = self._pending.popleft()
            self._commit_many(pos, n)
            committed += n
        while self._pending_layers and self._pending_layers[0][0].query():
            _, pos, n = self._pending_layers.popleft()
            self._commit_layers(pos, n)
        return committed

    # --- layer-stream records (per-layer metrics sampled by a policy, e.g. attention entropy) -------
    def layer_values(self):
        """A torch float32 [capacity] view of every layer record's `value`, backed by the map."""
        if self._layer_values is None:
            import torch

            words = layout.LAYER_RECORD.size // 4
            flat = torch.frombuffer(
                self.mm, dtype=torch.float32, count=self.layers_capacity * words, offset=self.layers_offset
            )
            self._layer_values = flat.view(self.layers_capacity, words)[:, _LAYER_VALUE_WORD]
        return self._layer_values

    def publish_layers(self, values, *, step_seq: int, kind: int, trace_hi, trace_lo, batch_row, layer,
                       head) -> int:  # fmt: skip
        """Publish len(values) layer records. `values` is a float32 [n] tensor on any device (one
        asynchronous copy into the map on CUDA, committed once its event completed, never waited for);
        the host fields are ints or numpy arrays of n. Returns the number of records dropped."""
        n = int(values.shape[0])
        cap = self.layers_capacity
        cuda = values.is_cuda
        if n > cap or (cuda and len(self._pending_layers) >= MAX_PENDING_STEPS):
            if cuda:
                self.poll_pending()
            if n > cap or len(self._pending_layers) >= MAX_PENDING_STEPS:  # never wait: drop and count
                self.layers_dropped += n
                self.words[_H["layers_dropped"] >> 3] = self.layers_dropped
                return n
        if cuda and not self._cuda_registered:
            self._register_with_cuda()
        with self._lock:
            pos = self.layers_head
            slot = pos & (cap - 1)
            first = min(n, cap - slot)
            recs = self.layers
            seqs = 2 * np.arange(pos, pos + n, dtype=np.uint64) + 1
            recs["seq"][slot : slot + first] = seqs[:first]
            recs["seq"][: n - first] = seqs[first:]
            self.layers_head = pos + n
            self.words[_H["layers_head"] >> 3] = self.layers_head
            view = self.layer_values()
            src = values.detach()
            view[slot : slot + first].copy_(src[:first], non_blocking=True)
            if first < n:
                view[: n - first].copy_(src[first:], non_blocking=True)
            fields = {
                "step_seq": step_seq, "trace_id_hi": trace_hi, "trace_id_lo": trace_lo,
                "batch_row": batch_row, "layer": layer, "head": head, "kind": kind,
                "flags": layout.FLAG_DEVICE_CUDA if cuda else 0,
            }  # fmt: skip
            for name, value in fields.items():
                arr = np.broadcast_to(np.asarray(value), (n,))
                recs[name][slot : slot + first] = arr[:first]
                recs[name][: n - first] = arr[first:]
            if cuda:
                import torch

                event = torch.cuda.Event()
                event.record()
                self._pending_layers.append((event, pos, n))
            else:
                self._commit_layers(pos, n)
        return 0

    def _commit_layers(self, pos: int, n: int) -> None:
        cap = self.layers_capacity
        slot = pos & (cap - 1)
        first = min(n, cap - slot)
        seqs = 2 * np.arange(pos, pos + n, dtype=np.uint64) + 2
        self.layers["seq"][slot : slot + first] = seqs[:first]
        self.layers["seq"][: n - first] = seqs[first:]

    # --- request events (v3: a served request's end and its figures; prefill chunks) ----------------
    def publish_request_event(self, *, kind: int, request_seq: int, step_seq: int = 0, trace_hi: int = 0,
                              trace_lo: int = 0, tenant_hash: int = 0, session_hash: int = 0,
                              model_hash: int = 0, t_start: int = 0, t_scheduled: int = 0,
                              t_first_token: int = 0, t_last_token: int = 0, t_end: int = 0,
                              prompt_tokens: int = 0, prefill_tokens: int = 0, decoded_tokens: int = 0,
                              kv_blocks: int = 0, prefix_hit_tokens: int = 0,
                              finish_reason: int = 0) -> None:  # fmt: skip
        """One record of the request-events ring (struct llmobs_request_record), same protocol."""
        with self._lock:
            pos = self.requests_head
            off = self.requests_offset + (pos & (self.requests_capacity - 1)) * layout.REQUEST_RECORD.size
            self.words[off >> 3] = 2 * pos + 1
            self.requests_head = pos + 1
            self.words[_H["requests_head"] >> 3] = self.requests_head
            _REQUEST_BODY.pack_into(
                self.mm, off + 8, step_seq, trace_hi, trace_lo, tenant_hash, session_hash, model_hash,
                t_start, t_scheduled, t_first_token, t_last_token, t_end, request_seq, kind, prompt_tokens,
                prefill_tokens, decoded_tokens, kv_blocks, prefix_hit_tokens, finish_reason,
            )  # fmt: skip
            self.words[off >> 3] = 2 * pos + 2

    # --- CUPTI records (written by the in-process collector) -----------------------------------------
    def publish_cupti(
        self, step_seq, start_ns, end_ns, correlation_id, name_h, kind, device_id, stream_id
    ) -> None:
        with self._lock:
            pos = self.cupti_head
            off = self.cupti_offset + (pos & (self.cupti_capacity - 1)) * layout.CUPTI_RECORD.size
            self.words[off >> 3] = 2 * pos + 1
            self.cupti_head = pos + 1
            self.words[_H["cupti_head"] >> 3] = self.cupti_head
            _CUPTI_BODY.pack_into(
                self.mm,
                off + 8,
                step_seq,
                start_ns,
                end_ns,
                correlation_id,
                name_h,
                kind,
                device_id,
                stream_id,
            )
            self.words[off >> 3] = 2 * pos + 2


def _at(value, i: int):
    return value if isinstance(value, int) or np.ndim(value) == 0 else value[i]


def _take(value, lo: int, hi: int):
    return value if isinstance(value, int) or np.ndim(value) == 0 else value[lo:hi]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# --- the process's writer: created on first use, forgotten in a forked child, removed at exit ------
_writer: ShmWriter | None = None
_writer_lock = threading.Lock()
_writer_options: dict = {}


def configure(**options) -> None:
    """Options for the writer created on first use (shm_dir, capacities); env LLMOBS_* also apply."""
    _writer_options.update(options)


def get_writer() -> ShmWriter:
    global _writer
    w = _writer
    if w is not None:
        return w
    with _writer_lock:
        if _writer is None:
            opts = {
                "shm_dir": os.environ.get(environment.LLMOBS_SHM_DIR) or layout.SHM_DIR,
                "steps_capacity": int(
                    os.environ.get(environment.LLMOBS_STEPS_CAPACITY) or layout.DEFAULT_STEPS_CAPACITY
                ),
            }
            opts.update(_writer_options)
            _writer = ShmWriter(**opts)
            atexit.register(_writer.close)
        return _writer


def current_writer() -> ShmWriter | None:
    return _writer


def reset_writer() -> None:
    """Close and forget the process's writer (tests; or to recreate it with other options)."""
    global _writer
    with _writer_lock:
        if _writer is not None:
            _writer.close()
        _writer = None


def _forget_in_child() -> None:
    # The child inherits the parent's mapping; it must never write into it. It creates its own map
    # (llmobs.<child pid>) on its first step.
    global _writer
    if _writer is not None:
        _writer.closed = True  # makes close() a no-op in the child
    _writer = None


os.register_at_fork(after_in_child=_forget_in_child)
