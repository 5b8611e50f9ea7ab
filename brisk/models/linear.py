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
GEMV_MAX_ROWS = 4  # 2..4 rows: one sgemv per row
PAD_ROWS = ((5, 8), (10, 16))  # 5..7 rows are padded to 8, 10..15 to 16


def _matmul(x: np.ndarray, weight_t: np.ndarray) -> np.ndarray:
    """x [rows, in] @ weight_t [in, out], shaped around OpenBLAS's small-row behaviour.

    NOTE: measured on this project's CPUs (`benchmarks/matmul_paths.py --small-rows`, every
    linear of one decode step): OpenBLAS's sgemm is not monotonic in the number of rows below
    16 — 2 rows cost 2.6x one row, 6 rows cost more than 8, 14 more than 16. So 2-4 rows run as
    one sgemv each (each reads the weights once; still cheaper), 5-7 rows are padded with
    zeros to 8 and 10-15 to 16 (9 is as fast as it is). Above 16 rows padding gains nothing (measured up to 200).
    """
    rows = x.shape[0]
    if 1 < rows <= GEMV_MAX_ROWS:
        w = weight_t.T
        return np.stack([w @ x[i] for i in range(rows)])
    target = next((top for low, top in PAD_ROWS if low <= rows < top), None)
    if target is not None:
        padded = np.zeros((target, x.shape[1]), dtype=x.dtype)
        padded[:rows] = x
        return np.matmul(padded, weight_t)[:rows]
    return np.matmul(x, weight_t)


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
        out = torch.from_numpy(_matmul(x.numpy(), self._weight_t))
        if self.bias is not None:
            out += self.bias
        return out
