"""Offline API: `LLM(model).generate(prompts, SamplingParams) -> list[RequestOutput]`."""

from __future__ import annotations

from typing import Any, Sequence

from brisk.config import DEFAULT_BLOCK_SIZE, CacheConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.outputs import RequestOutput
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import SchedulerConfig
from brisk.engine.spec_decode.config import SpeculativeConfig
from brisk.loading.loader import load
from brisk.structured.compiler import GrammarCompiler


class LLM:
    def __init__(self, model: str | None = None, *, device: str | None = None, dtype: str | None = None,
                 quantization: str = "auto",
                 max_model_len: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE, kv_cache_memory: int | None = None,
                 num_blocks: int | None = None, enable_prefix_caching: bool = True, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, seed: int = 0,
                 speculative_config: dict[str, Any] | None = None, batch_invariant: bool | None = None,
                 kv_cache_dtype: str = "auto"):
        # vLLM's argument: {"method": "ngram", "num_speculative_tokens": 4} or {"model": PATH, ...}
        speculative = SpeculativeConfig.parse(speculative_config) if speculative_config is not None else None
        cache = CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                            enable_prefix_caching=enable_prefix_caching, num_gpu_blocks_override=num_blocks,
                            kv_cache_dtype=kv_cache_dtype)  # a bad value is refused before the model loads
        self.loaded = load(model, device=device, dtype=dtype, max_model_len=max_model_len,
                           quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = load(speculative.model, device=str(self.loaded.device), dtype=dtype,
                         max_model_len=self.loaded.max_model_len, quantization=quantization, warmup=False)
        self.engine = LLMEngine(
            self.loaded,
            cache,
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=self.loaded.max_model_len),
            seed=seed, speculative=speculative, draft=draft, batch_invariant=batch_invariant,
        )
        self.tokenizer = self.loaded.tokenizer
        # structured outputs: SamplingParams(grammar=llm.grammars.compile(spec)), spec from brisk.structured.spec
        self.grammars = GrammarCompiler(self.tokenizer.fast, self.loaded.config.vocab_size, self.tokenizer.eos_token_ids)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in prompt order. A request whose own
        work failed (RequestOutput.error) ends with finish_reason "error"; the others complete."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p if isinstance(p, str) else list(p), sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], params)
