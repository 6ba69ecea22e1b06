/* host profile: off-CPU intervals of the target's threads, from sched:sched_switch. The tag is
 * read at switch-out (the only moment the target's memory is current); the event is recorded at
 * switch-in with the interval's length. value = 1 when the thread was preempted (still runnable),
 * 0 when it blocked, so sum_value counts involuntary switches. */

/* the fields of sched:sched_switch (tracefs format; stable ABI) */
struct llmobs_sched_switch_args {
    u64 common;
    char prev_comm[16];
    int prev_pid;
    int prev_prio;
    long prev_state;
    char next_comm[16];
    int next_pid;
    int next_prio;
};

/* Off-CPU intervals open for target threads, keyed by tid. */
BPF_HASH(llmobs_offcpu_start, u32, struct llmobs_start, 16384);

/* tracepoint sched:sched_switch: close the next thread's interval, open the previous one's. */
int tracepoint_sched_switch(struct llmobs_sched_switch_args *args)
{
    u64 now = bpf_ktime_get_ns();
    u32 next = args->next_pid;
    u64 id = bpf_get_current_pid_tgid();
    u32 prev = (u32)id;
    struct llmobs_start *open = llmobs_offcpu_start.lookup(&next);
    struct llmobs_start start = {};

    if (open) {
        llmobs_record(open->pid, next, LLMOBS_PROBE_sched_switch, LLMOBS_KIND_HOST, &open->tag,
                      open->ts_ns, open->value, now - open->ts_ns);
        llmobs_offcpu_start.delete(&next);
    }
    if (prev == 0 || llmobs_read_tag(id >> 32, &start.tag) < 0)
        return 0;
    start.ts_ns = now;
    start.pid = id >> 32;
    start.value = args->prev_state == 0; /* TASK_RUNNING at switch-out: preempted */
    if (llmobs_offcpu_start.update(&prev, &start))
        llmobs_count(LLMOBS_CTR_START_OVERFLOW);
    return 0;
}
