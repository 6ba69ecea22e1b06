/* gemm profile: the CPU GEMM entry nn.Linear goes through on this torch build (MKL's Fortran-ABI
 * sgemm_, one call per linear layer; matmul/bmm reach it too). value = flops = 2*m*n*k, read from
 * the pointer arguments. By default a point event at entry; with `attach --gemm-durations` the
 * timed pair (uprobe__sgemm_timed + uretprobe__sgemm) instead, at about twice the cost per hit. */

static __always_inline u64 llmobs_sgemm_flops(struct pt_regs *ctx)
{
    int m = 0, n = 0, k = 0;

    bpf_probe_read_user(&m, sizeof(m), (void *)PT_REGS_PARM3(ctx));
    bpf_probe_read_user(&n, sizeof(n), (void *)PT_REGS_PARM4(ctx));
    bpf_probe_read_user(&k, sizeof(k), (void *)PT_REGS_PARM5(ctx));
    return 2ULL * (u64)(u32)m * (u64)(u32)n * (u64)(u32)k;
}

/* uprobe at sgemm_ (+4, past endbr64, on the emulated push): count and sample the GEMM. */
int uprobe__sgemm(struct pt_regs *ctx)
{
    LLMOBS_RETURN_IF_OFF(LLMOBS_PROBE_sgemm); /* before the argument reads */
    llmobs_point(LLMOBS_PROBE_sgemm, LLMOBS_KIND_COMPUTE, llmobs_sgemm_flops(ctx));
    return 0;
}

/* uprobe at sgemm_ (+4), timed variant: open the interval with the flops. */
int uprobe__sgemm_timed(struct pt_regs *ctx)
{
    u32 word = llmobs_word(LLMOBS_PROBE_sgemm);

    if (word & LLMOBS_WORD_OFF)
        return 0;
    llmobs_call_enter(LLMOBS_PROBE_sgemm, llmobs_sgemm_flops(ctx), word);
    return 0;
}

/* uretprobe of sgemm_, timed variant: close the interval, record the GEMM with its duration. */
int uretprobe__sgemm(struct pt_regs *ctx)
{
    llmobs_call_return(LLMOBS_PROBE_sgemm, LLMOBS_KIND_COMPUTE);
    return 0;
}
