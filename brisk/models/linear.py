"""Linear layers on oneDNN with weights reordered once, chosen by measurement.

Measured on this project's CPUs (`benchmarks/matmul_paths.py`, every linear of one step of
the demo model): `F.linear` goes through a BLAS that reaches ~100 GFLOP/s at 64 rows here,
numpy's OpenBLAS ~220, and oneDNN with the weights reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, what PyTorch's own CPU
compiler emits) is the fastest from one row (a memory-bound GEMV) to prefill chunks of
hundreds of rows. So float32 CPU linears (and bfloat16 ones on CPUs with native bf16) run on
packed oneDNN weights; everything else (CUDA, other dtypes, a torch build without oneDNN)
uses `F.linear`.
`BRISK_MATMUL=torch` turns the oneDNN path off (for comparisons).

oneDNN compiles one kernel ("primitive") per distinct row count and caches up to 1,024 of them;
serving sees every row count from 1 to the step's token budget, and RSS grew with traffic (1,716 ->
2,101 MB over 1,500 short requests). So row counts are padded up to a small set of buckets
(`row_bucket`): 49 kernels per weight shape up to 512 rows, whatever the traffic, for a few
percent of padded rows on average (`benchmarks/row_buckets.py`, figures in RESULTS.md).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from brisk.kernels.paths import onednn_available

PACK_ROWS_HINT = 64  # oneDNN picks its weight layout for this batch size; any hint >= 16 measured the same


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    """bf16 only where the CPU has native bf16 dot products; elsewhere oneDNN would emulate them."""
    native_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", bool)()
    return (torch.float32, torch.bfloat16) if native_bf16 else (torch.float32,)


ONEDNN_ENABLED = onednn_available()  # the compute paths' choice (brisk/kernels/paths.py)
_PACKABLE = _packable_dtypes() if ONEDNN_ENABLED else ()


def _onednn_linear(*args):
    return torch.ops.mkldnn._linear_pointwise(*args)


def row_bucket(rows: int) -> int:
    """Rows padded to: exact up to 8, then multiples of 4 to 64, of 16 to 512, of 64 beyond: 49
    kernels per weight shape up to 512 rows, and at most 3 rows in 12 (9 -> 12) of padding."""
    if rows <= 8:
        return rows
    step = 4 if rows <= 64 else 16 if rows <= 512 else 64
    return -(-rows // step) * step


def _padded_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    bucket = row_bucket(rows)
    if bucket != rows:
        padded = flat.new_zeros((bucket, flat.shape[1]))
        padded[:rows] = flat
        flat = padded
    out = _onednn_linear(flat.contiguous(), packed, bias, "none", [], "")
    if bucket != rows:
        out = out[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    """`nn.Linear` whose CPU matmul runs on weights packed once for oneDNN.

    The packed copy is taken at load (`prepare`); weights are not expected to change after it."""

    _packed: torch.Tensor | None = None
    _pack_failed = False

    def prepare(self) -> None:
        """Pack the weights now (the loader calls this, so the first request doesn't pay)."""
        if self._packable(self.weight):
            self._pack()

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def _packable(self, x: torch.Tensor) -> bool:
        return (not self._pack_failed and self.weight.dtype in _PACKABLE and x.dtype == self.weight.dtype
                and x.device.type == "cpu" and self.weight.device.type == "cpu")

    def _pack(self) -> None:
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS_HINT)
        except RuntimeError:  # a shape or build oneDNN refuses: this layer stays on F.linear
            self._pack_failed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None and self._packable(x):
            self._pack()
        if self._packed is not None and x.dtype == self.weight.dtype and x.device.type == "cpu":
            return _padded_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)
