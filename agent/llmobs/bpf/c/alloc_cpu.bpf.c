/* mem profile: c10::alloc_cpu(size_t nbytes) -> void*, every CPU tensor storage allocation.
 * Timed (entry + return): the return gives the pointer, remembered with its size for free_cpu. */

/* uprobe at c10::alloc_cpu (its first instruction, push %rbp, is emulated): open the interval. */
int uprobe__alloc_cpu(struct pt_regs *ctx)
{
    u32 word = llmobs_word(LLMOBS_PROBE_alloc_cpu);

    if (word & LLMOBS_WORD_OFF)
        return 0;
    llmobs_call_enter(LLMOBS_PROBE_alloc_cpu, PT_REGS_PARM1(ctx), word);
    return 0;
}

/* uretprobe of c10::alloc_cpu: record the allocation, remember pointer -> size for free_cpu. */
int uretprobe__alloc_cpu(struct pt_regs *ctx)
{
    u64 ptr = PT_REGS_RC(ctx);
    u32 word = llmobs_word(LLMOBS_PROBE_alloc_cpu);
    struct llmobs_start *slot;

    if (word & LLMOBS_WORD_OFF)
        return 0;
    slot = llmobs_close((u32)bpf_get_current_pid_tgid(), LLMOBS_PROBE_alloc_cpu, LLMOBS_KIND_MEM,
                        bpf_ktime_get_ns(), word);
    if (slot && ptr && llmobs_live_allocs.update(&ptr, &slot->value))
        llmobs_count(LLMOBS_CTR_START_LOST);
    return 0;
}
