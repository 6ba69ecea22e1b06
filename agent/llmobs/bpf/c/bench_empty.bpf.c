/* bench/probes.py only: the baseline, an empty uprobe / uretprobe on the same function. */

/* an empty uprobe: the cost of the trap alone */
int uprobe__empty(struct pt_regs *ctx)
{
    return 0;
}

/* an empty uretprobe: the cost of the return trap alone */
int uretprobe__empty(struct pt_regs *ctx)
{
    return 0;
}
