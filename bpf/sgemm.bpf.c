/* cpu profile: the CPU GEMM entry nn.Linear goes through on this torch build (MKL's Fortran-ABI
 * sgemm_, one call per linear layer; matmul/bmm reach it too). Timed: entry + return.
 * value = flops = 2*m*n*k, read from the pointer arguments. */

/* uprobe at sgemm_ (+4, past endbr64, on the emulated push): open the interval, compute the flops. */
int uprobe__sgemm(struct pt_regs *ctx)
{
    int m = 0, n = 0, k = 0;

    bpf_probe_read_user(&m, sizeof(m), (void *)PT_REGS_PARM3(ctx));
    bpf_probe_read_user(&n, sizeof(n), (void *)PT_REGS_PARM4(ctx));
    bpf_probe_read_user(&k, sizeof(k), (void *)PT_REGS_PARM5(ctx));
    llmobs_call_enter(LLMOBS_PROBE_sgemm, 2ULL * (u64)(u32)m * (u64)(u32)n * (u64)(u32)k);
    return 0;
}

/* uretprobe of sgemm_: close the interval and record the GEMM with its duration. */
int uretprobe__sgemm(struct pt_regs *ctx)
{
    llmobs_call_return(LLMOBS_PROBE_sgemm, LLMOBS_KIND_COMPUTE);
    return 0;
}
