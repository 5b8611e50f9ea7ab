"""Paged attention backends. K/V live in per-layer slot arrays
([num_blocks * block_size, num_kv_heads, head_dim]); each sequence reads its K/V
through its block table. Two backends: the PyTorch reference (gather + SDPA, any device)
and, on CPU, decode rows through the compiled kernel (brisk/kernels/paged_attention.cpp);
a CUDA paged/flash kernel plugs in by implementing the same `__call__`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brisk import kernels
from brisk.kernels import fused
from brisk.engine import hugepages
from brisk.kernels import kv_codec
from brisk.kernels.paths import compute_paths
from brisk.kv_dtype import KVDtype
from brisk.models.layers import attend


@dataclass
class PrefillSeq:
    """A sequence computing `num_query` > 1 tokens this step (a prompt chunk)."""

    query_start: int  # row of its first new token in the flat batch
    num_query: int
    context_slots: torch.Tensor  # [context_len] slots of positions 0..context_len-1
    first_position: int  # position of its first new token (= tokens already cached)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the model runner, shared by all layers.

    The flat batch holds the decode rows first (one query each), then the prefill chunks. Decode
    rows are described by their block tables (what a paged kernel reads); the torch path expands
    them into slots once per step."""

    slot_mapping: torch.Tensor  # [num_tokens] slot where each new token's K/V is written
    block_size: int
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32 on CPU (rows padded with block 0)
    decode_lens: torch.Tensor | None  # [num_decodes] int32 on CPU: context length incl. the new token
    prefills: list[PrefillSeq]
    # the model's per-layer sliding windows (ModelConfig.layer_windows); () when none
    layer_windows: tuple[int | None, ...] = ()

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_lens is None else len(self.decode_lens)


def block_tables(tables: list[list[int]], lengths: list[int], block_size: int) -> torch.Tensor:
    """[rows, blocks of the longest] int32: each row's first blocks covering its length, padded
    with block 0 (Python touches one int per block, not per token)."""
    nb = -(-max(lengths) // block_size)
    return torch.from_numpy(np.array([t[:nb] if len(t) >= nb else t + [0] * (nb - len(t)) for t in tables],
                                     dtype=np.int32))


def window_slots(tables: torch.Tensor, lengths: torch.Tensor, block_size: int, window: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like context_slots, for a sliding window: slots of each row's last min(length, window)
    positions only, flat [rows * width] with width = min(max(lengths), window), right-aligned
    (padding, masked out, at the start of short rows). Blocks before the window are never read."""
    lens = lengths.long()
    width = min(int(lens.max()), window)
    positions = lens[:, None] - width + torch.arange(width)[None, :]  # [rows, width], < 0 = padding
    valid = positions >= 0
    positions = positions.clamp(min=0)
    blocks = tables.long().gather(1, positions // block_size)
    slots = (blocks * block_size + positions % block_size).masked_fill(~valid, 0)
    mask = None if bool(valid.all()) else valid[:, None, None, :].to(device)
    return slots.reshape(-1).to(device), mask


def context_slots(tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Slots of positions 0..length-1 of each row, flat [rows * max(lengths)], expanded from the
    block tables by tensor ops; padding points at slot 0 (finite, never a sequence's) and the mask
    [rows, 1, 1, width] marks what is real (None when no row is padded)."""
    rows, nb = tables.shape
    width = int(lengths.max())
    slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size)).view(rows, nb * block_size)
    slots = slots[:, :width]
    mask = None
    if int(lengths.min()) < width:
        valid = torch.arange(width)[None, :] < lengths.long()[:, None]
        slots = slots.masked_fill(~valid, 0)
        mask = valid[:, None, None, :].to(device)
    return slots.reshape(-1).to(device), mask


class PagedKVCache:
    """The pool: per layer, K and V [num_slots, num_kv_heads, head_dim] of one element type
    (brisk/kv_dtype.py), and for int8 their scales [num_slots, num_kv_heads] float32. Writes
    convert on the way in; the compiled kernel reads every type in place."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: KVDtype, device: torch.device, huge_pages: bool = True):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.dtype = kv_dtype
        storage = kv_codec.storage_dtype(kv_dtype)
        # NOTE: empty, not zeros: the OS maps pages only when a block is first written, so a
        # large pool costs nothing at start. Only slot 0 is read before being written (it pads
        # the decode batch, masked out), and it must hold finite values. On CPU the pool asks for
        # 2 MB pages (brisk/engine/hugepages.py): decode attention jumps between blocks.
        self.k = hugepages.empty(shape, storage, device, huge=huge_pages)
        self.v = hugepages.empty(shape, storage, device, huge=huge_pages)
        self.k_scale = self.v_scale = None
        if kv_dtype.scaled:
            self.k_scale = hugepages.empty(shape[:3], torch.float32, device, huge=huge_pages)
            self.v_scale = hugepages.empty(shape[:3], torch.float32, device, huge=huge_pages)
        for t in self._tensors():
            t[:, 0].zero_()

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] into slots [T] of the layer, converted."""
        fused.store_kv(k, v, self.k[layer], self.v[layer], slots, self.dtype, *self.scales(layer))

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V at `slots`, widened to `dtype`: [len(slots), kv_heads, head_dim] each."""
        k_scale, v_scale = self.scales(layer)
        keys = kv_codec.decode(self.k[layer].index_select(0, slots),
                               None if k_scale is None else k_scale.index_select(0, slots), self.dtype, dtype)
        values = kv_codec.decode(self.v[layer].index_select(0, slots),
                                 None if v_scale is None else v_scale.index_select(0, slots), self.dtype, dtype)
        return keys, values

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def block_nbytes(self, block_size: int) -> int:
        """Bytes of one block across every layer (K, V and their scales): what the disk tier stores."""
        return sum(t[:, :block_size].numel() * t.element_size() for t in self._tensors())

    def read_block(self, block_id: int, block_size: int) -> bytes:
        """One block's bytes, every layer's K, V (and scales), in that order, as stored."""
        rows = slice(block_id * block_size, (block_id + 1) * block_size)
        return b"".join(t[:, rows].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in self._tensors())

    def write_block(self, block_id: int, block_size: int, payload: bytes) -> None:
        """The inverse of read_block: the block's bytes put back in place."""
        if len(payload) != self.block_nbytes(block_size):
            raise ValueError(f"a KV block is {self.block_nbytes(block_size)} bytes here, got {len(payload)}")
        rows, at = slice(block_id * block_size, (block_id + 1) * block_size), 0
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        for t in self._tensors():
            target = t[:, rows]
            n = target.numel() * t.element_size()
            target.copy_(raw[at:at + n].view(t.dtype).view(target.shape).to(t.device))
            at += n

    def prefault(self, num_slots: int) -> int:
        """Map in every layer's first `num_slots` slots now (hugepages.populate_rows; the GIL stays free), where a
        new engine's first blocks go: the blocks a KV tier hands back after a restart are then copied into mapped
        memory. Returns the bytes mapped in (0 off CPU or Linux)."""
        return sum(hugepages.populate_rows(t, num_slots) for t in self._tensors())

    def resident_bytes(self) -> int | None:
        """How much of the pool is in memory now (pages are mapped on first write); None where
        the OS cannot say."""
        counts = [hugepages.resident_bytes(t) for t in self._tensors()]
        return None if any(c is None for c in counts) else sum(counts)


class TorchPagedAttention:
    """Callable passed to the model for one step: writes this step's K/V, then attends. Decode rows
    gather their context out of the cache (index_select) and run SDPA on the copy: the reference
    the compiled kernel is tested against, and the path on devices the kernel does not cover."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, scale: float, softcap: float | None = None):
        self.cache, self.meta, self.scale, self.softcap = cache, meta, scale, softcap
        # per window (None: the whole context): decode rows' slots and padding mask, built once per
        # step and shared by every layer with that window
        self._decode_slots: dict[int | None, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _gathered_decode(self, q: torch.Tensor, layer: int, window: int | None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta = self.meta
        if window not in self._decode_slots:
            if window is None:
                built = context_slots(meta.decode_tables, meta.decode_lens, meta.block_size, q.device)
            else:
                built = window_slots(meta.decode_tables, meta.decode_lens, meta.block_size, window, q.device)
            self._decode_slots[window] = built
        slots, mask = self._decode_slots[window]
        n = meta.num_decodes
        keys, values = self.cache.gather(layer, slots, q.dtype)
        shape = (n, -1, keys.shape[1], keys.shape[2])
        # [n, num_kv_heads, max_context, head_dim]
        keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
        query = q.unsqueeze(2)  # [n, num_heads, 1, head_dim]
        attn = attend(query, keys, values, mask, False, self.scale, self.softcap, sinks)
        return attn.reshape(n, -1)

    def _decode(self, q: torch.Tensor, layer: int, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        return self._gathered_decode(q, layer, window, sinks)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        meta = self.meta
        window = meta.window(layer)
        self.cache.store(layer, k, v, meta.slot_mapping)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            n = meta.num_decodes
            out[:n] = self._decode(q[:n], layer, window, sinks)
        for seq in meta.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.num_query)
            # [1, num_kv_heads, S, head_dim]
            keys, values = self.cache.gather(layer, seq.context_slots, q.dtype)
            keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
            query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, num_heads, L, head_dim]
            mask = None
            if seq.first_position > 0 or window is not None:
                rows_pos = torch.arange(seq.first_position, seq.first_position + seq.num_query, device=q.device)
                context_pos = torch.arange(len(seq.context_slots), device=q.device)[None, :]
                mask = context_pos <= rows_pos[:, None]
                if window is not None:  # position i sees i - window + 1 .. i
                    mask &= context_pos > rows_pos[:, None] - window
            attn = attend(query, keys, values, mask, mask is None, self.scale, self.softcap, sinks)
            out[rows] = attn.squeeze(0).transpose(0, 1).reshape(seq.num_query, -1)
        return out


class KernelPagedAttention(TorchPagedAttention):
    """Decode rows attend through their block tables in place (brisk/kernels/paged_attention.cpp):
    no gathered copy of the context per layer. Prompt chunks keep SDPA (their cost is the
    quadratic math, not the copy) unless they are laid out as decode rows (batch-invariant mode,
    the default), which the kernel then walks in tiles of consecutive positions."""

    def _decode(self, q: torch.Tensor, layer: int, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        meta, cache = self.meta, self.cache
        out = kernels.paged_decode_attention(q, cache.k[layer], cache.v[layer], meta.decode_tables, meta.decode_lens,
                                             meta.block_size, self.scale, window=window, softcap=self.softcap,
                                             kv_dtype=cache.dtype, scales=cache.scales(layer), sinks=sinks)
        if out is None:  # a shape the kernel does not take
            return self._gathered_decode(q, layer, window, sinks)
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def attention_backend(device: torch.device) -> type[TorchPagedAttention]:
    """The compiled kernel on CPU (it reads every KV dtype) when it is built, else the torch path; the choice
    is brisk.kernels.paths' (BRISK_ATTENTION=torch forces the torch path, to compare or rule it out)."""
    if compute_paths(device).attention == "kernel":
        return KernelPagedAttention
    return TorchPagedAttention
