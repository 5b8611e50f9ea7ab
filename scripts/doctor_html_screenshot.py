"""Open a `brisk doctor --html` report in headless Chromium (Debian `chromium`), screenshot
it, and check that the plots rendered: each <img> region of the page must be non-blank.

    .venv/bin/python scripts/doctor_html_screenshot.py report.html [--out shot.png]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("html", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        print("no chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp()) / "doctor.png"
    # The plots sit at the end of the page; a tall window captures all of them.
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,3200", f"--screenshot={out}", args.html.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    import matplotlib.image

    pixels = matplotlib.image.imread(out)[..., :3]
    rows = np.where(pixels.std(axis=(1, 2)) > 0.02)[0]  # rows with any drawing on them
    html = args.html.read_text()
    num_images = html.count("<img ")
    # A rendered plot is a tall band of non-uniform rows; a broken image leaves the page blank there.
    bands = np.split(rows, np.where(np.diff(rows) > 1)[0] + 1) if len(rows) else []
    tall = [b for b in bands if len(b) > 120]
    print(f"screenshot {out}: {pixels.shape[1]}x{pixels.shape[0]}, {num_images} <img> in the page, "
          f"{len(tall)} drawn regions taller than 120 px")
    ok = num_images >= 3 and len(tall) >= 2
    print("plots rendered" if ok else "plots missing or blank")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
