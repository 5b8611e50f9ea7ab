"""Linear layers whose matmul backend is chosen by measurement, not assumption.

On this project's CPUs numpy's OpenBLAS beats torch's CPU matmul for every linear
of a decoder step up to about 512 tokens (`benchmarks/matmul_paths.py`: 2.4x at
one token, 1.4x at 64), while torch is as fast or faster for larger prefill
chunks. So fp32 CPU linears on fewer than `NUMPY_MAX_TOKENS` rows run through
zero-copy numpy views of the same weights; everything else uses torch.

The numpy path is only safe when torch's OpenMP threads sleep between parallel
regions (OMP_WAIT_POLICY=PASSIVE, which `brisk/__init__` sets before torch loads);
otherwise they spin against OpenBLAS's threads and a step gets 10x slower, so
without that policy brisk stays on torch. `BRISK_MATMUL=torch|numpy` overrides.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

NUMPY_MAX_TOKENS = 512


def _numpy_enabled() -> bool:
    choice = os.environ.get("BRISK_MATMUL", "auto")
    if choice in ("torch", "numpy"):
        return choice == "numpy"
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


NUMPY_ENABLED = _numpy_enabled()


class Linear(nn.Linear):
    """`nn.Linear` with an OpenBLAS path for float32 CPU tensors of up to NUMPY_MAX_TOKENS rows."""

    _weight_t: np.ndarray | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not NUMPY_ENABLED or x.device.type != "cpu" or x.dtype != torch.float32
                or self.weight.dtype != torch.float32 or x.shape[0] >= NUMPY_MAX_TOKENS):
            return F.linear(x, self.weight, self.bias)
        if self._weight_t is None:
            self._weight_t = self.weight.numpy().T  # [in, out] view of the same memory
        out = torch.from_numpy(np.matmul(x.numpy(), self._weight_t))
        if self.bias is not None:
            out += self.bias
        return out
