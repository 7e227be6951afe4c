"""Headless matplotlib figures for reports (PNG files)."""

from __future__ import annotations

from pathlib import Path


def figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (6, 4)):
    """(fig, axes) with axes always 2-D, on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def finish(fig, path: str | Path, axes=()) -> None:
    """Grid and legend on the given axes, tight layout, save, close."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
