/* PLACEHOLDER until the [shm-map] generator replaces it: this file will be generated from
 * agent/llmobs/shm/layout.py and must keep these names. Do not hand-edit after that. */
#ifndef LLMOBS_ABI_H
#define LLMOBS_ABI_H

#define LLMOBS_ABI_VERSION 1
/* byte offset of the current-context cell from the start of the /dev/shm/llmobs.<pid> mapping */
#define LLMOBS_CTX_OFFSET 256

/* The current-context cell: the words the eBPF probes read with bpf_probe_read_user.
 * seq is a seqlock counter: odd while the writer is updating the cell. */
struct llmobs_ctx_cell {
    __u64 seq;
    __u64 trace_id_hi;   /* trace id bytes 0..7, big-endian as in the W3C hex form */
    __u64 trace_id_lo;   /* trace id bytes 8..15 */
    __u64 step_seq;      /* process-global token-step sequence number, 0 = no step yet */
    __u64 tenant_hash;
    __u64 session_hash;
    __u64 reserved[2];
};

#endif
