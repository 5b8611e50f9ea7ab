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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return Path(path)


def png_base64(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode()
