"""Writing matplotlib figures (headless) for the reports of bench, kv-plan and doctor."""

from __future__ import annotations

import base64
import io
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> Path:
    if not fig.legends:  # legend_below already laid the figure out around its legend
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return Path(path)


def png_base64(fig) -> str:
    buf = io.BytesIO()
    if not fig.legends:
        fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def legend_below(fig, axes, ncol: int | None = None) -> None:
    """One legend for the whole figure, under the plots: never over a title or the data.
    Entries of several axes (twin axes, subplots sharing series) are merged by label."""
    handles: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if not handles:
        return
    n = ncol or min(len(handles), 4)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=n, fontsize=8, frameon=False)
    rows = -(-len(handles) // n)
    fig.tight_layout(rect=(0, 0.04 + 0.045 * rows, 1, 1))


def integer_ticks(ax, values) -> None:
    """Ticks at exactly the values swept (concurrency 1, 2, 4, 16), labelled as integers, on a
    log2 axis when they span a factor of 4 or more."""
    values = sorted({float(v) for v in values})
    if values and values[0] > 0 and values[-1] / values[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.set_xticklabels([f"{v:g}" for v in values])
    ax.minorticks_off()
