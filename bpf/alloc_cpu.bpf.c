/* mem profile: c10::alloc_cpu(size_t nbytes) -> void*, every CPU tensor storage allocation.
 * Timed (entry + return): the return gives the pointer, remembered with its size for free_cpu. */

/* uprobe at c10::alloc_cpu (its first instruction, push %rbp, is emulated): open the interval. */
int uprobe__alloc_cpu(struct pt_regs *ctx)
{
    llmobs_call_enter(LLMOBS_PROBE_alloc_cpu, PT_REGS_PARM1(ctx));
    return 0;
}

/* uretprobe of c10::alloc_cpu: remember pointer -> size, record the allocation. */
int uretprobe__alloc_cpu(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct llmobs_call_key key = {.tid = (u32)id, .probe = LLMOBS_PROBE_alloc_cpu};
    struct llmobs_start *start = llmobs_call_start.lookup(&key);
    u64 ptr = PT_REGS_RC(ctx);

    if (!start)
        return 0;
    if (ptr && llmobs_live_allocs.update(&ptr, &start->value))
        llmobs_count(LLMOBS_CTR_START_OVERFLOW);
    llmobs_call_return(LLMOBS_PROBE_alloc_cpu, LLMOBS_KIND_MEM);
    return 0;
}
