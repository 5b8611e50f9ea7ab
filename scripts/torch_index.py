"""The pip arguments that make `pip install torch==...` take the CPU build on a machine without an
NVIDIA GPU: PyTorch's CPU wheel index, added only when the machine has no NVIDIA driver and the
index answers (an unreachable index would fail or stall the install; pip then takes torch from its
usual sources). Prints the arguments (nothing, or `--extra-index-url URL`) for the Makefile and
scripts/check_install.sh; a reason goes to stderr.

    pip install "torch==2.13.0" $(python3 scripts/torch_index.py)

BRISK_TORCH_INDEX=URL forces an index, BRISK_TORCH_INDEX=none turns this off.
"""

import os
import shutil
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_nvidia_gpu() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


def reachable(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/torch/", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def main() -> int:
    forced = os.environ.get("BRISK_TORCH_INDEX")
    if forced:
        if forced != "none":
            print(f"--extra-index-url {forced}")
        return 0
    if has_nvidia_gpu():
        print("torch: an NVIDIA GPU is present, taking the default (CUDA) build", file=sys.stderr)
    elif reachable(CPU_INDEX):
        print(f"torch: no NVIDIA GPU, taking the CPU build from {CPU_INDEX}", file=sys.stderr)
        print(f"--extra-index-url {CPU_INDEX}")
    else:
        print(f"torch: no NVIDIA GPU, but {CPU_INDEX} does not answer; taking torch from pip's usual "
              "sources (a local CPU wheel where one is configured, else PyPI's CUDA build)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
