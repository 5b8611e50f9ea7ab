"""Which implementation runs each part of a step: chosen here, in one place, and logged once.

Four choices, each with a `BRISK_*` switch (brisk/switches.py) to rule a path out or compare:
- the compiled kernels (`_kernels.so`) and the instruction set they run on, or PyTorch where they are
  missing or `BRISK_KERNELS=torch` (quantized layers then run the torch reference);
- float matmuls on oneDNN with packed weights, or `F.linear` (`BRISK_MATMUL`);
- paged attention through the compiled kernel (CPU), or gather + SDPA (`BRISK_ATTENTION`);
- decode steps through the compiled whole-stack call, or layer by layer (`BRISK_DECODE_STACK`; a model
  the stack does not take still decodes layer by layer, and `DecodeStack.build` logs why).

`compute_paths(device)` reads the switches each time (a test or an operator may change them between
engines) and logs the choice once per process, and again only when it changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from brisk import kernels, switches

log = logging.getLogger("brisk.kernels")


@dataclass(frozen=True)
class ComputePaths:
    kernels: str  # the compiled kernels' ISA (`kernels.isa()`), or why there are none
    kernel_level: int  # 3 AVX-512 VNNI, 2 AVX2, 1 portable loops, 0 no compiled kernels
    attention_isa: str  # the paged attention kernel's ISA, "" without kernels
    float_matmul: str  # "onednn" or "torch"
    attention: str  # "kernel" or "torch"
    decode_stack: bool  # the compiled whole-stack decode may run (the model decides the rest)

    @property
    def compiled(self) -> bool:
        return self.kernel_level > 0

    def describe(self) -> str:
        kernels = f"compiled ({self.kernels})" if self.compiled else f"none ({self.kernels})"
        isa = self.attention_isa + (": fp8 KV multiplied in float16" if self.attention_isa == "avx512fp16" else "")
        attention = f"paged kernel ({isa})" if self.attention == "kernel" else "torch gather + SDPA"
        matmul = "oneDNN packed weights" if self.float_matmul == "onednn" else "F.linear"
        stack = "whole-stack call where the model takes it" if self.decode_stack else "layer by layer"
        return f"kernels {kernels}; float matmuls {matmul}; attention {attention}; decode steps {stack}"


def onednn_available() -> bool:
    """oneDNN's packed linear ops are in this torch build (and BRISK_MATMUL does not rule them out)."""
    return switches.choice("BRISK_MATMUL") != "torch" and torch.backends.mkldnn.is_available() and \
        hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


_logged: ComputePaths | None = None


def compute_paths(device: torch.device | str = "cpu") -> ComputePaths:
    device = torch.device(device)
    lib = kernels.library()
    if lib is None:
        level, names, attention_isa = 0, "BRISK_KERNELS=torch" if switches.choice("BRISK_KERNELS") == "torch" \
            else "not built: quantized layers run the torch reference", ""
    else:
        level, names, attention_isa = max(1, min(3, lib.brisk_kernels_isa())), kernels.isa(), kernels.attention_isa()
    kernel_attention = switches.choice("BRISK_ATTENTION") == "auto" and device.type == "cpu" and level > 0
    paths = ComputePaths(
        kernels=names, kernel_level=level, attention_isa=attention_isa,
        float_matmul="onednn" if device.type == "cpu" and onednn_available() else "torch",
        attention="kernel" if kernel_attention else "torch",
        decode_stack=kernel_attention and switches.choice("BRISK_DECODE_STACK") == "auto")
    global _logged
    if paths != _logged:
        log.info("compute paths on %s: %s", device.type, paths.describe())
        _logged = paths
    return paths
