/* host profile: ioctl(2) on the target's /dev/nvidia* descriptors, timed from
 * syscalls:sys_enter_ioctl to sys_exit_ioctl. The agent fills llmobs_ioctl_fds from /proc/PID/fd
 * (a path match in the kernel would need struct file offsets of this exact kernel).
 * value = the ioctl request number. */

struct llmobs_sys_enter_ioctl_args {
    u64 common;
    int nr;
    int pad;
    u64 fd;
    u64 cmd;
    u64 arg;
};

struct llmobs_fd_key {
    u32 pid;
    u32 fd;
};

/* (tgid, fd) of the descriptors to watch, refreshed by the agent from /proc/PID/fd. */
BPF_HASH(llmobs_ioctl_fds, struct llmobs_fd_key, u8, 4096);

/* tracepoint syscalls:sys_enter_ioctl: open the interval if the fd is a watched device. */
int tracepoint_sys_enter_ioctl(struct llmobs_sys_enter_ioctl_args *args)
{
    u32 word = llmobs_word(LLMOBS_PROBE_ioctl);
    struct llmobs_fd_key key = {.fd = (u32)args->fd};

    if (word & LLMOBS_WORD_OFF)
        return 0;
    key.pid = bpf_get_current_pid_tgid() >> 32;
    if (!llmobs_ioctl_fds.lookup(&key))
        return 0;
    llmobs_call_enter(LLMOBS_PROBE_ioctl, args->cmd, word);
    return 0;
}

/* tracepoint syscalls:sys_exit_ioctl: close the interval opened at entry. */
int tracepoint_sys_exit_ioctl(void *args)
{
    llmobs_call_return(LLMOBS_PROBE_ioctl, LLMOBS_KIND_HOST);
    return 0;
}
