"""Training mode (llmobs.publisher.training, llmobs.diagnostics.training/heatmap): the dL/dE device ring
holds the real gradients of the embeddings' output, wraps at 128 steps and hands back the last 5 in
order; the dump command answers through the real control block; a training-step spike found by the
agent's monitor becomes an anomaly row whose heatmap PNG exists and describes 5 panels of tokens x dims.

The tiny GPT-2 is trained here in-process for real (AdamW, backward), so the agent side (Pipeline +
TrainingMonitor thread) and the workload side (the loop driving the control block) share one process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import llmobs
import numpy as np
import pytest
import torch
from llmobs.diagnostics.heatmap import png_metadata, render
from llmobs.diagnostics.training import KIND, StepSpikeDetector, TrainingMonitor, step_means
from llmobs.pipeline import Pipeline
from llmobs.pipeline.sources import ShmSource
from llmobs.publisher.training import GradientRing, TrainingOptions, ring_shape
from llmobs.shm import layout
from llmobs.shm import writer as writer_module
from llmobs.shm.control import ControlClient
from llmobs.shm.names import dump_path
from llmobs.store.sink import DuckDBStore
from llmobs.workloads.train import batch_of
from publisher_fixtures import isolated_writer, tiny_gpt2


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


def _model():
    return tiny_gpt2(training=True)


class Loop:
    """A real training loop; `step()` runs one forward with labels, backward and optimizer step."""

    def __init__(self, model, batch=2, seq=8):
        self.model, self.batch, self.seq = model, batch, seq
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        self.generator = torch.Generator().manual_seed(1)
        self.n = 0

    def step(self, corrupt=False, keep_grad=False):
        ids = batch_of(self.n, self.batch, self.seq, corrupt, self.generator)
        captured = {}
        if keep_grad:  # an independent copy of dL/dE: retain_grad on the embedding output
            emb = self.model.get_input_embeddings()

            def grab(module, args, output):
                output.retain_grad()
                captured["e"] = output

            handle = emb.register_forward_hook(grab)
        out = self.model(ids, labels=ids)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        self.optimizer.step()
        if keep_grad:
            handle.remove()
        self.n += 1
        return writer_module.get_writer().step_seq, (captured["e"].grad.clone() if keep_grad else None)


def test_the_ring_holds_the_real_dl_de_wraps_at_128_and_returns_the_last_5_in_order(shm):
    model = _model()
    errors_before = llmobs.publisher.request.errors  # a process-wide counter: other tests may have counted
    inst = llmobs.instrument(model, model_id="tiny", training=True)
    loop = Loop(model)
    expected = {}
    for _ in range(140):
        seq, grad = loop.step(keep_grad=True)
        expected[seq] = grad
    ring = inst.training.ring
    inst.remove()
    assert ring.head == 140 and tuple(ring.data.shape) == (128, 2 * 8, 64)
    assert ring.data.dtype == torch.bfloat16 and ring.nbytes == 128 * 16 * 64 * 2
    # the oldest 12 steps were overwritten: the slots hold exactly step_seqs 13..140
    assert sorted(ring.step_seq.tolist()) == list(range(13, 141))
    last = ring.last(5)
    assert [int(ring.step_seq[s]) for s in last] == [136, 137, 138, 139, 140]
    assert [int(ring.step_seq[s]) for s in ring.last(5, upto_step_seq=100)] == [96, 97, 98, 99, 100]
    host = ring.host_slices(last)
    for i, s in enumerate(last):
        truth = expected[int(ring.step_seq[s])].reshape(-1, 64).float()
        scale = truth.abs().max().item()
        assert scale > 0
        np.testing.assert_allclose(host[i], truth.numpy(), atol=scale * 1e-2, rtol=1e-2)  # bf16 rounding
    assert llmobs.publisher.request.errors == errors_before


def test_ring_memory_is_capped_and_eval_steps_leave_it_alone(shm):
    options = TrainingOptions(max_tokens=64, max_bytes=1 << 20)
    assert ring_shape(options, tokens=8 * 1024, dims=4096, itemsize=2) == (128, 64, 64)  # 128*64*64*2 = 1 MiB
    assert ring_shape(TrainingOptions(), tokens=16, dims=64, itemsize=2) == (128, 16, 64)
    ring = GradientRing(TrainingOptions(steps=4, dump_steps=2))
    ring.write(1, torch.ones(1, 3, 5))
    ring.write(2, torch.full((1, 2, 5), 2.0))  # fewer tokens: the rest of the slot is zeroed
    assert ring.host_slices(ring.last(2))[1].tolist() == [[2.0] * 5] * 2 + [[0.0] * 5]
    with pytest.raises(ValueError):
        TrainingOptions(dump_steps=200)
    model = _model()
    inst = llmobs.instrument(model, model_id="tiny", training=True)
    with torch.no_grad():
        model(torch.randint(1, 256, (2, 8)), labels=torch.randint(1, 256, (2, 8)))
    assert inst.training.ring.head == 0 and inst.training.ring.data is None
    inst.remove()


def test_the_dump_command_is_answered_at_the_next_step_boundary(shm):
    model = _model()
    inst = llmobs.instrument(model, model_id="tiny", training=True)
    loop = Loop(model)
    seqs = [loop.step()[0] for _ in range(10)]
    with ControlClient(os.getpid(), str(shm)) as client:
        cmd = client.post(layout.CMD_DUMP_GRADIENTS, seqs[6])
        assert client.ack()["ack_seq"] < cmd  # nothing happens until the workload's next step
        loop.step()
        ack = client.wait_ack(cmd, timeout=1.0)
        path = dump_path(client.path, ack["ack_step_seq"])
    inst.remove()
    assert ack["ack_status"] == layout.ACK_OK
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    with np.load(path) as dump:
        assert dump["step_seq"].tolist() == seqs[2:7]
        assert dump["grads"].shape == (5, 16, 64) and dump["grads"].dtype == np.float32
        assert dump["tokens"].tolist() == [16] * 5 and np.abs(dump["grads"]).max() > 0


def _dump_status(shm) -> int:
    """The ack status of CMD_DUMP_GRADIENTS posted to this process, running without training mode."""
    model = _model()
    inst = llmobs.instrument(model, model_id="tiny")
    loop = Loop(model)
    loop.step()
    with ControlClient(os.getpid(), str(shm)) as client:
        cmd = client.post(layout.CMD_DUMP_GRADIENTS, 1)
        loop.step()
        ack = client.wait_ack(cmd, timeout=1.0)
    inst.remove()
    return ack["ack_status"]


def test_without_training_mode_the_dump_command_says_so(shm, monkeypatch):
    # docs/shm-abi.md, the control commands: "training mode off or no slice <= S: ACK_UNSUPPORTED (or
    # ACK_UNKNOWN_COMMAND in a process that never turned it on)". Which one this process is depends on
    # the tests before this one (the handler stays registered), so each state is set up and pinned.
    monkeypatch.setattr(writer_module, "_command_handlers", {})  # a process that never turned it on
    assert _dump_status(shm) == layout.ACK_UNKNOWN_COMMAND
    llmobs.instrument(_model(), model_id="tiny", training=True).remove()  # on, then off again
    assert _dump_status(shm) == layout.ACK_UNSUPPORTED


@pytest.mark.parametrize("detector", ["mad", "ttest", "both"])
def test_the_step_detector_gives_score_sequences_verdicts_and_a_flagged_steps_statistics(detector):
    """The verdict in Python floats is score_sequence's (the numpy pass over the window and the step) for
    every step of noisy series with spikes, flat stretches (MAD 0) and the warm-up; a flagged step's
    statistics are score_sequence's exactly (p included)."""
    from llmobs.diagnostics.detectors import DetectorConfig, score_sequence

    config = DetectorConfig(detector=detector, window=16, min_history=8, mad_threshold=6.0)
    rng = np.random.default_rng(7)
    series = np.concatenate([2.0 + 0.05 * rng.standard_normal(200), np.full(20, 1.5), 1.0 + rng.random(100)])
    series[[30, 31, 90, 150, 230, 300]] += [3.0, 2.5, 0.4, 8.0, 0.01, 1.5]
    fast, reference = StepSpikeDetector(config), []
    flags = 0
    for value in series:
        window = reference[-config.window :]
        scores = score_sequence(np.array([*window, value]), config)
        expected = any(bool(scores.flagged(d)[-1]) for d in config.enabled)
        flagged, stats = fast.score(float(value))
        assert flagged == expected, (len(reference), value)
        if flagged:
            flags += 1
            for name in ("median", "mad", "z", "t", "p", "n"):
                np.testing.assert_equal(stats[name], float(getattr(scores, name)[-1]), err_msg=name)
        else:
            reference.append(float(value))
            del reference[: -config.window]
        assert fast.history == reference
    assert flags >= 5  # the spikes, at least: the comparison saw both verdicts


def test_the_step_detector_flags_a_corrupted_batch_and_not_a_falling_loss():
    detector = StepSpikeDetector()
    falling = [5.5 * 0.97**i for i in range(60)]
    assert not any(detector.score(x)[0] for x in falling)
    flagged, stats = detector.score(6.0)
    assert flagged and stats["z"] > 6 and stats["n"] == 16
    assert not detector.score(falling[-1] * 0.99)[0]  # the spike stayed out of the window
    steps = {
        "step_seq": np.array([7, 7, 7, 7, 8, 8]), "batch_row": np.array([0, 0, 1, 1, 0, 1]),
        "loss": np.array([1.0, 3.0, 5.0, 7.0, 1.0, 1.0]), "trace_id": ["a", "a", "b", "b", "c", "d"],
    }  # fmt: skip
    assert step_means(steps) == [(7, 4.0, 4, "b", 1)]  # step 8 has one token per row: a decode step


def test_heatmap_png_has_one_panel_per_step(tmp_path):
    grads = np.random.default_rng(0).standard_normal((5, 12, 40)).astype(np.float32)
    path = render(grads, [5, 6, 7, 8, 9], tmp_path / "h.png", tokens=[12, 12, 10, 12, 12], title="t")
    meta = png_metadata(path)
    assert meta["llmobs:shape"] == "5x12x40" and meta["llmobs:step_seq"] == "5,6,7,8,9"
    assert int(meta["width"]) > 2 * int(meta["height"])  # five panels side by side
    with pytest.raises(ValueError):
        render(grads[0], [1], tmp_path / "bad.png")


def test_a_training_spike_becomes_an_anomaly_row_with_its_heatmap(shm, tmp_path):
    model = _model()
    inst = llmobs.instrument(model, model_id="tiny-train", training=True)
    loop = Loop(model, batch=4, seq=16)
    pid = os.getpid()
    db = tmp_path / "s.duckdb"
    pipeline = Pipeline(DuckDBStore(db), pid, owns_store=True, snapshot=False, shm=ShmSource(pid, str(shm)))
    artifacts = Path(f"{db}.artifacts")
    spike_step, spike_seq = 40, None
    deadline = time.monotonic() + 60
    while True:  # train on; the monitor's thread posts the command, the loop's next step answers it
        seq, _ = loop.step(corrupt=loop.n == spike_step)
        if loop.n - 1 == spike_step:
            spike_seq = seq
        pipeline.poll()
        if pipeline.training.heatmaps or pipeline.training.last_error:
            break
        assert time.monotonic() < deadline, "no heatmap within 60 s"
    pipeline.close()
    inst.remove()
    assert pipeline.training.last_error is None and pipeline.training.spikes == 1
    with DuckDBStore(db, read_only=True) as store:
        rows = store.connection.execute(
            "SELECT step_seq, kind, score, artifact, detail FROM anomalies WHERE kind = ?", [KIND]
        ).fetchall()
    assert len(rows) == 1
    step_seq, _, score, artifact, detail = rows[0]
    assert step_seq == spike_seq and score > 6
    assert Path(artifact).parent == artifacts and Path(artifact).exists()
    assert json.loads(detail)["step_mean_loss"] > 4
    meta = png_metadata(artifact)
    assert meta["llmobs:shape"] == "5x64x64"  # 5 steps x (4 rows x 16 tokens) x 64 dims
    assert meta["llmobs:step_seq"] == ",".join(str(s) for s in range(spike_seq - 4, spike_seq + 1))
    assert not list(Path(shm).glob("*.npz"))  # the dump was removed from tmpfs once rendered


def test_the_monitor_writes_the_row_without_heatmap_when_the_workload_cannot_answer(tmp_path):
    rows = []
    pid = os.getpid()
    monitor = TrainingMonitor(pid, rows.append, tmp_path / "a", shm_dir=str(tmp_path), ack_timeout_s=0.2)
    for seq in range(1, 30):
        loss = 9.0 if seq == 25 else 2.0 + 0.01 * (seq % 3)
        monitor.add_steps({"step_seq": np.array([seq, seq]), "batch_row": np.array([0, 0]),
                           "loss": np.array([loss, loss]), "trace_id": ["t", "t"]})  # fmt: skip
    monitor.close()
    assert monitor.spikes == 1 and len(rows) == 1
    row = rows[0]["anomalies"]
    assert row["step_seq"].tolist() == [25] and row["artifact"] == [None]
    assert "no map" in json.loads(row["detail"][0])["heatmap"]
