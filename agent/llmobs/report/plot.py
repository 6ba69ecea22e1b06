"""A PNG of per-token loss and latency, one line per request (matplotlib, Agg: no display needed).

Top panel: each token's cross-entropy loss; bottom: its decode latency, with the part spent off-CPU
shaded, so a slow token that was merely descheduled is told apart from one that did more work.
"""

from __future__ import annotations

import math
from pathlib import Path

from llmobs.report.text import Request


def write_png(requests: list[Request], path: Path | str, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: never needs a display
    import matplotlib.pyplot as plt

    fig, (loss_ax, latency_ax) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, constrained_layout=True)
    colors = plt.get_cmap("tab10")
    x0 = 0
    for index, request in enumerate(requests):
        xs = list(range(x0, x0 + len(request.tokens)))
        color = colors(index % 10)
        label = f"req {index + 1} ({request.tenant})"
        losses = [t.loss if not math.isnan(t.loss) else None for t in request.tokens]
        loss_ax.plot(xs, losses, marker="o", markersize=3, color=color, label=label)
        latency = [t.latency_ns / 1e6 for t in request.tokens]
        off_cpu = [
            min((t.off_cpu_ns or 0) / 1e6, lat) for t, lat in zip(request.tokens, latency, strict=True)
        ]
        latency_ax.plot(xs, latency, marker="o", markersize=3, color=color)
        latency_ax.fill_between(xs, 0, off_cpu, color=color, alpha=0.25, step="mid", linewidth=0)
        if index:
            for ax in (loss_ax, latency_ax):
                ax.axvline(x0 - 0.5, color="0.8", linewidth=0.8)
        x0 += len(request.tokens)
    loss_ax.set_ylabel("loss (nats)")
    loss_ax.set_title(title or "per-token loss and latency")
    loss_ax.grid(alpha=0.3)
    if requests:
        loss_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: never on data
    latency_ax.set_ylabel("latency (ms); shaded: off-CPU")
    latency_ax.set_xlabel("token (requests in order; first token of each = prefill)")
    latency_ax.grid(alpha=0.3)
    latency_ax.set_ylim(bottom=0)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
