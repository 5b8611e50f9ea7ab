"""Runs one engine step on the model: builds the ragged batch (decode rows first, then
prompt chunks, no padding), the attention metadata from block tables, one forward,
logits for the rows that sample, and the sampler."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from brisk.engine.attention import (AttentionMetadata, KernelPagedAttention, PagedKVCache, PrefillSeq,
                                    attention_backend, block_tables, context_slots)
from brisk.engine.block_table import PersistentBlockTables
from brisk.engine.decode_stack import DecodeStack
from brisk.engine.request import Request
from brisk.engine.sampler import Sampler, SamplerOutput
from brisk.engine.scheduler import ScheduledChunk
from brisk.errors import BriskError
from brisk.kv_dtype import KVDtype
from brisk.loading.loader import LoadedModel


class ModelRunner:
    """`batch_invariant` (default: wherever the compiled kernel runs): every token of a prompt chunk
    attends as a decode row of its own (the compiled kernel, reading its context through the block
    table in a fixed order from position 0), as drafted tokens already do; the kernel walks a
    chunk's rows in tiles of consecutive positions, so the context is read once per tile, not per
    row. A row's attention then depends on its own tokens only: not on how the scheduler chunked
    its prompt, how much of it came from the prefix cache, or what shared the step. With the
    row-invariant matmul kernels, greedy output is the same in any batch and with a cold or warm
    prefix cache, for quantized models too (where int8 activation rounding turns SDPA's
    chunk-dependent last bits into other tokens now and then). False: prompt chunks take SDPA.
    None: on where the kernel runs, else off (with a log line saying so); True: an error where
    the kernel does not run."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: KVDtype, seed: int = 0,
                 batch_invariant: bool | None = None):
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.kv = PagedKVCache(cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim,
                               kv_dtype, loaded.device)
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap
        self.attention = attention_backend(torch.device(loaded.device))
        self.sampler = Sampler(loaded.device, seed, loaded.tokenizer.eos_token_ids)
        self.decode_stack = (DecodeStack.build(self.model, self.kv, self.scale, block_size)
                             if self.attention is KernelPagedAttention else None)
        kernel = self.attention is KernelPagedAttention
        if batch_invariant and not kernel:
            raise BriskError("--batch-invariant needs brisk's compiled paged attention kernel (CPU, built by "
                             "`make`; not with BRISK_ATTENTION=torch); drop the flag to run without it")
        self.batch_invariant = kernel if batch_invariant is None else batch_invariant
        self.decode_tables = PersistentBlockTables(-(-loaded.max_model_len // block_size))

    def _prepare(self, chunks: list[ScheduledChunk]):
        # decodes (with their drafts) first, order kept otherwise
        chunks = sorted(chunks, key=lambda c: c.num_tokens - c.num_draft > 1)
        seqs, sample_requests, drafts, sampled, pooling = [], [], [], [], []
        for chunk in chunks:
            req = chunk.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            draft = req.spec_token_ids[:chunk.num_draft]
            # a decode, and each drafted token as a decode row of its own that sees the positions
            # before it: every row attends exactly as one-token decoding would, so verification
            # reproduces its logits bit for bit
            seqs.append(SeqSlice(sequence_tokens(req, start, end - chunk.num_draft) + draft, start, chunk.block_ids,
                                 as_decode_rows=self.batch_invariant or chunk.num_tokens - chunk.num_draft == 1,
                                 key=req.request_id))
            if req.params.pooling is not None:  # an embedding request: its rows are pooled, nothing samples
                pooling.append((len(seqs) - 1, req, start, end))
                continue
            if end - chunk.num_draft == req.num_tokens:  # the last known token: its logits give the next one
                # (and with a draft, each drafted position's logits verify the next draft token)
                sampled.append((len(seqs) - 1, 1 + chunk.num_draft))
                sample_requests.append(req)
                drafts.append(draft)
        batch = build_batch(seqs, self.block_size, self.device, self.loaded.config.layer_windows,
                            self.decode_tables)
        sample_rows = [row for i, n in sampled for row in range(batch.ends[i] - n, batch.ends[i])]
        pool_rows = [_pool_rows(req, batch.ends[i] - (end - start), batch.ends[i], start, end) for i, req, start, end in pooling]
        return batch.input_ids, batch.positions, batch.meta, sample_rows, sample_requests, drafts, pool_rows

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> "SampleRows | None":
        """One forward over all chunks; the hidden states of the rows that sample (None: none does).
        `sample` then turns them into tokens (with drafted tokens: the tokens each request emits after
        verification)."""
        input_ids, positions, meta, sample_rows, sample_requests, drafts, pool_rows = self._prepare(chunks)
        attention = self.attention(self.kv, meta, self.scale, self.softcap)
        stack = None  # a step of decode rows only: the whole decoder stack in one compiled call
        if self.decode_stack is not None and not meta.prefills and meta.num_decodes:
            stack = functools.partial(self.decode_stack, meta=meta)
        hidden = self.model(input_ids, positions, attention, stack)
        for request, rows, final in pool_rows:
            pool(request, hidden[rows], final)
        if not sample_requests:
            return None
        return SampleRows(hidden[sample_rows], sample_requests, drafts)

    @torch.inference_mode()
    def sample(self, rows: "SampleRows") -> SamplerOutput:
        """Every sampling request's tokens at once."""
        logits = self.model.compute_logits(rows.hidden)
        return self.sampler(logits, rows.requests, rows.drafts if any(rows.drafts) else None)

    @torch.inference_mode()
    def sample_each(self, rows: "SampleRows") -> list[SamplerOutput | Exception]:
        """Each request's tokens by itself (or the exception its sampling raised), from logits computed
        afresh (a batch sampling step that failed may have changed its logits in place): what keeps one
        request's failure from taking the others down. The logits are the batch's own bits; each request's
        sampling reads and changes its own rows only."""
        logits = self.model.compute_logits(rows.hidden)
        results: list[SamplerOutput | Exception] = []
        start = 0
        for request, draft in zip(rows.requests, rows.drafts):
            end = start + 1 + len(draft)
            try:
                results.append(self.sampler(logits[start:end], [request], [draft] if draft else None))
            except Exception as e:  # noqa: BLE001 - this request's own failure, handed to the engine
                results.append(e)
            start = end
        return results


@dataclass
class SampleRows:
    """A step's rows that sample: their final hidden states (request i's 1 + len(drafts[i]) rows in turn),
    the requests and their drafts."""

    hidden: torch.Tensor  # [rows, hidden_size]
    requests: list[Request]
    drafts: list[list[int]]


def _pool_rows(req: Request, row0: int, row1: int, start: int, end: int) -> tuple[Request, list[int], bool]:
    """An embedding request's rows of this step that its pooling reads (row0..row1-1 hold its positions
    start..end-1), and whether its prompt is done after them."""
    final = end == req.num_tokens
    if req.params.pooling == "last":
        rows = [row1 - 1] if final else []
    elif req.params.pooling == "cls":
        rows = [row0] if start == 0 else []
    else:
        rows = list(range(row0, row1))
    return req, rows, final


def pool(request: Request, hidden: torch.Tensor, final: bool) -> None:
    """Fold a step's rows [n, hidden] into the request's pooled state; once its prompt is done, its embedding
    (float32, on the host). A request computed again from its start (preempted) starts its sum again."""
    if request.params.pooling == "mean":
        total = hidden.float().sum(0)
        fresh = request.pooled is None or request.num_computed_tokens == 0
        request.pooled = total if fresh else request.pooled + total
        if final:
            request.embedding = (request.pooled / request.num_prompt_tokens).tolist()
        return
    if hidden.shape[0]:
        request.pooled = hidden[0].float()
    if final:
        request.embedding = request.pooled.tolist()


def sequence_tokens(req: Request, start: int, end: int) -> list[int]:
    """Tokens start..end-1 of prompt + output (a slice of the request's one token list)."""
    return req.all_token_ids[start:end]


@dataclass
class SeqSlice:
    """One sequence's new tokens in a flat batch."""

    tokens: list[int]
    start: int  # position of tokens[0] (= tokens already in the cache)
    block_ids: list[int]  # covering positions 0 .. start + len(tokens) - 1
    as_decode_rows: bool  # each token attends as a decode row (decodes and drafted tokens)
    key: str | None = None  # the request's id: its row in persistent block tables


@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    ends: list[int]  # per slice: its last row + 1 in the flat batch


def build_batch(seqs: list[SeqSlice], block_size: int, device, layer_windows: tuple = (),
                persistent: PersistentBlockTables | None = None) -> Batch:
    """The flat batch and its attention metadata (slots of the new tokens: O(new tokens); decode
    rows as block tables, taken from `persistent` (O(rows + new blocks) in Python; slices need
    their `key`) or else built from the block lists (O(rows x blocks)); prompt chunks with their
    context slots). Decode-row slices must come first."""
    input_ids, positions, slot_mapping, ends = [], [], [], []
    decode_tables: list[list[int]] = []
    decode_slots: list[int] = []
    decode_lengths: list[int] = []
    prefills: list[PrefillSeq] = []
    for seq in seqs:
        row, start, end = len(input_ids), seq.start, seq.start + len(seq.tokens)
        input_ids += seq.tokens
        positions += range(start, end)
        slot_mapping += [seq.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
        if seq.as_decode_rows:
            if prefills:
                raise ValueError("decode rows must come before prompt chunks in a batch")
            if persistent is not None:
                decode_slots += [persistent.update(seq.key, seq.block_ids)] * len(seq.tokens)
            else:
                decode_tables += [seq.block_ids] * len(seq.tokens)
            decode_lengths += range(start + 1, end + 1)
        else:
            table = block_tables([seq.block_ids], [end], block_size)
            context, _ = context_slots(table, torch.tensor([end]), block_size, device)
            prefills.append(PrefillSeq(row, len(seq.tokens), context, start))
        ends.append(len(input_ids))
    tables = lens = None
    if persistent is not None:
        persistent.release_except(seq.key for seq in seqs if seq.as_decode_rows)
        if decode_slots:
            tables = torch.from_numpy(persistent.gather(decode_slots, -(-max(decode_lengths) // block_size)))
    elif decode_tables:
        tables = block_tables(decode_tables, decode_lengths, block_size)
    if decode_lengths:
        lens = torch.tensor(decode_lengths, dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slot_mapping, device=device), block_size, tables, lens, prefills,
                             layer_windows)
    return Batch(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), meta, ends)