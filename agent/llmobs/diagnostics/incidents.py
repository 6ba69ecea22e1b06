"""Incidents: the flagged tokens that belong together, one row instead of a flood of anomaly rows.

An *incident* is what a user is paged about. Built incrementally, in arrival order, from anomaly rows
(whatever detector made them) on the anomaly lane's thread (llmobs.diagnostics.live), so every anomaly
row is committed with its incident in one transaction:

- scope `request`: token rows (kind `loss_*`) of one request (pid, trace_id, first_step_seq, batch_row)
  merge while each is at most `gap` forward passes (step_seq) after the incident's last flagged token.
  The gap is in passes, not token indices: a pass is what the agent sees advance (a served request that
  skips passes counts them too), so an incident can be closed exactly once the process's scored passes
  are beyond its last token + gap: no later row can join it. For generate() one pass is one token.
- scope `pass`: teacher-forced, training and eval passes (a forward with labels: every token of a row
  shares one step_seq) are scored by the step-level detector (llmobs.diagnostics.training, kind
  `train_loss_spike`); its rows merge across passes with the same gap, so one bad batch is one incident.
  The token-level rows of such a pass (`pass_token`: first_step_seq = step_seq, and step > 0 or the
  pass has more than one token of that row in the detectors' batch) are no incident of their
  own (a corrupted batch raises every token of its rows at once, and the per-token noise of clean
  batches would page on every batch); they are linked to the pass's incident when it has one.

An incident is `open` while more rows may join it and `closed` once the process's scored passes are past
last_seq + gap (or the pipeline closed); a closed incident is final. The lane writes an incident when it
closes (INSERT, once), and an open one only once it has been open OPEN_WRITE_NS (then again at most
that often while it grows, and at its close: UPDATE); only the lane's thread writes the table.

`incident_id` is `<pid>-<first_seq>-<batch_row>` (`-pass` for a pass incident): a pass has one token of
each row, so no two incidents share it. `peak_score` is the highest score of its rows; detectors' scores
differ in kind (t, modified z), so `peak_kind` says whose it is.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

GAP_PASSES = 4  # forward passes after an incident's last flagged token within which a new one joins it
MAX_OPEN = 4096  # open incidents kept; beyond, the least recently extended is closed early (counted)
RECENT_PASSES = 256  # closed pass incidents remembered, to link token rows of their passes arriving late
PASS_KINDS = ("train_loss_spike",)  # the step-level detectors' kinds (llmobs.diagnostics.training.KIND)

INCIDENT_COLUMNS = (
    "incident_id", "pid", "scope", "trace_id", "first_step_seq", "batch_row", "first_seq", "last_seq",
    "first_step", "last_step", "t_first_ns", "t_last_ns", "peak_score", "peak_seq", "peak_step",
    "peak_kind", "detectors", "tokens", "rows", "state", "ts_ns", "updated_ns", "closed_ns", "artifact",
)  # fmt: skip


@dataclass
class Incident:
    incident_id: str
    pid: int
    scope: str  # request | pass
    trace_id: str | None
    first_step_seq: int | None  # the request's (anomalies.first_step_seq); a pass incident: its first pass
    batch_row: int | None  # None for a pass incident (all its rows)
    first_seq: int
    last_seq: int
    first_step: int | None  # token index within the request (None for a pass incident)
    last_step: int | None
    t_first_ns: int | None  # the end of the first / last flagged step (CLOCK_MONOTONIC)
    t_last_ns: int | None
    peak_score: float
    peak_seq: int
    peak_step: int | None
    peak_kind: str
    ts_ns: int  # when its first row was detected
    updated_ns: int
    detectors: set[str] = field(default_factory=set)
    tokens: int = 0
    rows: int = 0
    state: str = "open"
    closed_ns: int | None = None
    artifact: str | None = None
    written: bool = field(default=False, repr=False)  # its row is in the store: later changes UPDATE it
    written_ns: int = field(default=0, repr=False)  # when its row was last written
    _steps: set = field(default_factory=set, repr=False)  # flagged token keys seen (dedup across detectors)

    def row(self) -> dict:
        values = {c: getattr(self, c) for c in INCIDENT_COLUMNS}
        values["detectors"] = ",".join(sorted(self.detectors))
        return values


@dataclass
class IncidentCounters:
    opened: int = 0
    closed: int = 0
    closed_early: int = 0  # closed to stay within MAX_OPEN
    linked_rows: int = 0  # anomaly rows given an incident
    pass_token_rows: int = 0  # token rows of teacher-forced passes (no incident of their own)


class IncidentBuilder:
    """Anomaly rows in, incidents out. One thread only (the anomaly lane's)."""

    def __init__(self, gap: int = GAP_PASSES, max_open: int = MAX_OPEN):
        if gap < 0:
            raise ValueError(f"incident gap must be >= 0 passes, not {gap}")
        self.gap = gap
        self.max_open = max_open
        self.counters = IncidentCounters()
        self._open: OrderedDict[tuple, Incident] = OrderedDict()  # by merge key
        self._passes: OrderedDict[tuple[int, int], str] = OrderedDict()  # (pid, step_seq) -> pass incident
        self._dirty: dict[str, Incident] = {}
        self._retry: dict[str, tuple[dict, bool]] = {}  # rows of a failed write: (row, written before)

    @property
    def open_count(self) -> int:
        return len(self._open)

    @property
    def changed(self) -> bool:
        """Incidents opened, grown or closed (or a failed write's) not yet taken."""
        return bool(self._dirty or self._retry)

    def add(self, rows: dict[str, list], now_ns: int) -> list[str | None]:
        """Merge one batch of anomaly rows ({column: list}, the anomalies table's columns) in order;
        returns each row's incident_id (None: not part of an incident)."""
        n = len(rows["kind"])
        ids: list[str | None] = [None] * n
        # in pass order: a detector batch lists its rows detector by detector, each in step order
        for i in sorted(range(n), key=rows["step_seq"].__getitem__):
            ids[i] = self._add_row({c: v[i] for c, v in rows.items()}, now_ns)
        return ids

    def _add_row(self, r: dict, now_ns: int) -> str | None:
        kind = r["kind"]
        pid, seq = int(r["pid"]), int(r["step_seq"])
        step = r.get("step")
        if kind in PASS_KINDS:
            return self._merge(("pass", pid), r, now_ns, scope="pass")
        first = r.get("first_step_seq")
        forced = r.get("pass_token")  # the lane says (it saw the batch); else: only step > 0 is certain
        if forced is None:
            forced = step is not None and step > 0 and first is not None and first == seq
        if forced:  # a token of a teacher-forced pass
            self.counters.pass_token_rows += 1
            found = self._passes.get((pid, seq))
            if found is not None:
                self.counters.linked_rows += 1
            return found
        row = r.get("batch_row")
        key = ("request", pid, r.get("trace_id"), first, row)
        return self._merge(key, r, now_ns, scope="request")

    def _merge(self, key: tuple, r: dict, now_ns: int, scope: str) -> str:
        pid, seq = int(r["pid"]), int(r["step_seq"])
        step = None if scope == "pass" or r.get("step") is None else int(r["step"])
        score = float(r["score"]) if r.get("score") is not None else float("nan")
        detail = _detail(r.get("detail"))
        t_end = detail.get("t_end_ns")
        incident = self._open.get(key)
        if incident is not None and seq - incident.last_seq > self.gap:
            self._close(key, now_ns)
            incident = None
        if incident is None:
            row = r.get("batch_row")
            suffix = "pass" if scope == "pass" else str(int(row or 0))
            incident = Incident(
                incident_id=f"{pid}-{seq}-{suffix}", pid=pid, scope=scope, trace_id=r.get("trace_id"),
                first_step_seq=seq if scope == "pass" else r.get("first_step_seq"),
                batch_row=None if scope == "pass" else row, first_seq=seq, last_seq=seq, first_step=step,
                last_step=step, t_first_ns=t_end, t_last_ns=t_end, peak_score=score, peak_seq=seq,
                peak_step=step, peak_kind=r["kind"], ts_ns=now_ns, updated_ns=now_ns,
            )  # fmt: skip
            self._open[key] = incident
            self.counters.opened += 1
            while len(self._open) > self.max_open:
                self._close(next(iter(self._open)), now_ns)
                self.counters.closed_early += 1
        else:
            self._open.move_to_end(key)
        if seq >= incident.last_seq:
            incident.last_seq, incident.t_last_ns = seq, t_end if t_end is not None else incident.t_last_ns
            if step is not None:
                incident.last_step = step if incident.last_step is None else max(step, incident.last_step)
        if not score <= incident.peak_score:  # a higher score (or the first real one after a NaN)
            incident.peak_score, incident.peak_seq, incident.peak_step = score, seq, step
            incident.peak_kind = r["kind"]
        incident.detectors.add(r.get("detector") or r["kind"])
        incident.rows += 1
        if scope == "pass":
            incident.tokens += int(detail.get("tokens") or 0)  # a step verdict flags its whole pass
            incident.artifact = r.get("artifact") or incident.artifact
            self._passes[(pid, seq)] = incident.incident_id
            while len(self._passes) > RECENT_PASSES:
                self._passes.popitem(last=False)
        else:
            token = (seq, step)
            if token not in incident._steps:
                incident._steps.add(token)
                incident.tokens += 1
                if len(incident._steps) > 4096:  # a runaway incident: keep the newest tokens' keys only
                    incident._steps = {t for t in incident._steps if t[0] >= seq - 1024}
        incident.updated_ns = now_ns
        self._dirty[incident.incident_id] = incident
        self.counters.linked_rows += 1
        return incident.incident_id

    def close_through(self, scope: str, scored_seq: int | None, now_ns: int) -> int:
        """Close the open incidents of `scope` that no row can join any more: the detectors have scored
        every pass of the process up to `scored_seq` (None: unknown, nothing closed). One builder per
        process (the pipeline's). Returns how many."""
        if scored_seq is None:
            return 0
        done = [k for k, inc in self._open.items()
                if inc.scope == scope and scored_seq - inc.last_seq > self.gap]  # fmt: skip
        for key in done:
            self._close(key, now_ns)
        return len(done)

    def close_all(self, now_ns: int) -> int:
        """Every open incident closed (the pipeline is closing: nothing more will come)."""
        keys = list(self._open)
        for key in keys:
            self._close(key, now_ns)
        return len(keys)

    def _close(self, key: tuple, now_ns: int) -> None:
        incident = self._open.pop(key)
        incident.state, incident.closed_ns, incident.updated_ns = "closed", now_ns, now_ns
        self._dirty[incident.incident_id] = incident
        self.counters.closed += 1

    def ready(self, now_ns: int, open_every_ns: int | None = None) -> bool:
        """Whether `take_changed(now_ns, open_every_ns)` has anything to give."""
        if self._retry:
            return True
        return any(self._due(incident, now_ns, open_every_ns) for incident in self._dirty.values())

    @staticmethod
    def _due(incident: Incident, now_ns: int, open_every_ns: int | None) -> bool:
        if incident.state == "closed" or open_every_ns is None:
            return True
        return now_ns - max(incident.ts_ns, incident.written_ns) >= open_every_ns

    def take_changed(
        self, now_ns: int = 0, open_every_ns: int | None = None
    ) -> tuple[list[dict], list[dict]]:
        """The incidents opened, grown or closed since the last call, each once, as rows: (new: never
        written, to INSERT; updated: written before, to UPDATE), with those of a failed write (`restore`)
        not changed since. With `open_every_ns`, an open incident is taken only once it has been open
        (or unwritten) that long: a closed incident is final and written once, where rewriting a growing
        one at every commit cost a statement each time; a long one still shows while it lasts."""
        retry, self._retry = self._retry, {}
        changed: dict[str, Incident] = {}
        for incident_id, incident in list(self._dirty.items()):
            if self._due(incident, now_ns, open_every_ns):
                changed[incident_id] = self._dirty.pop(incident_id)
        new: dict[str, dict] = {}
        updated: dict[str, dict] = {}
        for incident_id, (row, written) in retry.items():
            (updated if written else new)[incident_id] = row
        for incident_id, incident in changed.items():
            row = incident.row()
            if incident_id in new or not incident.written:
                new[incident_id] = row
            else:
                updated[incident_id] = row
            incident.written, incident.written_ns = True, now_ns
        return list(new.values()), list(updated.values())

    def restore(self, new: list[dict], updated: list[dict] = ()) -> None:
        """Rows `take_changed` gave whose write failed: written with the next one (a newer state of the
        same incident supersedes them)."""
        for rows, written in ((new, False), (updated, True)):
            for row in rows:
                self._retry.setdefault(row["incident_id"], (row, written))


def _detail(text) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
