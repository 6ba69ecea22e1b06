/* host profile: user-space page faults of the target, from exceptions:page_fault_user.
 * value = 0 (the faulting address is not a size). Thinned: every fault is counted in the step's
 * aggregates, 1 in probes.thin of a step's faults is shipped (llmobs_events.h). */

/* the fields of exceptions:page_fault_user (tracefs format) */
struct llmobs_page_fault_args {
    u64 common;
    unsigned long address;
    unsigned long ip;
    unsigned long error_code;
};

/* tracepoint exceptions:page_fault_user: count and sample a fault of a target thread. */
int tracepoint_page_fault_user(struct llmobs_page_fault_args *args)
{
    LLMOBS_RETURN_IF_OFF(LLMOBS_PROBE_page_fault_user);
    llmobs_point_as(LLMOBS_PROBE_page_fault_user, LLMOBS_KIND_HOST, 0, 1);
    return 0;
}
