"""Per-token metrics computed on the logits' own device with a few torch ops (no host sync).

The result is the record's 7-word "device block": float32 loss, entropy, target_prob, top1_prob, then
the int32 bits of target_rank, token_id and target_id, so one copy_ moves a whole step into the map.

The loss comes from torch.log_softmax, the kernel F.cross_entropy itself uses, so the two agree to
float32 rounding (a log-sum-exp of our own differs by up to ~1e-5 on a 49k vocabulary: the float32
sum's own error). The other passes over the vocabulary are kept few, because on a CPU the logits are
usually cold in cache after the forward pass:
  lp = log_softmax(x);  loss = -lp[t];  target_prob = exp(lp[t]);  top1_prob = exp(max lp)
  entropy = -sum(exp(lp) * lp);  target_rank = #{lp > lp[t]} (counted as floats, exact below 2^24)

On a CPU, many rows at once (a teacher-forced pass: one row per target position, 80 x 49,152 logits)
are computed a few rows at a time (CPU_CHUNK_BYTES of logits per intra-op thread) in two chunk buffers
the thread keeps: each pass above makes a temporary as big as its input, and at 16 MB apiece glibc maps
and unmaps them on every call. Measured on SmolLM2's 80-position pass, in situ (the publisher's hook
CPU after each forward, the two versions alternating in one process: bench/device_math.py): 15,296 page
faults and 23.2 ms a call at 1 thread (10% of the pass), 13.7 ms at 2 threads; chunked, no fault, the
passes over cache-hot rows, 7.5 / 4.5 ms (the entropy's product in place, below, included).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

# Logits a CPU chunk holds per intra-op thread (torch splits each pass of a chunk between them): the
# chunk's rows stay in each core's L2 (2 MiB here). SmolLM2's 80 rows, measured (temporaries per chunk,
# before the kept buffers): 1 thread 7.0 ms at 1 MiB, 8.9 at 2 MiB; 2 threads 4.6 ms at 1 MiB, 3.8 at 2.
CPU_CHUNK_BYTES = 1 << 20
CPU_CHUNK_THREADS = 4  # a chunk grows with the threads up to this many (then past any L2 there is)


class Prepared(NamedTuple):
    """Stage 1 of the metrics, everything that needs no target: computed while the logits are hot in
    cache (right after the forward pass), before the target is known."""

    x: torch.Tensor
    lp: torch.Tensor
    top1: torch.Tensor
    neg_entropy: torch.Tensor


def prepare(logits: torch.Tensor) -> Prepared:
    """logits [N, V] -> the target-independent passes over the vocabulary. Many rows on a CPU (a serving
    pass, a batch): chunk by chunk, the log-softmax rows into a buffer of this thread's pool, which
    device_block gives back once it has used them."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > 1 and x.numel() * 4 >= POOL_MIN_BYTES:
        return _cpu_chunked_prepare(x, _cpu_chunk_rows(x) or x.shape[0])
    # exp(lp) . lp as an in-place product and a sum: 1.6 ms for SmolLM2's 80 rows, linalg.vecdot 2.8 ms
    return _prepared_from(x, torch.log_softmax(x, -1))


def device_block(
    logits: torch.Tensor | Prepared,
    targets: torch.Tensor | None,
    token_ids: torch.Tensor | None = None,
    *,
    all_valid: bool = False,
) -> torch.Tensor:
    """logits [N, V] (or prepare(logits)); targets [N] int (-100 or any negative = no target) or None;
    token_ids [N] or None (None: the target when there is one, else the arg-max). all_valid promises
    no ignored target (generate's chosen tokens), which saves a few ops. Returns float32 [N, 7]."""
    tgt = None if targets is None else targets.view(-1, 1)
    index = None if tgt is None else (tgt if all_valid else tgt.clamp(min=0))  # a gather index per row
    want_argmax = targets is None and token_ids is None
    rows = _cpu_chunk_rows(logits)
    if not rows:
        block = _assemble(*_vocab_passes(logits, index, want_argmax), tgt, token_ids, all_valid)
        if isinstance(logits, Prepared):
            _give_back(logits.lp)  # nothing of the block refers to it: the pool may lend it again
        return block
    return _assemble(*_cpu_chunked_passes(logits, index, want_argmax, rows), tgt, token_ids, all_valid)


def labelled_block(
    x: torch.Tensor, targets: torch.Tensor, token_ids: torch.Tensor, log_softmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """device_block of a teacher-forced pass's rows (x [N, V], targets [N] with negatives ignored), and
    the log-softmax of every row: the one the model's cross-entropy would compute again for its loss
    (publisher/shared_loss.py takes it from here). The log-softmax is a buffer of this thread's pool:
    give it back with `release` once the loss is read from it. Or the caller gives `log_softmax` (of x,
    computed with autograd for a training pass's loss; not modified) and the block is computed from it."""
    tgt = targets.view(-1, 1)
    index = tgt.clamp(min=0)
    rows = _cpu_chunk_rows(x)
    if rows:
        lp = _lend(x.numel()).view(x.shape) if log_softmax is None else log_softmax
        passes = _cpu_chunked_passes(x, index, False, rows, lp_out=lp, lp_known=log_softmax is not None)
    else:
        prepared = prepare(x) if log_softmax is None else _prepared_from(x, log_softmax)
        lp = prepared.lp
        passes = _vocab_passes(prepared, index, False)
    return _assemble(*passes, tgt, token_ids, False), lp


def release(lp: torch.Tensor) -> None:
    """A log-softmax labelled_block lent, back to the pool (nothing when it was not lent)."""
    _give_back(lp)


def _cpu_chunk_rows(logits) -> int:
    """Rows per chunk where chunking pays (raw logits on a CPU, more rows than one chunk), else 0."""
    if isinstance(logits, Prepared) or logits.device.type != "cpu" or logits.dim() != 2:
        return 0
    chunk = CPU_CHUNK_BYTES * min(max(torch.get_num_threads(), 1), CPU_CHUNK_THREADS)
    rows = max(chunk // max(logits.shape[1] * logits.element_size(), 1), 1)
    return rows if logits.shape[0] > rows else 0


def _cpu_chunked_passes(x: torch.Tensor, index, want_argmax: bool, rows: int, lp_out=None, lp_known=False):
    """_vocab_passes over a CPU tensor `rows` rows at a time, every pass writing into the thread's two
    chunk buffers and the [N, 1] columns: no allocation per chunk. (Per-chunk temporaries measured
    6,522 page faults a call in one process and none in another: glibc's heap after small tensors
    are held between large ones is not something to rely on.) lp_out [N, V]: each chunk's log-softmax
    is written there instead, kept for the caller; with lp_known it is there already (not computed)."""
    n = x.shape[0]
    lp_all, work = _chunk_buffers(rows, x.shape[1])
    top1, neg_entropy = torch.empty(n, 1), torch.empty(n, 1)
    lpt, rank = (None, None) if index is None else (torch.empty(n, 1), torch.empty(n, 1))
    for i in range(0, n, rows):
        j = min(i + rows, n)
        lp = lp_all[: j - i] if lp_out is None else lp_out[i:j]
        tmp = work[: j - i]
        chunk = x[i:j] if x.dtype == torch.float32 else tmp.copy_(x[i:j])  # bf16/fp16 logits: as float32
        if lp_known:
            _top1_and_entropy(lp, tmp, top1[i:j], neg_entropy[i:j])
        else:
            _chunk_stats(chunk, lp, tmp, top1[i:j], neg_entropy[i:j])
        if index is None:
            continue
        torch.gather(lp, -1, index[i:j], out=lpt[i:j])
        if bool((lpt[i:j] >= top1[i:j]).all()):
            rank[i:j] = 0  # every target is a top token (greedy): no pass over V needed
        else:
            torch.sum(torch.sub(lp, lpt[i:j], out=tmp).gt_(0), -1, keepdim=True, out=rank[i:j])
    return top1, neg_entropy, lpt, rank, x.argmax(-1, keepdim=True) if want_argmax else None


def _log_softmax_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """log_softmax(x, -1) written into `out`: through aten's out= variant where this torch has it (the
    kernel torch.log_softmax runs), else computed and copied (one temporary)."""
    if _LOG_SOFTMAX_OUT:
        torch._log_softmax(x, -1, False, out=out)
    else:
        out.copy_(torch.log_softmax(x, -1))


_LOG_SOFTMAX_OUT = hasattr(torch, "_log_softmax")


def _cpu_chunked_prepare(x: torch.Tensor, rows: int) -> Prepared:
    n, vocab = x.shape
    lp = _lend(n * vocab).view(n, vocab)
    top1, neg_entropy = torch.empty(n, 1), torch.empty(n, 1)
    _, work = _chunk_buffers(rows, vocab)
    for i in range(0, n, rows):
        j = min(i + rows, n)
        _chunk_stats(x[i:j], lp[i:j], work[: j - i], top1[i:j], neg_entropy[i:j])
    return Prepared(x, lp, top1, neg_entropy)


def _chunk_stats(x, lp, work, top1, neg_entropy) -> None:
    """One chunk's target-free passes, every one written into the given buffers: lp = log_softmax(x),
    top1 = max lp, neg_entropy = sum(exp(lp) * lp) (`work` holds the product; it may be x itself)."""
    _log_softmax_into(x, lp)
    _top1_and_entropy(lp, work, top1, neg_entropy)


def _top1_and_entropy(lp, work, top1, neg_entropy) -> None:
    torch.amax(lp, -1, keepdim=True, out=top1)
    torch.sum(torch.exp(lp, out=work).mul_(lp), -1, keepdim=True, out=neg_entropy)


def _prepared_from(x: torch.Tensor, lp: torch.Tensor) -> Prepared:
    """prepare()'s passes over a log-softmax computed elsewhere (one pass, not in chunks)."""
    return Prepared(x, lp, lp.amax(-1, keepdim=True), lp.exp().mul_(lp).sum(-1, keepdim=True))


# Log-softmax buffers a thread's prepare() lends (a Prepared holds its rows until its tokens are chosen,
# in the next step's forward or at the pass's end) and device_block takes back once it has used them. A
# buffer is never lent twice at a time (a server with two passes in flight has two); the pool keeps at
# most POOL_FREE free and remembers the last MAX_LENT lent, so a Prepared dropped unconsumed (or given back
# in another thread) costs at most that much held memory, and a forgotten one is simply not taken back.
POOL_FREE = 1
MAX_LENT = 2
# From this size on (glibc's default mmap threshold) a pass's temporaries are pages faulted in afresh on
# every call: a serving pass of 8 rows of a 49k vocabulary made 630-736 faults a call in a fresh process
# (none in one whose heap had grown, as a server's has: there it gains 0.82-1.03x, bench/device_math).
POOL_MIN_BYTES = 128 << 10
_buffers = threading.local()  # per thread: a server's threads may each publish at once


def _pool() -> tuple[list, dict]:
    if not hasattr(_buffers, "free"):
        _buffers.free, _buffers.lent = [], {}
    return _buffers.free, _buffers.lent


def _lend(numel: int) -> torch.Tensor:
    free, lent = _pool()
    buffer = next((b for b in free if b.numel() >= numel), None)  # a pass may have fewer rows than the last
    if buffer is not None:
        free.remove(buffer)
    else:
        buffer = torch.empty(numel)
    while len(lent) >= MAX_LENT:  # the oldest was never given back: forget it (its Prepared frees it)
        del lent[next(iter(lent))]
    lent[buffer.data_ptr()] = buffer  # held: its address is ours while remembered
    return buffer[:numel]


def _give_back(lp: torch.Tensor) -> None:
    """lp's buffer back to the pool, when it is one this thread lent and remembers (else nothing)."""
    free, lent = _pool()
    buffer = lent.pop(lp.data_ptr(), None)
    if buffer is not None and len(free) < POOL_FREE:
        free.append(buffer)


def _chunk_buffers(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's two float32 [rows, vocab] chunk buffers (at most 2 x CPU_CHUNK_BYTES x
    CPU_CHUNK_THREADS bytes, kept for the next call: fresh ones would be faulted in every time)."""
    held = getattr(_buffers, "pair", None)
    if held is None or held[0].numel() < rows * vocab:
        held = (torch.empty(rows * vocab), torch.empty(rows * vocab))
        _buffers.pair = held
    return held[0][: rows * vocab].view(rows, vocab), held[1][: rows * vocab].view(rows, vocab)


def _vocab_passes(logits, index, want_argmax: bool):
    """The passes over the vocabulary: (top1, neg_entropy, lpt, rank, argmax), each [N, 1] or None.
    index: [N, 1] gather indices (targets clamped to >= 0), or None without targets."""
    x, lp, top1, neg_entropy = logits if isinstance(logits, Prepared) else prepare(logits)
    lpt = rank = None
    if index is not None:
        lpt = lp.gather(-1, index)
        if not x.is_cuda and bool((lpt >= top1).all()):
            rank = torch.zeros_like(top1)  # every target is a top token (greedy): no pass over V needed
        else:  # (on CUDA never branch on device values: that would be a host sync)
            rank = torch.sub(lp, lpt).gt_(0).sum(-1, keepdim=True)
    return top1, neg_entropy, lpt, rank, x.argmax(-1, keepdim=True) if want_argmax else None


def _assemble(top1, neg_entropy, lpt, rank, argmax, tgt, token_ids, all_valid: bool) -> torch.Tensor:
    """The [N, 7] block from the per-row columns the passes gave."""
    if tgt is None:
        nan = torch.full_like(top1, float("nan"))
        floats = torch.cat([nan, neg_entropy.neg(), nan, top1.exp()], -1)
        rank = target32 = torch.full_like(top1, -1, dtype=torch.int32)
        tokens = argmax if token_ids is None else token_ids.view(-1, 1)
    else:
        target32 = tgt
        if not all_valid:
            valid = tgt >= 0
            lpt = lpt.masked_fill(~valid, float("nan"))  # NaN loss and target_prob without a target
            rank = torch.where(valid, rank, -1.0)
            target32 = torch.where(valid, tgt, -1)
        floats = torch.cat([torch.cat([lpt, neg_entropy], -1).neg_(), torch.cat([lpt, top1], -1).exp_()], -1)
        target32 = target32.to(torch.int32)
        tokens = target32 if token_ids is None else token_ids.view(-1, 1)
    ints = torch.cat([rank.to(torch.int32), tokens.to(torch.int32), target32], -1)  # .to: no-op when int32
    return torch.cat([floats, ints.view(torch.float32)], -1)
