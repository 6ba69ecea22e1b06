"""The flight recorder: what a replay of a past token step needs, kept in process memory, and the
control command CMD_REPLAY that replays one on a background thread.

    inst = llmobs.instrument(model, recorder=llmobs.Recorder(every=64, budget_mb=512, repeats=2))

Per request row it keeps (never in the map, never on disk):
- the token ids: the prompt without padding, then every token step's token (the chosen one in
  generate(), the target given to `req.step` in a request loop; -1 where a step had none). In a
  device buffer per request written with one device copy per step (no host sync);
- each token step's map step_seq and batch row, and the live pass's batch size;
- KV snapshots every `every` positions, as chunks: every layer's keys/values of positions [a, b) of
  that row only (left padding removed), copied into one tensor on the model's device (KvChunk). A
  snapshot at b is the concatenation of the chunks [0, b), so memory grows with the tokens, not
  tokens^2 / every, and `every` only trades a chunk copy per `every` positions against the prefill a
  replay needs from its snapshot (< `every` positions, each attending to the whole context).

Bounded: snapshot bytes stay <= budget_mb. Past it the oldest request's chunks are dropped first
(`snapshots_dropped` counts chunks); its token ids stay, so its replays start from the prompt. When
only the growing request itself is left, its new chunks are refused (its older ones stay usable). At
most `keep_ended` ended requests are kept (then the oldest goes, counted in `requests_evicted`), at
most MAX_LIVE_REQUESTS live ones, at most MAX_TOKEN_CELLS token ids per request.

The command (cmd_arg = layout.replay_arg(step_seq, batch_row, window)): at the step boundary the
handler only looks the token step up and answers
    ACK_UNKNOWN_REQUEST  no kept request holds that (step_seq, batch_row)
    ACK_BUSY             a replay is already running
    ACK_UNSUPPORTED      the recorder is off (the writer answers the same when none was ever on)
    ACK_OK               the job goes to ONE daemon thread `llmobs-replay` (nice 10)
which calls llmobs.publisher.replay.replay_window over the steps [i - window, i + window] known so
far, from the nearest snapshot at or before the window (else from the prompt), and writes
`replay_path(<map path>, ack_step_seq)` (.npz, mode 0600, written under a temporary name and renamed:
the agent never sees half a file). A failure there is a result file too, with meta status "failed"
(or "prompt_gone" when a token of the window was never known) and a reason.

The replay runs the same model on the replay thread while the workload goes on: every live hook
(hf.py, the layer samplers, the serving adapter) returns at once on a replay's thread
(replay_thread.in_replay_thread), so a replay never publishes token steps or layer records. On a GPU
replay_window runs on a stream of its own that first waits, device-side, for the live stream (the
snapshot copies); the replay thread alone waits for the token ids' copy to the host.
One recorder per process (the model instrumented last with one): a generate() of another instrumented
model is not recorded; requests of plain `llmobs.request` loops and of the serving publisher are
recorded for it (they do not name their model), so a process that runs several models in such loops
should install the recorder on the one it replays.
The continuous-batching engine (serving.py) records token ids only: its replays start from the prompt,
as a batch of one. Nothing here raises into the workload: failures are counted in
llmobs.publisher.request.errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from llmobs.publisher import replay
from llmobs.publisher import request as publisher
from llmobs.publisher.replay_thread import replaying
from llmobs.shm import layout
from llmobs.shm import writer as writer_module
from llmobs.shm.names import replay_path
from llmobs.shm.sidefile import write_npz_atomically

MAX_LIVE_REQUESTS = 1024  # requests recorded at once that never ended; past it the oldest is evicted
MAX_TOKEN_CELLS = 1 << 22  # token ids per request (rows x steps): 32 MiB of int64; later steps unrecorded
_FIRST_CAPACITY = 256  # token steps a request's buffer starts with; doubled as it fills


@dataclass(frozen=True)
class Recorder:
    """The flight recorder's policy: a KV snapshot every `every` positions, at most `budget_mb` of them,
    `repeats` replays of each window, at most `keep_ended` ended requests kept replayable, and a replay
    working at most `replay_share` of its wall time (after each pass it waits pass time x (1 / share - 1)):
    the replay's Python holds the GIL the live threads need, so its share bounds what it takes from them
    (1.0: as fast as it can)."""

    # 64, not the seed's 256: chunks make the bytes the same for any interval, and on a CPU the prefill
    # from the snapshot dominates a replay (2,048 positions: 4.3x faster than from the prompt at 64,
    # 3.3x at 256); the chunk copies cost 24 us per step at 64, 19 at 256 (bench/recorder_cost.py)
    every: int = 64
    budget_mb: float = 512
    repeats: int = 2
    keep_ended: int = 64
    replay_share: float = 0.5

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"Recorder(every={self.every}): every must be >= 1")
        if not self.budget_mb >= 0:
            raise ValueError(f"Recorder(budget_mb={self.budget_mb}): budget_mb must be >= 0")
        if not 1 <= self.repeats <= 16:
            raise ValueError(f"Recorder(repeats={self.repeats}): repeats must be in 1..16")
        if self.keep_ended < 1:
            raise ValueError(f"Recorder(keep_ended={self.keep_ended}): keep_ended must be >= 1")
        if not 0.05 <= self.replay_share <= 1.0:
            raise ValueError(f"Recorder(replay_share={self.replay_share}): replay_share must be in 0.05..1")

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_mb * (1 << 20))


def as_recorder(value) -> Recorder | None:
    """instrument()'s `recorder=` argument: None/False = off, True = Recorder(), a Recorder as is."""
    if value is None or value is False:
        return None
    if value is True:
        return Recorder()
    if isinstance(value, Recorder):
        return value
    raise TypeError(f"recorder must be None, a bool or llmobs.Recorder, not {value!r}")


def _grown(values: np.ndarray, n: int) -> np.ndarray:
    """`values` with room for index n (capacity doubled when full)."""
    if n < values.shape[-1]:
        return values
    bigger = np.full(values.shape[:-1] + (values.shape[-1] * 2,), -1, values.dtype)
    bigger[..., : values.shape[-1]] = values
    return bigger


def _cache_of(output, kwargs):
    """The forward's cache: the output's (a first pass creates it), else the one passed in. transformers
    5.x names it `cache` (its output.past_key_values warns), 4.x `past_key_values`: keep both names."""
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    if cache is None and not hasattr(output, "cache"):
        cache = getattr(output, "past_key_values", None)
    return cache


def cache_layers(cache) -> list | None:
    """Per layer (keys, values) [B, kv_heads, T, head_dim] of a transformers cache, or None."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56: cache.layers[i].keys / .values
        if any(getattr(la, "is_sliding", False) for la in layers):
            return None  # a sliding window keeps the last W positions only: not addressable by position
        pairs = [(getattr(la, "keys", None), getattr(la, "values", None)) for la in layers]
    elif hasattr(cache, "key_cache"):
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    else:
        return None
    if not pairs or any(k is None or v is None or k.dim() != 4 for k, v in pairs):
        return None
    return pairs


class KvChunk:
    """One row's keys/values of positions [a, b) of every layer, copied as one tensor
    [2 * layers, 1, kv_heads, b - a, head_dim]: chunk[i] is layer i's (keys, values), views into it.
    One copy (one kernel on a GPU) instead of two per layer: at 30 layers the per-layer clones cost
    1.6 ms of CPU per chunk, which made short intervals (`every` 16-64, what a CPU replay wants) dear."""

    __slots__ = ("block",)

    def __init__(self, block):
        self.block = block

    def __len__(self) -> int:
        return self.block.shape[0] // 2

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.block[2 * i], self.block[2 * i + 1]


def _copy_chunk(layers, row: int, span: slice) -> tuple:
    """(chunk, bytes) of positions `span` of `row`: one KvChunk when every layer's keys and values share
    shape, dtype and device (they do in the decoder-only models served here), else per-layer clones."""
    import torch

    parts = [t[row : row + 1, :, span] for kv in layers for t in kv]
    first = parts[0]
    if all(p.shape == first.shape and p.dtype == first.dtype and p.device == first.device for p in parts):
        block = torch.stack(parts)
        return KvChunk(block), block.numel() * block.element_size()
    chunk = [(parts[2 * i].clone(), parts[2 * i + 1].clone()) for i in range(len(layers))]
    return chunk, sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in chunk)


class Recording:
    """One request's record: `rows` sequences sharing their token steps' step_seqs (a generate() or
    llmobs.request batch), or one sequence whose batch row changes per step (a serving request)."""

    def __init__(self, recorder: FlightRecorder, prompts: list[np.ndarray], trace_ids: list[str],
                 batch_size: int, per_step_rows: bool = False):  # fmt: skip
        self.recorder = recorder
        self.prompts = prompts
        self.trace_ids = trace_ids
        self.rows = len(prompts)
        self.batch_size = batch_size  # the live pass's batch size (per step with per_step_rows)
        self.n = 0  # token steps recorded
        self.tokens = None  # torch [rows, capacity] on the logits' device, or numpy (serving)
        self.step_seq = np.full(_FIRST_CAPACITY, -1, np.int64)
        self.batch_row = np.full(_FIRST_CAPACITY, -1, np.int32) if per_step_rows else None
        self.live_batch = np.full(_FIRST_CAPACITY, -1, np.int32) if per_step_rows else None
        self.chunks: list[list] = [[] for _ in prompts]  # per row: [(end, [(k, v) per layer], bytes)]
        self.nbytes = 0
        self.pads: np.ndarray | None = None  # left padding of each row in the cache (first forward)
        self.snapshots_on = recorder.options.budget_bytes > 0
        self.snapshot_dropped = False  # some of its chunks went for the budget
        self.next_check = 0  # cache length at which a row next reaches a snapshot boundary
        self.ended = False
        self.detached = False  # evicted: it records nothing more

    # --- token steps (the live thread, Request.step / ServingPublisher) --------------------------------
    def token_step(self, step_seq: int, targets) -> None:
        """One token step of every row: `targets` [rows] on any device (None: no token known)."""
        try:
            if self.detached:
                return
            i = self.n
            if self.tokens is None:
                import torch

                device = targets.device if targets is not None else "cpu"
                self.tokens = torch.full((self.rows, _FIRST_CAPACITY), -1, dtype=torch.int64, device=device)
            if i >= self.tokens.shape[1]:
                if 2 * self.rows * self.tokens.shape[1] > MAX_TOKEN_CELLS:
                    self.recorder.tokens_capped += 1
                    self.detached = True  # the recorded prefix stays replayable
                    return
                self._grow_tokens()
            column = self.tokens[:, i]
            if targets is None or targets.numel() != self.rows:
                column.fill_(-1)
            else:
                column.copy_(targets.reshape(-1), non_blocking=True)  # device to device: no sync
            self.step_seq = _grown(self.step_seq, i)
            self.step_seq[i] = step_seq
            self.n = i + 1  # last: a lookup on another thread sees only complete steps
        except Exception as exc:
            publisher._count_error(exc)

    def _grow_tokens(self) -> None:
        import torch

        old = self.tokens
        new = torch.full((self.rows, old.shape[1] * 2), -1, dtype=old.dtype, device=old.device)
        new[:, : old.shape[1]].copy_(old)
        self.tokens = new  # a job holding the old buffer keeps reading it: its columns never change

    def host_step(self, step_seq: int, token: int, batch_row: int, live_batch: int) -> None:
        """One token step of a serving request (one row; the engine hands a host int)."""
        try:
            if self.detached:
                return
            i = self.n
            if self.tokens is None:
                self.tokens = np.full((1, _FIRST_CAPACITY), -1, np.int64)
            if i >= self.tokens.shape[1] and 2 * self.tokens.shape[1] > MAX_TOKEN_CELLS:
                self.recorder.tokens_capped += 1
                self.detached = True
                return
            self.tokens = _grown(self.tokens, i)
            self.tokens[0, i] = token
            for name, value in (("step_seq", step_seq), ("batch_row", batch_row), ("live_batch", live_batch)):
                values = _grown(getattr(self, name), i)
                values[i] = value
                setattr(self, name, values)
            self.n = i + 1
        except Exception as exc:
            publisher._count_error(exc)

    def end(self) -> None:
        try:
            if not self.ended:
                self.ended = True
                self.recorder._ended(self)
        except Exception as exc:
            publisher._count_error(exc)

    # --- KV snapshots (the live thread, after a forward pass) -----------------------------------------
    def after_forward(self, output, kwargs, width: int) -> None:
        """After a forward pass of this request: chunk the cache's new full `every`-blocks. `width`: the
        pass's input width (the first pass's is the padded prompt's)."""
        try:
            if not self.snapshots_on or self.detached:
                return
            cache = _cache_of(output, kwargs)
            if cache is None:
                return
            length = int(cache.get_seq_length())
            if self.pads is None:
                lens = np.array([len(p) for p in self.prompts], np.int64)
                if width != length or (lens > width).any():  # a cache that held a prefix already
                    self.snapshots_on = False
                    return
                self.pads = width - lens  # left padding: row r's position 0 is cache position pads[r]
                self.next_check = int(self.pads.min()) + self.recorder.options.every
            if length >= self.next_check:
                self._snapshot(cache, length)
        except Exception as exc:
            self.snapshots_on = False
            publisher._count_error(exc)

    def _snapshot(self, cache, length: int) -> None:
        every = self.recorder.options.every
        layers = cache_layers(cache)
        if layers is None or layers[0][0].shape[0] != self.rows:
            self.snapshots_on = False
            return
        for r in range(self.rows):
            pad = int(self.pads[r])
            start = self.chunks[r][-1][0] if self.chunks[r] else 0
            end = (length - pad) // every * every
            if end <= start:
                continue
            chunk, size = _copy_chunk(layers, r, slice(pad + start, pad + end))
            if not self.recorder._admit(self, r, (end, chunk, size)):
                return
        if self.snapshots_on:
            self.next_check = min(int(self.pads[r]) + (c[-1][0] if c else 0) + every
                                  for r, c in enumerate(self.chunks))  # fmt: skip

    def drop_chunks(self) -> int:
        """Drop every chunk (the budget); returns how many. Its token ids stay."""
        dropped = sum(len(c) for c in self.chunks)
        self.chunks = [[] for _ in self.chunks]
        self.nbytes = 0
        self.snapshots_on = False  # a later chunk without the ones before it would be useless
        self.snapshot_dropped = self.snapshot_dropped or dropped > 0
        return dropped

    # --- lookup (the handler, at a step boundary) -----------------------------------------------------
    def find(self, step_seq: int, batch_row: int) -> tuple[int, int] | None:
        """(row, step index) of the token step (step_seq, batch_row), or None."""
        n = self.n
        if not n or not self.step_seq[0] <= step_seq <= self.step_seq[n - 1]:
            return None
        i = int(np.searchsorted(self.step_seq[:n], step_seq))
        if i >= n or self.step_seq[i] != step_seq:
            return None
        if self.batch_row is None:
            return (batch_row, i) if batch_row < self.rows else None
        return (0, i) if self.batch_row[i] == batch_row else None


class _Job:
    """One replay, taken at the ack: references to what it reads (never written after)."""

    def __init__(self, rec: Recording, row: int, index: int, window: int, path: str, ack_step_seq: int):
        self.recording = rec
        self.row, self.index, self.window = row, index, window
        self.n = rec.n
        self.tokens = rec.tokens
        self.step_seq = rec.step_seq[: self.n].copy()
        self.chunks = list(rec.chunks[row])
        self.path, self.ack_step_seq = path, ack_step_seq
        self.live_batch = int(rec.live_batch[index]) if rec.live_batch is not None else rec.batch_size


class FlightRecorder:
    """The process's recorder (one: the model instrumented last with a recorder)."""

    def __init__(self, model, options: Recorder):
        self.model = model
        self.options = options
        self._lock = threading.Lock()  # the registry, between the workload's threads
        self._recordings: OrderedDict[int, Recording] = OrderedDict()  # oldest first
        self.snapshot_bytes = 0
        self.snapshots_taken = 0
        self.snapshots_dropped = 0
        self.requests_recorded = 0
        self.requests_evicted = 0
        self.tokens_capped = 0
        self.refused_busy = 0
        self.refused_unknown = 0
        self.replays_started = 0
        self.replays_failed = 0
        self.last_result: str | None = None  # path of the last result file written
        self._cv = threading.Condition()
        self._job: _Job | None = None
        self.busy = False
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.paced_s = 0.0  # seconds replays waited to keep within replay_share

    # --- the registry ---------------------------------------------------------------------------------
    def open(self, prompts: list[np.ndarray], trace_ids: list[str], batch_size: int,
             per_step_rows: bool = False) -> Recording:  # fmt: skip
        rec = Recording(self, prompts, trace_ids, batch_size, per_step_rows)
        with self._lock:
            self._recordings[id(rec)] = rec
            self.requests_recorded += 1
            live = sum(1 for r in self._recordings.values() if not r.ended)
            if live > MAX_LIVE_REQUESTS:
                self._evict(next(r for r in self._recordings.values() if not r.ended))
        return rec

    def _ended(self, rec: Recording) -> None:
        with self._lock:
            ended = [r for r in self._recordings.values() if r.ended]
            for old in ended[: max(0, len(ended) - self.options.keep_ended)]:
                self._evict(old)

    def discard(self, rec: Recording) -> None:
        """Forget a request of another model than the recorder's (a replay would run the wrong one)."""
        with self._lock:
            self._recordings.pop(id(rec), None)
            self.snapshot_bytes -= rec.nbytes
            rec.drop_chunks()
            rec.detached = True

    def _evict(self, rec: Recording) -> None:  # under the lock
        self._recordings.pop(id(rec), None)
        self.snapshot_bytes -= rec.nbytes
        rec.drop_chunks()
        rec.detached = True
        self.requests_evicted += 1

    def _admit(self, rec: Recording, row: int, chunk: tuple) -> bool:
        """Keep `chunk` (end, layers, bytes) of `rec`'s row within the budget: the oldest other requests'
        chunks go first. Under the lock, so a chunk and the byte counts never disagree."""
        size = chunk[2]
        budget = self.options.budget_bytes
        with self._lock:
            for victim in list(self._recordings.values()):
                if self.snapshot_bytes + size <= budget:
                    break
                if victim is not rec and victim.nbytes:
                    self.snapshot_bytes -= victim.nbytes
                    self.snapshots_dropped += victim.drop_chunks()
            if self.snapshot_bytes + size > budget:  # only rec itself is left: keep its older chunks
                rec.snapshots_on = False
                self.snapshots_dropped += 1
                return False
            if rec.detached or not rec.snapshots_on:  # evicted or dropped meanwhile (another thread)
                return False
            rec.chunks[row].append(chunk)
            self.snapshot_bytes += size
            rec.nbytes += size
            self.snapshots_taken += 1
        return True

    def find(self, step_seq: int, batch_row: int) -> tuple[Recording, int, int] | None:
        with self._lock:
            recordings = list(self._recordings.values())
        for rec in reversed(recordings):  # the newest first: a replay is usually of something recent
            hit = rec.find(step_seq, batch_row)
            if hit is not None:
                return rec, hit[0], hit[1]
        return None

    def counters(self) -> dict:
        return {
            "every": self.options.every, "budget_bytes": self.options.budget_bytes,
            "snapshot_bytes": self.snapshot_bytes, "snapshots_taken": self.snapshots_taken,
            "snapshots_dropped": self.snapshots_dropped, "requests_kept": len(self._recordings),
            "requests_recorded": self.requests_recorded, "requests_evicted": self.requests_evicted,
            "tokens_capped": self.tokens_capped, "refused_busy": self.refused_busy,
            "refused_unknown": self.refused_unknown, "replays_started": self.replays_started,
            "replays_failed": self.replays_failed, "replay_share": self.options.replay_share,
            "paced_s": round(self.paced_s, 3),
        }  # fmt: skip

    # --- the command (the live thread, at a step boundary: look up and hand over, nothing more) --------
    def command(self, writer, arg: int) -> int:
        step_seq, batch_row, window = layout.parse_replay_arg(arg)
        found = self.find(step_seq, batch_row)
        if found is None:
            self.refused_unknown += 1
            return layout.ACK_UNKNOWN_REQUEST
        with self._cv:
            if self.busy:
                self.refused_busy += 1
                return layout.ACK_BUSY
            rec, row, index = found
            path = replay_path(writer.path, writer.step_seq)
            self._job = _Job(rec, row, index, window, path, writer.step_seq)
            if self._thread is None or not self._thread.is_alive():
                try:
                    thread = threading.Thread(target=self._serve, name="llmobs-replay", daemon=True)
                    thread.start()
                except RuntimeError:  # e.g. at interpreter shutdown: no replay, and not stuck busy
                    self._job = None
                    return layout.ACK_UNSUPPORTED
                self._thread = thread
            self.busy = True
            self.replays_started += 1
            self._cv.notify()
        return layout.ACK_OK

    # --- the replay thread ------------------------------------------------------------------------------
    def _serve(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # below the workload's threads
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while True:
            with self._cv:
                while self._job is None and not self._stopped:
                    self._cv.wait()
                if self._job is None:  # stopped (a job acknowledged before the stop still runs)
                    return
                job = self._job
            try:
                self._run(job)
            except Exception as exc:  # the result file could not even be written: counted, not raised
                self.replays_failed += 1
                publisher._count_error(exc)
            finally:
                with self._cv:
                    self._job = None
                    self.busy = False
                    self._cv.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Until no replay is running (tests, benchmarks); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self.busy, timeout)

    def _run(self, job: _Job) -> None:
        t0 = time.monotonic_ns()
        first, last = max(0, job.index - job.window), min(job.n - 1, job.index + job.window)
        rec = job.recording
        prompt = rec.prompts[job.row]
        extra = {
            "pid": os.getpid(), "trace_id": rec.trace_ids[job.row],
            "target_step_seq": int(job.step_seq[job.index]),
            "target_batch_row": int(rec.batch_row[job.index]) if rec.batch_row is not None else job.row,
            "target_index": job.index, "window": job.window, "live_batch_size": job.live_batch,
        }  # fmt: skip
        first = max(first, 1 - len(prompt))  # step 0 scores position P - 1: a prompt of at least 1 token
        steps = np.arange(first, last + 1)
        try:
            tokens = self._tokens(job, prompt, last)
            if (tokens < 0).any():
                result = replay.ReplayResult.empty(
                    replay.STATUS_PROMPT_GONE, "a token of the window was never recorded (a step without a "
                    "target, or past the recorder's token cap)", repeats=self.options.repeats)  # fmt: skip
            else:
                first_pos, last_pos = len(prompt) + first - 1, len(prompt) + last - 1
                snapshot = self._snapshot(job, first_pos)
                result = self._replay(tokens, first_pos, last_pos, snapshot)
        except Exception as exc:  # e.g. out of memory: the agent gets the reason, the workload goes on
            self.replays_failed += 1
            result = replay.ReplayResult.empty(replay.STATUS_FAILED, f"{type(exc).__name__}: {exc}"[:500],
                                               repeats=self.options.repeats)  # fmt: skip
        arrays = result.to_arrays()
        if len(arrays["positions"]) == len(steps):
            arrays["step_index"] = steps.astype(np.int32)
            arrays["step_seq"] = job.step_seq[steps].astype(np.int64)
        meta = json.loads(str(arrays["meta"][()]))
        meta.update(extra)
        meta["snapshot_dropped"] = bool(meta.get("snapshot_dropped")) or rec.snapshot_dropped
        meta["recorder"] = self.counters()
        meta.setdefault("wall_ms", (time.monotonic_ns() - t0) / 1e6)
        arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
        write_npz_atomically(job.path, arrays)
        self.last_result = job.path

    def _tokens(self, job: _Job, prompt: np.ndarray, last: int) -> np.ndarray:
        """The row's known sequence up to the token step `last` (prompt, then each step's token)."""
        known = job.tokens[job.row, : last + 1]
        # .cpu() waits for the live stream's token copies: on this thread, never the live one
        known = known.cpu().numpy() if hasattr(known, "cpu") else np.asarray(known)
        return np.concatenate([prompt.astype(np.int64), known.astype(np.int64)])

    def _snapshot(self, job: _Job, first_pos: int):
        """The nearest snapshot at or before first_pos: the concatenation of the chunks up to it."""
        use = [c for c in job.chunks if c[0] <= first_pos]
        if not use:
            return None
        import torch

        if all(isinstance(c[1], KvChunk) for c in use):  # one concatenation for every layer
            block = torch.cat([c[1].block for c in use], dim=3)
            layers = [(block[2 * i], block[2 * i + 1]) for i in range(block.shape[0] // 2)]
        else:
            layers = [tuple(torch.cat([c[1][i][j] for c in use], dim=2) for j in (0, 1))
                      for i in range(len(use[0][1]))]  # fmt: skip
        return replay.KvSnapshot(use[-1][0], layers)

    def _replay(self, tokens: np.ndarray, first_pos: int, last_pos: int, snapshot):
        """replay_window runs on a CUDA stream of its own (waiting, device-side, for the live stream's
        snapshot copies) and synchronises it before it returns: the job's tensors outlive its use.
        On a GPU the replayed passes' CUPTI activity goes into the meta's `cupti` (replay_activity)."""
        import torch

        device = _model_device(self.model)
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
        activity, reason = _replay_activity(device)
        try:
            with replaying():  # the live hooks skip this thread's passes
                result = replay.replay_window(self.model, ids, first_pos, last_pos, snapshot,
                                              self.options.repeats, activity=activity,
                                              pace=self._pace)  # fmt: skip
        except BaseException:
            if activity is not None:
                activity.finish(0)  # gives CUPTI back
            raise
        if activity is not None:
            result.meta["cupti"] = activity.finish(int(result.loss.size))
        else:
            result.meta["cupti"] = {"status": "off", "reason": reason}
        return result

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def _pace(self, work_s: float) -> None:
        """After `work_s` seconds of replay work: wait so that work stays within replay_share of the
        wall time (at most MAX_PACE_S a wait; a stop() ends the wait at once)."""
        wait = pace_wait(work_s, self.options.replay_share)
        if wait > 0:
            self.paced_s += wait
            with self._cv:
                self._cv.wait_for(lambda: self._stopped, wait)


MAX_PACE_S = 5.0  # a single wait, whatever one pass cost


def pace_wait(work_s: float, share: float) -> float:
    """The wait after `work_s` of work that keeps work at `share` of the wall time: work x (1/share - 1)."""
    if share >= 1.0 or work_s <= 0:
        return 0.0
    return min(MAX_PACE_S, work_s * (1.0 / share - 1.0))


def _replay_activity(device):
    """(ReplayActivity, "") on a CUDA device whose process has the CUPTI collector, else (None, why)."""
    if device.type != "cuda":
        return None, "the model is not on a CUDA device"
    try:
        import llmobs.cupti as cupti_package
        from llmobs.cupti.replay_activity import ReplayActivity
    except ImportError as exc:
        return None, f"llmobs.cupti is not importable ({exc})"
    return ReplayActivity.start(cupti_package.installed())


def _model_device(model):
    import torch

    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


_active: FlightRecorder | None = None  # the process's recorder (the one the command serves)


def active() -> FlightRecorder | None:
    return _active


def _handle_replay(writer, arg: int):
    rec = _active
    if rec is None:
        return layout.ACK_UNSUPPORTED, None
    return rec.command(writer, arg), None


def install(model, options: Recorder) -> FlightRecorder:
    """Make a recorder for `model` the process's one (Request and the serving publisher record into it)."""
    global _active
    if _active is not None:
        _active.stop()
    _active = FlightRecorder(model, options)
    publisher.recorder = _active
    writer_module.register_command_handler(layout.CMD_REPLAY, _handle_replay)
    return _active


def uninstall(rec: FlightRecorder) -> None:
    global _active
    if _active is rec:
        _active = None
        publisher.recorder = None
    rec.stop()


def _after_fork_in_child() -> None:
    # The child has no replay thread; a job in flight at the fork is the parent's.
    rec = _active
    if rec is not None:
        rec._cv = threading.Condition()
        rec._job, rec.busy, rec._thread = None, False, None


os.register_at_fork(after_in_child=_after_fork_in_child)
