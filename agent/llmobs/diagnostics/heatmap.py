"""The dL/dE heatmap of a training loss spike: one panel per step (the last 5 up to the spike), each
tokens (rows) x embedding dims (columns), on one shared, symmetric colour scale so the panels compare.

Rendered by the agent from the .npz the workload dumped (llmobs.publisher.training), with matplotlib's
Agg backend (no display). Each panel draws the slice pixel for pixel (imshow, no interpolation), so a
single token whose gradient blows up shows as one bright row. The PNG carries its own description in
text chunks (`llmobs:panels`, `llmobs:shape` = "panels x tokens x dims", `llmobs:step_seq`), so a test
or a tool can check what it holds without parsing the picture.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SCALE_PERCENTILE = 99.5  # the colour scale's end: one extreme value must not wash out the rest


def render(grads: np.ndarray, step_seqs, path: Path | str, tokens=None, title: str = "") -> Path:
    """grads [panels, tokens, dims] -> PNG at `path`; tokens[i] = valid tokens of panel i (rest padding)."""
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: never needs a display
    import matplotlib.pyplot as plt

    grads = np.asarray(grads, np.float32)
    if grads.ndim != 3 or grads.shape[0] < 1:
        raise ValueError(f"grads must be [panels, tokens, dims], got shape {grads.shape}")
    panels, n_tokens, dims = grads.shape
    finite = np.abs(grads[np.isfinite(grads)])
    vmax = float(np.percentile(finite, SCALE_PERCENTILE)) if finite.size else 1.0
    vmax = vmax if vmax > 0 else 1.0
    fig, axes = plt.subplots(1, panels, figsize=(2.2 * panels + 1.2, 4.2), sharey=True, squeeze=False,
                             constrained_layout=True)  # fmt: skip
    image = None
    for i, ax in enumerate(axes[0]):
        image = ax.imshow(grads[i], cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto",
                          interpolation="nearest")  # fmt: skip
        norms = np.linalg.norm(grads[i], axis=1)
        ax.set_title(f"step_seq {int(step_seqs[i])}\n|g| max {norms.max():.2e}", fontsize=8)
        ax.set_xlabel("embedding dim", fontsize=8)
        if tokens is not None and int(tokens[i]) < n_tokens:
            ax.axhline(int(tokens[i]) - 0.5, color="k", linewidth=0.6)  # below: padding
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("token (batch rows flattened)", fontsize=8)
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="dL/dE")
    if title:
        fig.suptitle(title, fontsize=9)
    path = Path(path)
    metadata = {
        "llmobs:panels": str(panels),
        "llmobs:shape": f"{panels}x{n_tokens}x{dims}",
        "llmobs:step_seq": ",".join(str(int(s)) for s in step_seqs),
        "llmobs:scale": f"{vmax:.6g}",
    }
    fig.savefig(path, dpi=100, metadata=metadata)
    plt.close(fig)
    return path


def render_npz(npz_path: Path | str, png_path: Path | str, title: str = "") -> Path:
    """The workload's dump (grads, step_seq, tokens) -> the heatmap PNG."""
    with np.load(npz_path) as data:
        return render(data["grads"], data["step_seq"], png_path, tokens=data["tokens"], title=title)


def png_metadata(path: Path | str) -> dict[str, str]:
    """The `llmobs:` text chunks of a heatmap PNG (and the image size as `width`, `height`)."""
    from PIL import Image

    with Image.open(path) as img:
        info = {k: v for k, v in img.info.items() if isinstance(v, str) and k.startswith("llmobs:")}
        info["width"], info["height"] = str(img.width), str(img.height)
    return info
