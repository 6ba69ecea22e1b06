/* cuda profile: one template for every libcuda / libcudart / libnccl call probe. The agent appends
 * one LLMOBS_CALL_TIMED or LLMOBS_CALL_POINT line per resolved symbol (see `attach --ebpf`), so the
 * entry points are named after their hook: uprobe__cuLaunchKernel, uretprobe__cuLaunchKernel, ...
 * VALUE is an expression over ctx: the byte-count argument for allocations and copies, else 0. */

/* A timed call: uprobe at entry opens the interval, uretprobe closes and records it. */
#define LLMOBS_CALL_TIMED(SYM, PROBE, KIND, VALUE)                                                    \
    int uprobe__##SYM(struct pt_regs *ctx)                                                              \
    {                                                                                                  \
        u32 word = llmobs_word(PROBE);                                                                 \
        if (word & LLMOBS_WORD_OFF)                                                                    \
            return 0;                                                                                  \
        llmobs_call_enter(PROBE, (VALUE), word);                                                       \
        return 0;                                                                                      \
    }                                                                                                  \
    int uretprobe__##SYM(struct pt_regs *ctx)                                                           \
    {                                                                                                  \
        llmobs_call_return(PROBE, KIND);                                                               \
        return 0;                                                                                      \
    }

/* A point call: one uprobe at entry records the call. */
#define LLMOBS_CALL_POINT(SYM, PROBE, KIND, VALUE)                                                    \
    int uprobe__##SYM(struct pt_regs *ctx)                                                              \
    {                                                                                                  \
        LLMOBS_RETURN_IF_OFF(PROBE);                                                                   \
        llmobs_point(PROBE, KIND, (VALUE));                                                            \
        return 0;                                                                                      \
    }
