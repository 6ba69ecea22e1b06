/* mem profile: c10::free_cpu(void *ptr), the release of a CPU tensor storage. value = the bytes
 * alloc_cpu gave that pointer (0 when it was allocated before the attach). */

/* uprobe at c10::free_cpu (a tail jmp to free, emulated): record the release with its size. */
int uprobe__free_cpu(struct pt_regs *ctx)
{
    u64 ptr = PT_REGS_PARM1(ctx);
    u64 *size;
    u64 bytes = 0;

    LLMOBS_RETURN_IF_OFF(LLMOBS_PROBE_free_cpu);
    if (!ptr)
        return 0;
    size = llmobs_live_allocs.lookup(&ptr);
    if (size) {
        bytes = *size;
        llmobs_live_allocs.delete(&ptr);
    }
    llmobs_point(LLMOBS_PROBE_free_cpu, LLMOBS_KIND_MEM, bytes);
    return 0;
}
