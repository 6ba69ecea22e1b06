/* Shared definitions of the llmobs probe programs: the event record, the maps every program uses,
 * and the tag / sample / record helpers. Included once, before the NAME.bpf.c programs, by the
 * unit the agent assembles (agent/llmobs/bpf/program.py); user space mirrors the structs in
 * agent/llmobs/bpf/records.py (a unit test checks the two agree). */
#ifndef LLMOBS_EVENTS_H
#define LLMOBS_EVENTS_H

#include <uapi/linux/ptrace.h>
#include "llmobs_abi.h"

#ifndef LLMOBS_RING_BYTES
#define LLMOBS_RING_BYTES (16 << 20)
#endif
#ifndef LLMOBS_AGG_ENTRIES
#define LLMOBS_AGG_ENTRIES 65536
#endif

#define LLMOBS_KIND_MEM 0
#define LLMOBS_KIND_GPU 1
#define LLMOBS_KIND_HOST 2
#define LLMOBS_KIND_COMPUTE 3

#define LLMOBS_FLAG_TRACKED 1 /* the process has a context cell and it was read */
#define LLMOBS_FLAG_TORN 2    /* the cell's seq stayed odd: tag may mix two steps */
#define LLMOBS_FLAG_THREAD 4  /* the tag is the thread's own (its OTEP 4947 record), not the cell's */

#define LLMOBS_SAMPLE_TRACE 0
#define LLMOBS_SAMPLE_CPU 1

/* indices of llmobs_counters */
#define LLMOBS_CTR_RING_DROPS 0   /* bpf_ringbuf_reserve failed: a sample lost in the kernel */
#define LLMOBS_CTR_AGG_OVERFLOW 1 /* llmobs_aggs full: an event not counted in the aggregates */
#define LLMOBS_CTR_CTX_FAULTS 2   /* the context cell could not be read (page not present) */
#define LLMOBS_CTR_TORN 3         /* the cell's seq was odd twice in a row */
#define LLMOBS_CTR_START_LOST 4  /* an interval's start slot was taken by another thread, or a map full */
#define LLMOBS_CTR_SAMPLED 5      /* events submitted to the ring */
#define LLMOBS_CTR_THINNED 6      /* kept by the sampler, not shipped: a thinned probe's others (below) */
#define LLMOBS_NUM_COUNTERS 8

/* One sampled event as it sits in the ring (64 bytes, no padding). */
struct llmobs_event {
    u32 pid;
    u32 tid;
    u32 cpu;
    u16 probe;  /* index into the agent's probe table */
    u8 kind;    /* LLMOBS_KIND_* */
    u8 flags;   /* LLMOBS_FLAG_* */
    u64 ts_ns;  /* bpf_ktime_get_ns(): CLOCK_MONOTONIC; for intervals, the start */
    u64 step_seq;
    u64 trace_id_hi;
    u64 trace_id_lo;
    u64 value;  /* bytes for alloc/free/memcpy, flops for GEMM, see docs/probes.md */
    u64 duration_ns;
};

struct llmobs_agg_key {
    u32 pid;
    u32 probe;
    u64 step_seq;
};

struct llmobs_agg_val {
    u64 count;
    u64 sum_value;
    u64 sum_duration_ns;
};

/* The (trace id, step) a probe read from the target's context cell. */
struct llmobs_tag {
    u64 step_seq;
    u64 trace_id_hi;
    u64 trace_id_lo;
    u32 flags;
    u32 pad;
};

/* An interval opened at a call entry or a switch-out, closed by the return or switch-in. */
struct llmobs_start {
    u64 ts_ns; /* 0: the slot is free */
    u64 value;
    struct llmobs_tag tag;
    u32 pid;
    u32 tid;   /* the owner of the slot: checked at the close, slots are shared by hashing */
    u32 probe;
    u32 epoch; /* the probe's word when opened: a close under another word (shed since) records nothing */
};

/* A target process and the address of its context cell in its own address space (0: no map, its
 * events are untracked). An array slot rather than a hash entry: the host tracepoints ask "is this a
 * target?" on every event of every process, and an array lookup is the cheapest answer. */
#define LLMOBS_TARGET_SLOTS 4096
struct llmobs_target {
    u32 pid;
    u32 pad;
    u64 cell;
    u64 threads; /* llmobs_thread_ctx_registry in the target (shm/c/otel_thread_ctx.c); 0: none */
};

/* The thread-context library's registry: slot tid % 1024 = (tid, address of that thread's record). */
#define LLMOBS_THREAD_SLOTS 1024

/* The sampling knobs, set by the agent. */
struct llmobs_config {
    u64 sample_n; /* N of the 1/N sampling (0 or 1 keeps everything) */
    u64 mode;     /* LLMOBS_SAMPLE_* */
    u64 thin;     /* the thinned probes ship 1 in `thin` of their tagged events (0 or 1: every one) */
};

/* Start slots: (thread, probe) hashed into an array, not a hash map, because an array lookup costs
 * a few ns where a hash update + lookup + delete costs ~150 ns, on every timed hit. Two threads
 * whose (tid, probe) share a slot lose that interval, counted in LLMOBS_CTR_START_LOST. */
#define LLMOBS_START_SLOTS (1 << 17)
static __always_inline u32 llmobs_slot(u32 tid, u32 probe)
{
    return ((tid << 6) ^ probe) & (LLMOBS_START_SLOTS - 1);
}

/* The target processes, in slot tgid % LLMOBS_TARGET_SLOTS: pid and context-cell address. */
BPF_ARRAY(llmobs_targets, struct llmobs_target, LLMOBS_TARGET_SLOTS);
/* The sampling knobs: one entry, struct llmobs_config. */
BPF_ARRAY(llmobs_config, struct llmobs_config, 1);
/* A plain hash, preallocated: a key is new once per (pid, probe, step), which for a probe hit once a
 * step (the tiny model's one linear layer; the first launch of each decode step) is every hit. Measured
 * in a real workload (bench/governor's tiny target, bpf_stats): a new key cost 56-58 us in the per-CPU
 * hash allocated per key it was before (the per-CPU allocator; +9.4% CPU per token from the one linear
 * probe), ~2.3 us preallocated. Not a preallocated per-CPU hash: its kernel memory is entries x CPUs
 * (200 MB on a 128-CPU host) and its creation one per-CPU allocation per entry (+53 ms on 2 CPUs, on
 * the path to the first event). The adds are atomic: threads of one step on several CPUs share a key. */
/* Exact count / value sum / duration sum of ALL events per (pid, probe, step). */
BPF_F_TABLE("hash", struct llmobs_agg_key, struct llmobs_agg_val, llmobs_aggs, LLMOBS_AGG_ENTRIES, 0);
/* Loss and health counters, per CPU; indices LLMOBS_CTR_*. */
BPF_PERCPU_ARRAY(llmobs_counters, u64, LLMOBS_NUM_COUNTERS);
/* The per-CPU counter hashed by --sample-mode cpu. */
BPF_PERCPU_ARRAY(llmobs_sample_ctr, u64, 1);
/* Thinning (probes.thin, llmobs_config.thin): a probe hit many times a step whose tagged events are
 * counted exactly in llmobs_aggs (linear: 211 hits a SmolLM2 token; page faults: ~58,000 a second in a
 * teacher-forced pass) ships 1 in `thin` of its tagged events to the ring; the agent reads the step's
 * totals from the aggregates and gives each shipped event sample_ratio x thin. The other hits skip the
 * clock read and the ring (measured, bench.probes --only cost: a tagged linear hit 185 -> 124 ns, an empty
 * uprobe's program 41). Untagged events are never thinned: they are placed in a pass by their time. */
/* The per-CPU counter of the thinned probes' tagged hits: every thin-th one ships. */
BPF_PERCPU_ARRAY(llmobs_thin_ctr, u64, 1);
/* Open intervals (timed calls, off-CPU), in slots hashed from (thread, probe): start time and tag. */
BPF_ARRAY(llmobs_call_start, struct llmobs_start, LLMOBS_START_SLOTS);
/* Live CPU allocations: pointer -> size, so free_cpu events carry the bytes they release. */
BPF_HASH(llmobs_live_allocs, u64, u64, 262144);
/* Sampled events to user space; submitted without wake-up, drained by the agent every ~20 ms. */
BPF_RINGBUF_OUTPUT(llmobs_events, LLMOBS_RING_BYTES / 4096);
/* The governor's switch words (below): probe ids are below this (tests/unit checks PROBES fits). */
#define LLMOBS_MAX_PROBES 64
#define LLMOBS_WORD_OFF 1
/* The governor's switch of each probe, by probe id (ProbeProgram.set_probe_enabled): even = on, odd =
 * off. Every change bumps the word, so it is an epoch too: an interval opened before a shed is never
 * closed after the re-enable with the off period as its duration. Zero at load: every probe on. Every
 * program reads it first thing: an array lookup the verifier inlines (no helper call), so a hit of a
 * shed probe costs its dispatch and a few instructions (docs/probes.md, measured). */
/* The switch words: one u32 per probe id. */
BPF_ARRAY(llmobs_probe_words, u32, LLMOBS_MAX_PROBES);

/* The switch word of `probe` (llmobs_probe_words); `word & LLMOBS_WORD_OFF`: the probe is shed. */
static __always_inline u32 llmobs_word(u32 probe)
{
    u32 *word = llmobs_probe_words.lookup(&probe);
    return word ? *word : 0;
}

static __always_inline void llmobs_count(u32 index)
{
    u64 *slot = llmobs_counters.lookup(&index);
    if (slot)
        *slot += 1;
}

/* splitmix64's finaliser: user space reproduces it (records.sample_hash) to predict trace keeps. */
static __always_inline u64 llmobs_mix64(u64 x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* The current thread's own tag, from its OTEP 4947 Thread-Local Context Record (found through the
 * library's registry, by tid): the trace id, and step_seq from the record's first attribute, which the
 * writer always puts first (key 1, decimal). Returns 1 when the thread has a record (valid: its step;
 * invalid: no step now, step_seq 0), 0 when it has none (the caller reads the process cell).
 * span_id: where the valid record's span id goes (its 8 bytes as a little-endian u64), or a constant 0
 * (every probe but thread_span): always inlined, the store is compiled out of those handlers. */
static __always_inline int llmobs_read_thread_tag(u64 registry, struct llmobs_tag *tag, u64 *span_id)
{
    struct {
        u32 tid;
        u32 pad;
        u64 record;
    } slot;
    struct {
        u8 trace_id[16];
        u8 span_id[8];
        u8 valid;
        u8 trace_flags;
        u16 attrs_size;
        u8 key;
        u8 len;
        u8 digits[20];
    } __attribute__((packed)) rec;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 seq = 0, hi, lo;

    if (bpf_probe_read_user(&slot, sizeof(slot), (void *)(registry + (u64)(tid & (LLMOBS_THREAD_SLOTS - 1)) * 16)))
        return 0;
    if (slot.tid != tid || slot.record == 0)
        return 0;
    if (bpf_probe_read_user(&rec, sizeof(rec), (void *)slot.record))
        return 0;
    tag->flags |= LLMOBS_FLAG_TRACKED | LLMOBS_FLAG_THREAD;
    if (rec.valid != 1 || rec.key != 1 || rec.len == 0 || rec.len > 20 || rec.attrs_size < 2 + rec.len)
        return 1; /* detached (between requests): this thread runs no step */
#pragma unroll
    for (int i = 0; i < 20; i++) {
        if (i < rec.len) {
            u8 c = rec.digits[i];
            if (c < '0' || c > '9')
                return 1;
            seq = seq * 10 + (c - '0');
        }
    }
    __builtin_memcpy(&hi, rec.trace_id, 8);
    __builtin_memcpy(&lo, rec.trace_id + 8, 8);
    if (span_id)
        __builtin_memcpy(span_id, rec.span_id, 8);
    tag->step_seq = seq;
    tag->trace_id_hi = __builtin_bswap64(hi); /* W3C bytes are big-endian; the cell's words are not */
    tag->trace_id_lo = __builtin_bswap64(lo);
    return 1;
}

/* Reads (trace id, step) of process tgid: the current thread's own record when it has one, else the
 * process's context cell. Returns -1 when tgid is not a target. span_id: as llmobs_read_thread_tag's
 * (left alone when the tag comes from the cell, which holds no span id). */
static __always_inline int llmobs_read_tag_span(u32 tgid, struct llmobs_tag *tag, u64 *span_id)
{
    struct {
        u64 seq;
        u64 trace_id_hi;
        u64 trace_id_lo;
        u64 step_seq;
    } cell;
    u32 index = tgid & (LLMOBS_TARGET_SLOTS - 1);
    struct llmobs_target *target = llmobs_targets.lookup(&index);

    __builtin_memset(tag, 0, sizeof(*tag));
    if (!target || target->pid != tgid || tgid == 0)
        return -1;
    if (target->cell == 0)
        return 0;
    if (target->threads && llmobs_read_thread_tag(target->threads, tag, span_id))
        return 0;
    if (bpf_probe_read_user(&cell, sizeof(cell), (void *)target->cell)) {
        llmobs_count(LLMOBS_CTR_CTX_FAULTS);
        return 0;
    }
    if (cell.seq & 1) {
        /* the writer is mid-update: one re-read; its update is a handful of stores */
        if (bpf_probe_read_user(&cell, sizeof(cell), (void *)target->cell) == 0 && (cell.seq & 1)) {
            llmobs_count(LLMOBS_CTR_TORN);
            tag->flags |= LLMOBS_FLAG_TORN;
        }
    }
    tag->step_seq = cell.step_seq;
    tag->trace_id_hi = cell.trace_id_hi;
    tag->trace_id_lo = cell.trace_id_lo;
    tag->flags |= LLMOBS_FLAG_TRACKED;
    return 0;
}

/* The tag alone: what every probe but thread_span reads. */
static __always_inline int llmobs_read_tag(u32 tgid, struct llmobs_tag *tag)
{
    return llmobs_read_tag_span(tgid, tag, 0);
}

/* The 1/N decision: by trace id (a request kept whole or not at all), else by a per-CPU counter. */
static __always_inline int llmobs_keep(struct llmobs_config *config, struct llmobs_tag *tag)
{
    u32 zero = 0;
    u64 *ctr;

    if (!config || config->sample_n <= 1)
        return 1;
    if (config->mode == LLMOBS_SAMPLE_TRACE && (tag->trace_id_hi | tag->trace_id_lo))
        return llmobs_mix64(tag->trace_id_hi ^ llmobs_mix64(tag->trace_id_lo)) % config->sample_n == 0;
    /* cpu mode, and untracked events in trace mode (they have no trace to keep whole) */
    ctr = llmobs_sample_ctr.lookup(&zero);
    if (!ctr)
        return 1;
    *ctr += 1;
    return llmobs_mix64(*ctr ^ ((u64)bpf_get_smp_processor_id() << 48)) % config->sample_n == 0;
}

/* Thinning's decision for a kept tagged event of a thinned probe: every config->thin-th of this CPU's. */
static __always_inline int llmobs_thin_keep(struct llmobs_config *config)
{
    u32 zero = 0;
    u64 *ctr;

    if (!config || config->thin <= 1)
        return 1;
    ctr = llmobs_thin_ctr.lookup(&zero);
    if (!ctr)
        return 1;
    return (*ctr)++ % config->thin == 0;
}

/* Counts the event exactly in llmobs_aggs, then ships it to the ring if the sampler keeps it.
 * ts_ns 0 means "now": read only for a kept event, since a clock read costs ~75 ns a hit here.
 * sum_value: what the aggregate adds up (value, but for thread_span, whose value is an id, not a
 * quantity: 0, so a sum of ids never overflows the store's signed sum_value). thin: a constant, 1 for
 * the thinned probes (their tagged events ship 1 in config->thin), else 0 (compiled out). */
static __always_inline void llmobs_record_as(u32 pid, u32 tid, u16 probe, u8 kind, struct llmobs_tag *tag,
                                             u64 ts_ns, u64 value, u64 sum_value, u64 duration_ns, int thin)
{
    struct llmobs_agg_key key = {.pid = pid, .probe = probe, .step_seq = tag->step_seq};
    struct llmobs_agg_val *agg = llmobs_aggs.lookup(&key);
    u32 zero = 0;
    struct llmobs_config *config = llmobs_config.lookup(&zero);
    struct llmobs_event *ev;

    if (!agg) {
        struct llmobs_agg_val zero = {};
        llmobs_aggs.insert(&key, &zero); /* BPF_NOEXIST: another CPU's new entry is never zeroed */
        agg = llmobs_aggs.lookup(&key);
    }
    if (agg) {
        __sync_fetch_and_add(&agg->count, 1);
        if (sum_value)
            __sync_fetch_and_add(&agg->sum_value, sum_value);
        if (duration_ns)
            __sync_fetch_and_add(&agg->sum_duration_ns, duration_ns);
    } else {
        llmobs_count(LLMOBS_CTR_AGG_OVERFLOW);
    }

    if (!llmobs_keep(config, tag))
        return;
    if (thin && tag->step_seq && !llmobs_thin_keep(config)) {
        llmobs_count(LLMOBS_CTR_THINNED);
        return;
    }
    ev = llmobs_events.ringbuf_reserve(sizeof(*ev));
    if (!ev) {
        llmobs_count(LLMOBS_CTR_RING_DROPS);
        return;
    }
    ev->pid = pid;
    ev->tid = tid;
    ev->cpu = bpf_get_smp_processor_id();
    ev->probe = probe;
    ev->kind = kind;
    ev->flags = tag->flags;
    ev->ts_ns = ts_ns ? ts_ns : bpf_ktime_get_ns();
    ev->step_seq = tag->step_seq;
    ev->trace_id_hi = tag->trace_id_hi;
    ev->trace_id_lo = tag->trace_id_lo;
    ev->value = value;
    ev->duration_ns = duration_ns;
    llmobs_events.ringbuf_submit(ev, BPF_RB_NO_WAKEUP);
    llmobs_count(LLMOBS_CTR_SAMPLED);
}

/* llmobs_record_as with the value summed: every probe but thread_span. */
static __always_inline void llmobs_record(u32 pid, u32 tid, u16 probe, u8 kind, struct llmobs_tag *tag,
                                          u64 ts_ns, u64 value, u64 duration_ns)
{
    llmobs_record_as(pid, tid, probe, kind, tag, ts_ns, value, value, duration_ns, 0);
}

/* A point event of the current thread: tag, count, sample (thin: as llmobs_record_as's). */
static __always_inline void llmobs_point_as(u16 probe, u8 kind, u64 value, int thin)
{
    u64 id = bpf_get_current_pid_tgid();
    struct llmobs_tag tag;

    if (llmobs_read_tag(id >> 32, &tag) < 0)
        return;
    llmobs_record_as(id >> 32, (u32)id, probe, kind, &tag, 0, value, value, 0, thin);
}

/* A point event of the current thread, every one shipped that the sampler keeps. */
static __always_inline void llmobs_point(u16 probe, u8 kind, u64 value)
{
    llmobs_point_as(probe, kind, value, 0);
}

/* Opens an interval for (thread tid of process pid, probe) with this tag. Returns the slot or NULL. */
static __always_inline struct llmobs_start *llmobs_open(u32 pid, u32 tid, u16 probe, u64 ts_ns, u64 value,
                                                        struct llmobs_tag *tag, u32 word)
{
    u32 index = llmobs_slot(tid, probe);
    struct llmobs_start *slot = llmobs_call_start.lookup(&index);

    if (!slot)
        return 0;
    if (slot->ts_ns && (slot->tid != tid || slot->probe != probe))
        llmobs_count(LLMOBS_CTR_START_LOST); /* another thread's open interval: it loses its duration */
    slot->ts_ns = ts_ns;
    slot->value = value;
    slot->tag = *tag;
    slot->pid = pid;
    slot->tid = tid;
    slot->probe = probe;
    slot->epoch = word;
    return slot;
}

/* Closes the interval of (tid, probe), if this thread owns the slot: records it with its duration,
 * unless the probe's word changed since it was opened (shed and re-enabled: the slot is just freed). */
static __always_inline struct llmobs_start *llmobs_close(u32 tid, u16 probe, u8 kind, u64 now, u32 word)
{
    u32 index = llmobs_slot(tid, probe);
    struct llmobs_start *slot = llmobs_call_start.lookup(&index);

    if (!slot || !slot->ts_ns || slot->tid != tid || slot->probe != probe)
        return 0;
    if (slot->epoch != word) {
        slot->ts_ns = 0;
        return 0;
    }
    llmobs_record(slot->pid, tid, probe, kind, &slot->tag, slot->ts_ns, slot->value, now - slot->ts_ns);
    slot->ts_ns = 0;
    return slot;
}

/* Opens an interval for (current thread, probe) under its switch word (the caller read it and found the
 * probe on): remembers time, value and tag. */
static __always_inline void llmobs_call_enter(u16 probe, u64 value, u32 word)
{
    u64 id = bpf_get_current_pid_tgid();
    struct llmobs_tag tag;

    if (llmobs_read_tag(id >> 32, &tag) < 0)
        return;
    llmobs_open(id >> 32, (u32)id, probe, bpf_ktime_get_ns(), value, &tag, word);
}

/* Closes the interval opened by llmobs_call_enter and records it with its duration (nothing while the
 * probe is shed). */
static __always_inline void llmobs_call_return(u16 probe, u8 kind)
{
    u32 word = llmobs_word(probe);

    if (word & LLMOBS_WORD_OFF)
        return;
    llmobs_close((u32)bpf_get_current_pid_tgid(), probe, kind, bpf_ktime_get_ns(), word);
}

/* First thing in a program: its probe is shed (the governor switched it off): return at once. */
#define LLMOBS_RETURN_IF_OFF(probe)                                                                      \
    if (llmobs_word(probe) & LLMOBS_WORD_OFF)                                                          \
        return 0;

#endif
