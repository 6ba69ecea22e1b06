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

/* tracepoint sched:sched_switch: close the next thread's interval, open the previous one's. */
int tracepoint_sched_switch(struct llmobs_sched_switch_args *args)
{
    u32 word = llmobs_word(LLMOBS_PROBE_sched_switch);
    u64 now, id;
    struct llmobs_tag tag;

    if (word & LLMOBS_WORD_OFF) /* shed: every switch on the host costs only this lookup */
        return 0;
    now = bpf_ktime_get_ns();
    id = bpf_get_current_pid_tgid();
    /* every switch-in looks at one array slot; only target threads ever opened one */
    llmobs_close(args->next_pid, LLMOBS_PROBE_sched_switch, LLMOBS_KIND_HOST, now, word);
    if ((u32)id == 0 || llmobs_read_tag(id >> 32, &tag) < 0)
        return 0;
    /* value: 1 when preempted (TASK_RUNNING at switch-out), 0 when the thread blocked */
    llmobs_open(id >> 32, (u32)id, LLMOBS_PROBE_sched_switch, now, args->prev_state == 0, &tag, word);
    return 0;
}
