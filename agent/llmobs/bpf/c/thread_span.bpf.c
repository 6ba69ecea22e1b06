/* threadctx profile (opt-in): the profiler-side read of OTEP 4947 (docs/probes.md). At each
 * at::_ops::linear::call, the op every nn.Linear of a token step goes through, the current thread's
 * Thread-Local Context Record is read the way every probe reads it (the thread-context library's
 * registry, by tid; llmobs_read_thread_tag) and the record's span id, the span id the OTLP export gives
 * that token step, travels in the event's value: its 8 bytes as a little-endian u64. A thread without a
 * valid record (no step now, or no library) gives value 0 and the cell's tag. Its aggregates count
 * hits and sum nothing (an id is no quantity). Off by default: the default profiles' handlers are
 * compiled without the span id store. */

/* uprobe at at::_ops::linear::call: tag, count, sample; value = the thread's span id (0: none). */
int uprobe__thread_span(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct llmobs_tag tag;
    u64 span_id = 0;

    LLMOBS_RETURN_IF_OFF(LLMOBS_PROBE_thread_span);
    if (llmobs_read_tag_span(id >> 32, &tag, &span_id) < 0)
        return 0;
    llmobs_record_as(id >> 32, (u32)id, LLMOBS_PROBE_thread_span, LLMOBS_KIND_HOST, &tag, 0, span_id, 0, 0, 0);
    return 0;
}
