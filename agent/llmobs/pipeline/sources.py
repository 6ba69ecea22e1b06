"""Sources of the pipeline: each `poll()` returns one typed batch (or nothing) and never blocks.

ShmSource reads a process's token steps (and its sampled per-layer metrics) from its shared-memory map
from cursors; AggregateSource turns the exact kernel totals an attach session harvests into
probe_aggregates deltas. (The ring's events are drained by the runtime, llmobs.runtime.Agent.)
"""

from __future__ import annotations

import time

import numpy as np

from llmobs import clock
from llmobs.bpf.output import aggregates_table
from llmobs.bpf.records import AGG_KEY_DTYPE, AGG_VAL_DTYPE
from llmobs.errors import LlmobsError, MalformedMap, NotTracked
from llmobs.shm import layout
from llmobs.shm.identity import ProcessIdentity
from llmobs.shm.reader import ShmReader

REOPEN_PERIOD_S = 1.0  # how often a missing map is looked for again (the workload may create it late)


class ShmSource:
    """Token steps of one pid, read from /dev/shm/llmobs.<pid> from a cursor on.

    The map may not exist yet (the process instruments itself after the agent attached): it is looked
    for again once a second. The reader keeps its file descriptor, so steps published just before the
    process exits (and unlinks the map) are still read by the final poll. Each poll that moves the cursor
    advertises it in the map's control block (reader_tail): a workload that exits before we caught up
    leaves its map (llmobs.shm.leftover), and `drain()` reads such a map by path, once, then removes it.

    `identity` is the process as the caller saw it alive (default: looked up now, None when it is gone
    already); a map left behind at exit must match it (llmobs.shm.reader.ShmReader, final_read).
    `advertise=False` for a reader that stores nothing (`top`): its cursor must not tell the workload
    that its steps are safe.
    """

    def __init__(self, pid: int, shm_dir: str = layout.SHM_DIR, proc_root: str = "/proc",
                 identity: ProcessIdentity | None = None, advertise: bool = True):  # fmt: skip
        self.pid = pid
        self.advertise = advertise
        self.shm_dir = shm_dir
        self.proc_root = proc_root
        self.identity = identity or ProcessIdentity.of(pid, proc_root)
        self.removed_map: str | None = None  # the exited writer's map drain() read and removed
        self.reader: ShmReader | None = None
        self.cursor = 0
        self.layers_cursor = 0
        self.requests_cursor = 0  # v3 request-events ring
        self._facts: list[dict[str, dict]] = []  # request_labels / request_intents of ended requests
        self.layer_rows = 0  # layer-stream records returned
        self._modules: set[tuple[int, int, str]] = set()  # layer-stream module names already returned
        self._names_seen = 0  # names of the reader already looked at for module names
        self.steps = 0  # token steps returned
        # The newest (t_start_ns, step_seq, batch_row) of this pid already in the store, set by the
        # pipeline: a restarted agent reads the map's ring from its start, and must not store twice the
        # steps its killed predecessor committed. Ring order is that key's order for one pid, and a new
        # process reusing the pid starts later on CLOCK_MONOTONIC, so its steps are never skipped.
        self.resume_after: tuple[int, int, int] | None = None
        self.already_stored = 0  # steps skipped because the store had them
        self.lost = 0  # overwritten in the ring before we read them
        self.corrupt = 0
        self.error: str | None = None  # why the map could not be read (None: fine or not there yet)
        self.waiting: str | None = None  # why the last look found no map
        self.model_id = ""
        self._next_open = 0.0
        self._gave_up = False

    def _open(self) -> bool:
        if self.reader is not None:
            return True
        if self._gave_up or time.monotonic() < self._next_open:
            return False
        self._next_open = time.monotonic() + REOPEN_PERIOD_S
        try:
            self.reader = ShmReader(
                self.pid,
                shm_dir=self.shm_dir,
                proc_root=self.proc_root,
                final_read=True,
                writer=self.identity,
            )
            self._names_seen = 0  # a new reader starts its names map afresh
        except NotTracked as exc:  # no map (yet): said in the summary if it never appears
            self.waiting = str(exc)
            return False
        except MalformedMap as exc:  # a bad map stays bad: say so once, stop trying
            self.error, self._gave_up = str(exc), True
            return False
        except LlmobsError as exc:
            self.error = str(exc)
            return False
        self.error = None
        return True

    def drain(self) -> dict | None:
        """Everything still unread, looking for the map now whatever the retry period (for close: a
        detach that comes before the first poll must still store the steps the map holds). A map whose
        writer has exited - left at exit because we had not caught up, or by a killed process - is read
        to its end now and then removed, so it is ingested once; our descriptor keeps it readable for
        drain_layers(). The map of a live process stays: it is the workload's."""
        self._next_open = 0.0
        parts = []
        while (columns := self.poll()) is not None:
            parts.append(columns)
        if self.reader is not None and not self.reader.is_alive() and self.reader.remove_file():
            self.removed_map = self.reader.path
        return joined_columns(parts)

    @property
    def map_path(self) -> str:
        return self.reader.path if self.reader else ""

    def poll(self) -> dict | None:
        """The token steps published since the last poll, as the agreed columns (None when none)."""
        if not self._open():
            return None
        try:
            batch = self.reader.read_steps(self.cursor)
        except MalformedMap as exc:  # the writer restarted (head behind our cursor) or the map broke
            self.error = str(exc)
            self.reader.close()
            self.reader, self.cursor, self.layers_cursor, self.requests_cursor = None, 0, 0, 0
            return None
        if self.advertise and batch.next_cursor != self.cursor:
            self.reader.advertise_tail(batch.next_cursor)  # what lets the workload remove its map at exit
        self.cursor = batch.next_cursor
        self.lost += batch.lost
        self.corrupt += batch.corrupt
        if not len(batch):
            return None
        columns = batch.columns
        if self.resume_after is not None:
            columns = self._skip_stored(columns)
            if columns is None:
                return None
        self.steps += len(columns["step_seq"])
        if not self.model_id and columns["model_id"]:
            self.model_id = columns["model_id"][-1]
        return columns

    def _skip_stored(self, columns: dict) -> dict | None:
        """The rows after `resume_after` (None when none); stops checking once a newer row is seen."""
        t, seq, row = self.resume_after
        ts, seqs, rows = (np.asarray(columns[k], np.int64) for k in ("t_start_ns", "step_seq", "batch_row"))
        newer = (ts > t) | ((ts == t) & ((seqs > seq) | ((seqs == seq) & (rows > row))))
        self.already_stored += int(len(newer) - newer.sum())
        if not newer.any():
            return None
        self.resume_after = None
        if newer.all():
            return columns
        keep = np.flatnonzero(newer)
        return {k: v[keep] if isinstance(v, np.ndarray) else [v[i] for i in keep] for k, v in columns.items()}

    def poll_layers(self, refresh: bool = False) -> dict | None:
        """Layer-stream records (LAYER_COLUMNS + ts_ns, the read time) published since the last call;
        call after poll(), whose header refresh it reuses by default."""
        if self.reader is None:
            return None
        try:
            batch = self.reader.read_layers(self.layers_cursor, refresh=refresh)
        except MalformedMap as exc:
            self.error = str(exc)
            return None
        self.layers_cursor = batch.next_cursor
        self.lost += batch.lost
        self.corrupt += batch.corrupt
        if not len(batch):
            return None
        self.layer_rows += len(batch)
        columns = dict(batch.columns)
        columns["ts_ns"] = np.full(len(batch), clock.monotonic_ns(), np.int64)
        return columns

    def poll_modules(self) -> dict | None:
        """layer_modules rows for the layer-stream module names (names-ring `module:` records) seen for
        the first time since the last call; the names are folded in by the steps' poll."""
        if self.reader is None:
            return None
        from llmobs.shm.names import parse_module_name

        names = self.reader.names  # hash -> text, only ever grows: look at the names added since last time
        if len(names) == self._names_seen:
            return None
        fresh = []
        for text in list(names.values())[self._names_seen :]:
            parsed = parse_module_name(text)
            if parsed is not None and parsed not in self._modules:
                self._modules.add(parsed)
                fresh.append(parsed)
        self._names_seen = len(names)
        if not fresh:
            return None
        return {
            "pid": np.full(len(fresh), self.pid, np.int32),
            "kind": np.array([f[0] for f in fresh], np.int32),
            "layer": np.array([f[1] for f in fresh], np.int32),
            "module": [f[2] for f in fresh],
            "ts_ns": np.full(len(fresh), clock.monotonic_ns(), np.int64),
        }

    def poll_request_events(self, refresh: bool = False) -> dict | None:
        """v3 request events (llmobs.shm.reader.REQUEST_EVENT_COLUMNS: served requests' ends, prefill
        chunks) published since the last call; call after poll(), whose header refresh it reuses."""
        if self.reader is None:
            return None
        try:
            batch = self.reader.read_request_events(self.requests_cursor, refresh=refresh)
        except MalformedMap as exc:
            self.error = str(exc)
            return None
        self.requests_cursor = batch.next_cursor
        self.lost += batch.lost
        self.corrupt += batch.corrupt
        if batch.facts:
            self._facts.append(batch.facts)
        return batch.columns if len(batch) else None

    def poll_request_facts(self) -> dict | None:
        """The request_labels / request_intents rows of the requests whose ends the last
        poll_request_events read, and the model_factors rows new since the last call (the names ring
        brings them: read by every poll); None when there is nothing."""
        if self.reader is None:
            return None
        out: dict[str, dict] = {}
        for facts in self._facts:
            for table, columns in facts.items():
                out[table] = columns if table not in out else {k: _concat([out[table][k], v])
                                                               for k, v in columns.items()}  # fmt: skip
        self._facts = []
        factors = self.reader.fresh_model_factors(clock.monotonic_ns())
        if factors is not None:
            out["model_factors"] = factors
        return out or None

    def drain_layers(self) -> dict | None:
        """Every layer record still unread (for close)."""
        parts = []
        while (columns := self.poll_layers(refresh=True)) is not None:
            parts.append(columns)
        return joined_columns(parts)

    def stats(self) -> dict[str, int]:
        """The map's own drop counters (the workload's side) next to ours."""
        header = self.reader.header if self.reader else {}
        return {
            "steps": self.steps,
            "lost": self.lost,
            "corrupt": self.corrupt,
            "already_stored": self.already_stored,
            "writer_dropped": int(header.get("steps_dropped", 0)) if header else 0,
        }

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def joined_columns(parts: list[dict]) -> dict | None:
    """Batches of the same columns (the map reader's: numpy arrays or lists) as one (None: no batch)."""
    if len(parts) <= 1:
        return parts[0] if parts else None
    return {k: _concat([p[k] for p in parts]) for k in parts[0]}


def _concat(parts: list) -> list | np.ndarray:
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else [x for p in parts for x in p]


_EMPTY_KEYS = np.empty(0, AGG_KEY_DTYPE)
_EMPTY_VALUES = np.empty(0, AGG_VAL_DTYPE)


class AggregateSource:
    """The exact kernel totals of a started AttachSession, as probe_aggregates deltas (a Source).

    The runtime drains the session's events; the session moves the totals of finished steps out of the
    bounded kernel map once a second. The store wants what each harvest moved (probe_aggregates rows are
    deltas the store sums), so this keeps what it already handed on and returns the difference.
    """

    def __init__(self, session):
        self.session = session
        session.totals.track_new = True  # each harvest's deltas are kept for poll(): O(new), not O(all)
        self.rows = 0  # delta rows returned

    def poll(self) -> dict | None:
        """{"probe_aggregates": the totals harvested since the last poll} (None when nothing moved)."""
        return self._batch(self.session.totals.take_new())

    def final(self, final: dict) -> dict | None:
        """The rest at detach: what was harvested since the last poll, and the final totals' part that
        was never harvested (the live steps), i.e. final minus harvested."""
        totals = self.session.totals
        delta = totals.take_new()
        for key, value in final.get("totals", {}).items():
            harvested = totals.harvested(key)
            rest = list(value) if harvested is None else [value[i] - harvested[i] for i in range(3)]
            if any(rest):
                slot = delta.setdefault(key, [0, 0, 0])
                for i in range(3):
                    slot[i] += rest[i]
        return self._batch(delta)

    def stats(self) -> dict[str, int]:
        return {"aggregate_rows": self.rows}

    def _batch(self, delta: dict[tuple[int, int, int], list[int]]) -> dict | None:
        if not delta:
            return None
        self.rows += len(delta)
        return {"probe_aggregates": aggregates_table(delta)}
