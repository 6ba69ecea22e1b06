/* cpu profile: at::_ops::linear::call, the op every nn.Linear / F.linear goes through (one call per
 * linear layer: 211 per SmolLM2 token, vs 751 BLAS sgemm_ calls that include attention's matmuls).
 * The default compute probe: cheap enough for the 3% budget. value = 0 (the shapes live in C++
 * Tensor objects; the `gemm` profile's sgemm probe carries flops). Thinned: every call is counted in the
 * step's aggregates, 1 in probes.thin of a step's calls is shipped (llmobs_events.h). */

/* uprobe at at::_ops::linear::call (its first instruction, push %rbp, is emulated): count and sample. */
int uprobe__linear(struct pt_regs *ctx)
{
    LLMOBS_RETURN_IF_OFF(LLMOBS_PROBE_linear);
    llmobs_point_as(LLMOBS_PROBE_linear, LLMOBS_KIND_COMPUTE, 0, 1);
    return 0;
}
