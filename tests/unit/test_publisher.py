"""The in-process publisher: metric math, instrument() on a real (tiny) GPT-2, request(), contexts,
fork and exit behaviour, and the OTEL_CTX process context."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import llmobs
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from llmobs.publisher.device_math import device_block
from llmobs.shm import writer as writer_module
from llmobs.shm.reader import ShmReader

ROOT = Path(__file__).resolve().parents[2]


def _hash(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).digest()[:16].hex()


@pytest.fixture
def shm(tmp_path):
    writer_module.reset_writer()
    writer_module.configure(shm_dir=str(tmp_path), steps_capacity=4096)
    yield tmp_path
    writer_module.reset_writer()
    writer_module._writer_options.clear()


@pytest.fixture(scope="module")
def tiny():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def _read_all(tmp_path):
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        return r.read_steps(0)


def test_device_block_matches_independent_math():
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    targets = torch.tensor([3, -100, 7, 49, 0, -100])
    block = device_block(logits, targets)
    f, ints = block[:, :4], block[:, 4:].contiguous().view(torch.int32)
    valid = targets >= 0
    ce = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
    assert torch.allclose(f[valid, 0], ce[valid], atol=1e-5) and torch.isnan(f[~valid, 0]).all()
    p = logits.softmax(-1)
    assert torch.allclose(f[:, 1], -(p * p.log()).sum(-1), atol=1e-5)
    assert torch.allclose(f[valid, 2], p[valid].gather(1, targets[valid, None])[:, 0], atol=1e-6)
    assert torch.isnan(f[~valid, 2]).all()
    assert torch.allclose(f[:, 3], p.max(-1).values, atol=1e-6)
    ranks = (logits > logits.gather(1, targets.clamp(min=0)[:, None])).sum(-1)
    assert ints[valid, 0].tolist() == ranks[valid].tolist() and (ints[~valid, 0] == -1).all()
    assert ints[:, 2].tolist() == [3, -1, 7, 49, 0, -1]
    untargeted = device_block(logits, None)[:, 4:].contiguous().view(torch.int32)
    assert untargeted[:, 1].tolist() == logits.argmax(-1).tolist() and (untargeted[:, 2] == -1).all()


@pytest.mark.parametrize("out_variant", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("targets", [None, [3, -100, 7, 49, 0, -100, 12], [3, 1, 7, 49, 0, 2, 12]])
def test_device_block_in_cpu_chunks_equals_one_pass(monkeypatch, targets, dtype, out_variant):
    """Many rows on a CPU are computed a few rows at a time (device_math.CPU_CHUNK_BYTES) in buffers the
    thread keeps: each row's block is the one-pass block's, the rows in order, a short last chunk
    included, bf16 logits too, and where torch has no out= log_softmax."""
    from llmobs.publisher import device_math

    monkeypatch.setattr(device_math, "_LOG_SOFTMAX_OUT", out_variant)

    torch.manual_seed(2)
    logits = (torch.randn(7, 50) * 3).to(dtype)
    target = None if targets is None else torch.tensor(targets)
    tokens = torch.arange(7) + 100
    whole = device_block(logits, target, tokens)  # 1,400 bytes: one chunk
    monkeypatch.setattr(device_math, "CPU_CHUNK_BYTES", 3 * 50 * logits.element_size())  # 3 + 3 + 1 rows
    monkeypatch.setattr(device_math, "CPU_CHUNK_THREADS", 1)  # however many threads torch runs
    assert device_math._cpu_chunk_rows(logits) == 3
    chunked = device_block(logits, target, tokens)
    assert chunked.shape == whole.shape == (7, 7)
    f, g = whole[:, :4], chunked[:, :4]
    assert torch.allclose(f, g, atol=1e-6, equal_nan=True) and torch.equal(f.isnan(), g.isnan())
    assert torch.equal(
        whole[:, 4:].contiguous().view(torch.int32), chunked[:, 4:].contiguous().view(torch.int32)
    )


def test_cpu_chunk_buffers_follow_the_vocabulary(monkeypatch):
    """The thread's chunk buffers are made again when a wider vocabulary needs more than they hold."""
    from llmobs.publisher import device_math

    monkeypatch.setattr(device_math, "CPU_CHUNK_THREADS", 1)
    torch.manual_seed(3)
    for vocab in (30, 90, 40):
        logits, targets = torch.randn(5, vocab) * 3, torch.randint(0, vocab, (5,))
        whole = device_block(logits, targets)
        monkeypatch.setattr(device_math, "CPU_CHUNK_BYTES", 2 * vocab * 4)  # 2 + 2 + 1 rows
        chunked = device_block(logits, targets)
        monkeypatch.setattr(device_math, "CPU_CHUNK_BYTES", 1 << 20)
        assert torch.allclose(whole[:, :4], chunked[:, :4], atol=1e-6)
        assert torch.equal(*(block[:, 4:].contiguous().view(torch.int32) for block in (whole, chunked)))


def test_prepare_in_cpu_chunks_lends_and_takes_back_its_buffers(monkeypatch):
    """prepare() of many rows on a CPU (a serving pass) computes in chunks into a buffer of the thread's
    pool: its blocks equal the one-pass ones, two Prepareds in flight never share a buffer, and a buffer
    device_block has used is lent again."""
    from llmobs.publisher import device_math

    torch.manual_seed(4)
    xs = [torch.randn(7, 50) * 3 for _ in range(3)]
    targets = [torch.randint(0, 50, (7,)) for _ in range(3)]
    expected = [device_block(device_math.prepare(x), t) for x, t in zip(xs, targets, strict=True)]
    monkeypatch.setattr(device_math, "CPU_CHUNK_THREADS", 1)
    monkeypatch.setattr(device_math, "CPU_CHUNK_BYTES", 3 * 50 * 4)  # 3 + 3 + 1 rows
    monkeypatch.setattr(device_math, "POOL_MIN_BYTES", 0)

    def same(got, want) -> bool:
        ints = [block[:, 4:].contiguous().view(torch.int32) for block in (got, want)]
        return torch.allclose(got[:, :4], want[:, :4], atol=1e-6) and torch.equal(*ints)

    first, second = device_math.prepare(xs[0]), device_math.prepare(xs[1])  # two passes in flight
    assert first.lp.data_ptr() != second.lp.data_ptr()
    assert same(device_block(first, targets[0]), expected[0])
    third = device_math.prepare(xs[2])
    assert third.lp.data_ptr() == first.lp.data_ptr()  # the used buffer, lent again
    assert same(device_block(second, targets[1]), expected[1])  # not overwritten by the third
    assert same(device_block(third, targets[2]), expected[2])


def test_generate_publishes_every_decoded_token(shm, tiny):
    inst = llmobs.instrument(tiny, model_id="tiny-gpt2")
    try:
        captured = []
        hook = tiny.register_forward_hook(lambda m, a, o: captured.append(o.logits[:, -1].detach().clone()))
        prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
        with llmobs.context(tenant="acme", session="chat-1"):
            out = tiny.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                min_new_tokens=5, do_sample=False, pad_token_id=0)  # fmt: skip
        hook.remove()
    finally:
        inst.remove()
    b = _read_all(shm)
    assert (len(b), b.lost, b.corrupt) == (10, 0, 0)
    cols = b.columns
    chosen = out[:, 4:]
    for row in b.rows():
        r, step = row["batch_row"], row["step"]
        assert row["trace_id"] == _hash(prompt[r].tolist())
        assert row["token_id"] == row["target_id"] == int(chosen[r, step])
        assert row["position"] == 4 + step and row["kv_len"] == (0 if step == 0 else 3 + step)
        expect = F.cross_entropy(captured[step][r : r + 1], chosen[r, step : step + 1]).item()
        assert abs(row["loss"] - expect) < 1e-5 and row["target_rank"] == 0  # greedy: always the top token
        assert row["tenant"] == "acme" and row["session"] == "chat-1" and row["model_id"] == "tiny-gpt2"
    assert sorted(set(cols["step_seq"])) == [1, 2, 3, 4, 5]  # one step_seq per forward, shared by the rows
    assert (cols["latency_ns"] > 0).all()
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        assert r.context()["step_seq"] == 0  # untracked again after generate()


def test_forward_with_labels_publishes_every_target(shm, tiny):
    llmobs.instrument(tiny, model_id="tiny-gpt2").remove()  # remove() restores the model
    assert "generate" not in tiny.__dict__
    inst = llmobs.instrument(tiny, model_id="tiny-gpt2")
    try:
        ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
        labels = ids.clone()
        labels[0, :3] = -100  # prompt tokens ignored
        with torch.no_grad():
            out = tiny(input_ids=ids, labels=labels)
    finally:
        inst.remove()
    b = _read_all(shm)
    assert len(b) == 10 and b.corrupt == 0
    cols = b.columns
    loss = np.asarray(cols["loss"])
    valid = ~np.isnan(loss)
    assert valid.sum() == 8 and abs(loss[valid].mean() - out.loss.item()) < 1e-5
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1), reduction="none")
    assert np.allclose(loss[valid], ce[labels[:, 1:].reshape(-1) >= 0].numpy(), atol=1e-5)
    assert list(cols["position"][:5]) == [1, 2, 3, 4, 5] and list(cols["target_id"][:3]) == [-1, -1, 4]
    assert set(cols["trace_id"]) == {_hash(ids[0].tolist()), _hash(ids[1].tolist())}


def test_request_api_and_context_isolation_across_threads(shm):
    errors = []

    def worker(name: str):
        try:
            # the request is created inside the context block, so it sees this thread's tenant
            with (
                llmobs.context(tenant=f"tenant-{name}", session=f"s-{name}"),
                llmobs.request([ord(name)]) as req,
            ):
                for i in range(20):
                    req.begin_step()
                    req.step(torch.randn(1, 16), target_ids=[i % 16])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    b = _read_all(shm)
    assert len(b) == 60 and b.corrupt == 0
    for row in b.rows():
        name = row["tenant"].split("-")[1]
        assert row["session"] == f"s-{name}" and row["trace_id"] == _hash([ord(name)])
    assert sorted(b.columns["step_seq"].tolist()) == list(range(1, 61))  # process-global, never shared
    assert llmobs.publisher.request.errors == 0


def test_request_without_explicit_begin_step_and_bad_input_never_raises(shm):
    with llmobs.request([1, 2, 3], tenant="t") as req:
        req.step(torch.randn(8), target_ids=2)  # 1-D logits, scalar target, implicit begin_step
        before = llmobs.publisher.request.errors
        with pytest.warns(UserWarning, match="could not be published"):
            llmobs.publisher.request._warned = False
            req.step("not a tensor")  # a broken call is counted, not raised into the workload
        assert llmobs.publisher.request.errors == before + 1
    b = _read_all(shm)
    assert len(b) == 1 and b.rows()[0]["target_id"] == 2 and b.rows()[0]["step"] == 0


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, LLMOBS_SHM_DIR=str(tmp_path))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_fork_child_gets_its_own_map_and_exit_removes_files(tmp_path):
    code = """
import os, sys, torch, llmobs
from llmobs.shm.writer import get_writer
with llmobs.request([1, 2]) as req:
    req.step(torch.randn(1, 8), target_ids=[1])
parent_map = get_writer().path
pid = os.fork()
if pid == 0:
    with llmobs.request([3, 4]) as req:
        req.step(torch.randn(1, 8), target_ids=[2])
    print("child", get_writer().path, flush=True)
    sys.exit(0)
os.waitpid(pid, 0)
from llmobs.shm.reader import ShmReader
b = ShmReader(os.getpid(), shm_dir=os.environ["LLMOBS_SHM_DIR"]).read_steps(0)
print("parent", parent_map, len(b), b.rows()[0]["target_id"], flush=True)
"""
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    child_map, parent = lines["child"], lines["parent"].split()
    assert child_map != parent[0] and parent[1:] == ["1", "1"]  # the child never wrote into the parent's map
    assert not os.listdir(tmp_path), "maps must be removed at exit (parent and child)"


def test_otel_process_context_is_published(tmp_path):
    code = """
import os, sys, llmobs, torch
from llmobs.shm.otel_ctx_reader import read_process_context
m = torch.nn.Linear(2, 2)
llmobs.instrument(m, model_id="demo-model")
maps = open(f"/proc/{os.getpid()}/maps").read()
print(repr([l for l in maps.splitlines() if "OTEL_CTX" in l]))
import json
print(json.dumps(read_process_context(os.getpid()).to_dict()))
"""
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    maps_line, context_line = proc.stdout.strip().splitlines()[-2:]
    assert "OTEL_CTX" in maps_line
    context = json.loads(context_line)
    assert (context["format"], context["status"]) == ("otep-4719", "ok")  # tests/unit/test_otel_context.py
    attrs = context["resource"]
    assert attrs["llmobs.model_id"] == "demo-model" and attrs["telemetry.sdk.name"] == "llmobs"
    assert (
        attrs["llmobs.shm.path"].endswith(f"llmobs.{attrs['process.pid']}") and attrs["service.instance.id"]
    )


def test_workload_script_ready_and_summary(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "workload.py"), "--model", "tiny", "--requests", "2",
         "--max-new-tokens", "3", "--batch", "2", "--tenant", "tx", "--ready-file", str(ready)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, LLMOBS_SHM_DIR=str(tmp_path)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tokens"] == 12 and summary["requests"] == 2
    assert json.loads(ready.read_text())["phase"] == "done"
    assert not (tmp_path / f"llmobs.{summary['pid']}").exists()


def test_active_lora_adapters_are_part_of_the_model_id(shm, tiny):
    # peft is not installed here: emulate what transformers' PEFT integration exposes on a model
    tiny._hf_peft_config_loaded = True
    tiny.active_adapters = lambda: ["sql-lora", "style"]
    inst = llmobs.instrument(tiny, model_id="tiny-gpt2")
    try:
        tiny.generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0
        )
    finally:
        inst.remove()
        del tiny._hf_peft_config_loaded, tiny.active_adapters
    b = _read_all(shm)
    assert set(b.columns["model_id"]) == {"tiny-gpt2+sql-lora,style"}
    from llmobs.publisher.hf import active_adapters

    assert active_adapters(tiny) == [] and active_adapters(object()) == []
