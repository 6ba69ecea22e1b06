"""Training-step loss spikes, seen by the agent, and the dL/dE heatmap that goes with each.

A training step (one forward with labels: a step_seq whose token steps span several positions of a
row) is scored by its mean token loss against the preceding window of step means of the same process,
with the token-loss detectors' own statistics (llmobs.diagnostics.detectors.score_sequence: one-sided
t-test and median/MAD), MAD by default. The token-level detectors cannot see this fault: a corrupted
batch raises every token of its requests at once, so no token stands out from its own request.
Flagged steps stay out of later windows, so one bad batch does not hide the next.

On a spike the monitor (a thread of its own, never the pipeline's poll) asks the workload for the
last 5 dL/dE slices up to that step (control command CMD_DUMP_GRADIENTS, llmobs.publisher.training),
waits for the ack (bounded), renders the heatmap PNG from the .npz the workload wrote next to its map
(llmobs.diagnostics.heatmap), removes the .npz (tmpfs), and writes the anomaly row (kind
`train_loss_spike`) with `artifact` = the PNG path. Without an answer (no training mode, workload gone,
timeout) the row is written all the same, artifact NULL and the reason in `detail`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmobs import clock
from llmobs.diagnostics.detectors import DetectorConfig, _score_scalar, live_traffic, score_sequence
from llmobs.shm import layout

KIND = "train_loss_spike"
ACK_TIMEOUT_S = 5.0  # the workload answers at its next step boundary: one training step
MAX_QUEUED = 8  # spikes awaiting their dump; more are written without a heatmap (counted)
STATS = ("median", "mad", "z", "t", "p", "n")  # a verdict's statistics (a flagged step's row detail)


@dataclass
class StepSpike:
    """One flagged training step and the numbers behind the verdict."""

    step_seq: int
    mean_loss: float
    tokens: int
    trace_id: str  # the request (batch row) with the highest mean loss in the step
    batch_row: int
    median: float
    mad: float
    z: float
    t: float
    p: float
    n: int
    ts_ns: int

    def detail(self, extra: dict | None = None) -> str:
        body = {
            "step_mean_loss": round(self.mean_loss, 5), "tokens": self.tokens, "window_n": self.n,
            "window_median": round(self.median, 5), "window_mad": round(self.mad, 5),
            "z": round(self.z, 3), "t": round(self.t, 3), "p": float(f"{self.p:.3g}"),
        }  # fmt: skip
        body.update(extra or {})
        return json.dumps(body, sort_keys=True)


class StepSpikeDetector:
    """Streaming: step mean losses in step_seq order -> StepSpike for the flagged ones."""

    def __init__(self, config: DetectorConfig | None = None):
        self.config = config or DetectorConfig(detector="mad", window=16, min_history=8, mad_threshold=6.0)
        self.history: list[float] = []  # step means of unflagged steps, newest last (<= window)

    def score(self, mean_loss: float) -> tuple[bool, dict]:
        """Verdict and statistics of one step mean against the window before it. The verdict comes from
        the detectors' Python-float path (detectors._score_scalar: score_sequence's verdict to the bit,
        without its ~0.9 ms of numpy set-up, which a teacher-forced workload paid every pass); a flagged
        step's statistics from score_sequence itself, whose p is exact where the fast path's is not."""
        window = self.history[-self.config.window :]
        quick = _score_scalar(window, [mean_loss], len(window), self.config)
        if not any(quick.flagged(d)[0] for d in self.config.enabled):
            self.history.append(mean_loss)
            del self.history[: -self.config.window]
            return False, {k: float(getattr(quick, k)[0]) for k in STATS}
        scores = score_sequence(np.array([*window, mean_loss]), self.config)
        return True, {k: float(getattr(scores, k)[-1]) for k in STATS}


def step_means(steps: dict) -> list[tuple[int, float, int, str, int]]:
    """(step_seq, mean loss, tokens, trace id and batch row of its worst row) of each training step in
    a token-step batch: step_seqs with more than one token per row (teacher-forced), finite losses.
    Decode steps (one token per row) are told apart with two np.unique passes, so an inference
    workload's batches cost the monitor no per-step Python loop."""
    seqs = np.asarray(steps["step_seq"], np.int64)
    rows = np.asarray(steps["batch_row"], np.int64)
    packed = (seqs << 24) | (rows & 0xFFFFFF)  # one value per (step_seq, row); rows < 2^24
    # A training step has some (step_seq, row) more than once; none has: decode steps only, the
    # common case, told in one pass (a set for the few steps of a live poll, else one np.unique).
    distinct = len(set(packed.tolist())) if len(packed) <= 64 else len(np.unique(packed))
    if distinct == len(packed):
        return []
    uniq, counts = np.unique(seqs, return_counts=True)
    pairs = np.unique(packed)
    rows_per_step = np.unique(pairs >> 24, return_counts=True)[1]
    training = uniq[counts > rows_per_step]
    if not len(training):
        return []
    loss = np.asarray(steps["loss"], np.float64)
    out = []
    for seq in training:
        at = (seqs == seq) & np.isfinite(loss)
        if not at.any():
            continue
        row_ids = rows[at]
        row_means = {int(r): float(loss[at][row_ids == r].mean()) for r in np.unique(row_ids)}
        worst = max(row_means, key=row_means.get)
        index = int(np.flatnonzero(at & (rows == worst))[0])
        out.append((int(seq), float(loss[at].mean()), int(at.sum()), str(steps["trace_id"][index]), worst))
    return out


class TrainingMonitor:
    """Per pid: scores training steps as the pipeline hands them over; heatmaps and rows in a thread.

    `submit(batch)` hands a {table: columns} batch to the store (the pipeline's fan-out)."""

    def __init__(self, pid: int, submit, artifacts_dir: str | Path, shm_dir: str = layout.SHM_DIR,
                 detector: StepSpikeDetector | None = None, ack_timeout_s=ACK_TIMEOUT_S):  # fmt: skip
        self.pid = pid
        self.submit = submit
        self.artifacts_dir = Path(artifacts_dir)
        self.shm_dir = shm_dir
        self.detector = detector or StepSpikeDetector()
        self.ack_timeout_s = ack_timeout_s
        self.spikes = 0
        self.heatmaps = 0
        self.skipped = 0  # spikes written without a heatmap because the queue was full
        self.last_error: str | None = None
        self._last_seq = 0
        self._in_flight = 0  # spikes scored whose row is not submitted yet (their heatmap pending)
        self._in_flight_lock = threading.Lock()  # two threads change it (scoring, the heatmap thread)
        self._pending: tuple[int, list] | None = None  # the newest step: more of its tokens may come
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUED)
        self._thread: threading.Thread | None = None

    # --- scoring (the pipeline's thread) -------------------------------------------------------------
    def add_steps(self, steps: dict) -> None:
        """Token-step columns as read from the map; a step is scored once a later step has arrived
        (a step's records are published together but a read may catch half of them)."""
        try:
            steps = live_traffic(steps)  # a shadow pass is not a training step (detectors.live_traffic)
            parts = step_means(steps) if len(steps["step_seq"]) else []
        except Exception as exc:  # never break the pipeline
            self.last_error = f"training monitor: {exc}"
            return
        for part in parts:
            if part[0] <= self._last_seq:
                continue
            if self._pending is not None and self._pending[0] != part[0]:
                self._score(self._pending[1])
            self._pending = (part[0], list(part))
        # parts of the pending step from a later batch would be a re-read: the ring is read once

    def scored_through(self) -> int | None:
        """The last training step whose verdict is settled, row submitted if it was a spike (None while
        a spike's row is still on its way): the incidents' progress (llmobs.diagnostics.incidents).
        `_last_seq` is set before a spike counts as in flight, so a reader may see a step settled
        whose spike is not: that step is the newest, beyond any incident it could have closed."""
        return None if self._in_flight else self._last_seq or None

    def flush(self) -> None:
        """Score the step held back (at close: no later step will come)."""
        if self._pending is not None:
            self._score(self._pending[1])
            self._pending = None

    def _score(self, part: list) -> None:
        seq, mean, tokens, trace, row = part
        self._last_seq = seq
        flagged, s = self.detector.score(mean)
        if not flagged:
            return
        spike = StepSpike(seq, mean, tokens, trace, row, s["median"], s["mad"], s["z"], s["t"], s["p"],
                          int(s["n"]), clock.monotonic_ns())  # fmt: skip
        self.spikes += 1
        with self._in_flight_lock:
            self._in_flight += 1
        self._start()
        try:
            self._queue.put_nowait(spike)
        except queue.Full:
            self.skipped += 1
            self._write_row(spike, None, {"heatmap": "skipped: too many spikes queued"})

    # --- heatmaps (the monitor's thread) -------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llmobs-train-heatmap", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            spike = self._queue.get()
            if spike is None:
                return
            try:
                artifact, why = self._heatmap(spike)
            except Exception as exc:  # a failed heatmap still leaves the anomaly row
                artifact, why = None, f"failed: {exc}"
                self.last_error = f"heatmap: {exc}"
            self._write_row(spike, artifact, {"heatmap": why} if why else None)

    def _heatmap(self, spike: StepSpike) -> tuple[str | None, str | None]:
        from llmobs.diagnostics.heatmap import render_npz
        from llmobs.errors import LlmobsError
        from llmobs.shm.control import ControlClient
        from llmobs.shm.names import dump_path

        try:
            client = ControlClient(self.pid, self.shm_dir)
        except LlmobsError as exc:
            return None, f"no map: {exc}"
        with client:
            seq = client.post(layout.CMD_DUMP_GRADIENTS, spike.step_seq)
            ack = client.wait_ack(seq, self.ack_timeout_s)
            if ack is None:
                return None, f"the workload did not answer within {self.ack_timeout_s:g} s"
            if ack["ack_status"] != layout.ACK_OK:
                return None, f"the workload answered status {ack['ack_status']} (training mode off?)"
            npz = dump_path(client.path, ack["ack_step_seq"])
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        png = self.artifacts_dir / f"dLdE-pid{self.pid}-step{spike.step_seq}.png"
        try:
            render_npz(npz, png, title=f"dL/dE, pid {self.pid}, loss spike at step_seq {spike.step_seq}")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(npz)
        self.heatmaps += 1
        return str(png), None

    def _write_row(self, spike: StepSpike, artifact: str | None, extra: dict | None) -> None:
        try:
            self._submit_row(spike, artifact, extra)
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1  # after the submit: the row is queued before the step counts as settled

    def _submit_row(self, spike: StepSpike, artifact: str | None, extra: dict | None) -> None:
        self.submit({
            "anomalies": {
                "ts_ns": np.array([spike.ts_ns], np.int64), "pid": np.array([self.pid], np.int32),
                "step_seq": np.array([spike.step_seq], np.int64), "trace_id": [spike.trace_id],
                "kind": [KIND], "score": np.array([spike.z], np.float64), "detail": [spike.detail(extra)],
                "batch_row": np.array([spike.batch_row], np.int32), "detector": ["step_mad"],
                "artifact": [artifact],
            }
        })  # fmt: skip

    def close(self, timeout: float = 10.0) -> None:
        """Score the last step, finish the queued heatmaps (bounded), stop the thread."""
        self.flush()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)


def artifacts_dir_for(db_path) -> Path:
    """Where the heatmaps of a store go: `<db>.artifacts/` beside the DuckDB file."""
    text = str(db_path)
    if not text or text == ":memory:":
        import tempfile

        return Path(tempfile.gettempdir()) / "llmobs.artifacts"
    return Path(f"{text}.artifacts")
