/* cpu profile: at::_ops::linear::call, the op every nn.Linear / F.linear goes through (one call per
 * linear layer: 211 per SmolLM2 token, vs 751 BLAS sgemm_ calls that include attention's matmuls).
 * The default compute probe: cheap enough for the 3% budget. value = 0 (the shapes live in C++
 * Tensor objects; the `gemm` profile's sgemm probe carries flops). */

/* uprobe at at::_ops::linear::call (its first instruction, push %rbp, is emulated): count and sample. */
int uprobe__linear(struct pt_regs *ctx)
{
    LLMOBS_RETURN_IF_OFF(LLMOBS_PROBE_linear);
    llmobs_point(LLMOBS_PROBE_linear, LLMOBS_KIND_COMPUTE, 0);
    return 0;
}
