"""Linear layers whose matmul backend is chosen by measurement, not assumption.

Measured on this project's CPUs (`benchmarks/matmul_paths.py`, every linear of one step):
- one row (single-stream decode) is a memory-bound GEMV; numpy's OpenBLAS sgemv streams
  the fp32 weights fastest (12 ms for the demo model's 538 MB, vs 18 ms through oneDNN);
- two rows and more run fastest through oneDNN with weights reordered once into its
  blocked layout (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what
  PyTorch's own CPU compiler uses): 2x OpenBLAS at 16-64 rows and for prefill chunks;
  plain `F.linear` goes through a BLAS that is slowest of the three on these CPUs.
So fp32 CPU linears use numpy for one row and packed oneDNN weights for more; bfloat16
weights always use packed oneDNN (native bf16 dot products where the CPU has them).
When oneDNN is missing, 2+ rows fall back to OpenBLAS shaped around its small-row quirks.

The numpy path is only safe when torch's OpenMP threads sleep between parallel
regions (OMP_WAIT_POLICY=PASSIVE, which `brisk/__init__` sets before torch loads);
otherwise they spin against OpenBLAS's threads and a step gets 10x slower, so
without that policy brisk keeps one-row linears on torch too.
`BRISK_MATMUL=auto|onednn|numpy|torch` overrides the choice.
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
PACK_ROWS_HINT = 64  # oneDNN picks its weight layout for this batch size; any hint >= 16 measured the same


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


def _onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _backends() -> tuple[bool, bool]:
    """(numpy for fp32 rows, oneDNN packed weights) from BRISK_MATMUL and the platform."""
    choice = os.environ.get("BRISK_MATMUL", "auto")
    if choice not in ("auto", "onednn", "numpy", "torch"):
        raise ValueError(f"BRISK_MATMUL={choice!r}: use auto, onednn, numpy or torch")
    passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    use_numpy = choice == "numpy" or (choice == "auto" and passive)
    use_onednn = choice == "onednn" or (choice == "auto" and _onednn_available())
    return use_numpy, use_onednn


NUMPY_ENABLED, ONEDNN_ENABLED = _backends()
_PACKABLE = (torch.float32, torch.bfloat16)


class Linear(nn.Linear):
    """`nn.Linear` whose CPU matmul runs through the fastest measured path for its row count."""

    _weight_t: np.ndarray | None = None
    _packed: torch.Tensor | None = None

    def prepare(self) -> None:
        """Reorder the weights for oneDNN now (the loader calls this, so the first request doesn't pay)."""
        if self._packable(self.weight):
            self._packed_weight()

    def _packable(self, x: torch.Tensor) -> bool:
        return (ONEDNN_ENABLED and x.device.type == "cpu" and self.weight.device.type == "cpu"
                and self.weight.dtype in _PACKABLE and x.dtype == self.weight.dtype)

    def _packed_weight(self) -> torch.Tensor:
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS_HINT)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        numpy_ok = (NUMPY_ENABLED and x.device.type == "cpu" and x.dtype == torch.float32
                    and self.weight.dtype == torch.float32 and rows < NUMPY_MAX_TOKENS)
        if numpy_ok and (rows == 1 or not ONEDNN_ENABLED):
            if self._weight_t is None:
                self._weight_t = self.weight.detach().numpy().T  # [in, out] view of the same memory
            out = torch.from_numpy(_matmul(x.numpy(), self._weight_t))
            if self.bias is not None:
                out += self.bias
            return out
        if self._packable(x):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed_weight(), self.bias,
                                                      "none", [], "")
        return F.linear(x, self.weight, self.bias)
