"""A PNG of `compare`'s per-token loss difference (B - A) along the sequence (matplotlib, Agg).

x: the token's index in its request; the line is the mean B - A loss over the pairs that have that
token paired, the band its interval (normal, across pairs); the grey bars below how many pairs each
index has (long sequences thin out, and the band widens with them).
"""

from __future__ import annotations

from pathlib import Path


def write_png(result, path: Path | str) -> Path | None:
    """None when the comparison has no paired tokens (nothing to plot)."""
    steps = result.steps
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: never needs a display
    import matplotlib.pyplot as plt

    xs = [s["step"] for s in steps]
    fig, (ax, count_ax) = plt.subplots(
        2, 1, figsize=(11, 5.5), sharex=True, constrained_layout=True, height_ratios=(3, 1)
    )
    level = round(100 * (1 - result.bootstrap["alpha"]), 2)
    ax.fill_between(
        xs,
        [s["lo"] for s in steps],
        [s["hi"] for s in steps],
        alpha=0.25,
        linewidth=0,
        label=f"{level:g}% interval across pairs",
    )
    ax.plot(xs, [s["mean"] for s in steps], linewidth=1.2, label="mean B - A")
    ax.axhline(0, color="0.4", linewidth=0.8)
    loss = next((m for m in result.metrics if m.name == "loss"), None)
    if loss is not None and loss.diff is not None:
        ax.axhline(
            loss.diff, color="tab:red", linewidth=0.8, linestyle="--", label=f"overall {loss.diff:+.4f} nats"
        )
    ax.set_ylabel("loss B - A (nats)")
    ax.set_title(
        f"per-token loss difference: B {result.b['selector']} - A {result.a['selector']}"
        f" ({result.pairs['pairs']} pairs, {result.pairs['token_pairs']} tokens)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: never on data
    count_ax.bar(xs, [s["pairs"] for s in steps], width=1.0, color="0.6")
    count_ax.set_ylabel("pairs")
    count_ax.set_xlabel("token index in the request")
    count_ax.grid(alpha=0.3)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
