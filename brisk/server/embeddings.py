"""`POST /v1/embeddings` for an embedding model (brisk.loading.pooling): each input is a prefill-only request in
the same scheduler and batches as generation (SamplingParams.pooling), its pooled final hidden state comes back,
and the server L2-normalises it where the model does, truncates it to `dimensions` first (Matryoshka models:
truncate, then renormalise), and sends it as floats or base64 (little-endian float32, what the OpenAI SDK asks
for and decodes). An input longer than the context window is a 400, or cut to its first
`truncate_prompt_tokens` tokens when the request asks (vLLM's parameter; -1: to the window)."""

from __future__ import annotations

import base64
from typing import Annotated, Any, ClassVar, Literal, Union

import numpy as np
from pydantic import Field

from brisk.engine.sampling_params import SamplingParams
from brisk.server.context_guard import ContextPolicy, GuardResult
from brisk.server.errors import APIError
from brisk.server.protocol import NonEmptyText, Text, TokenIds, _Request, _int
from brisk.server.responses import Formatter

MAX_INPUTS = 2048  # inputs one request may carry (OpenAI's limit)


class EmbeddingRequest(_Request):
    model: Text | None = None
    input: Union[NonEmptyText, Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_INPUTS)], TokenIds,
                 Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: _int(ge=1) | None = None
    user: Text | None = None  # cosmetic, as on chat
    truncate_prompt_tokens: _int(ge=-1) | None = None  # vLLM's: cut each input to its first N tokens (-1: the window)

    # what a run reads of a body (brisk.server.run): one choice, no stream
    n: ClassVar[int] = 1
    stream: ClassVar[bool] = False
    stream_options: ClassVar[None] = None
    priority: ClassVar[int] = 0
    cache_salt: ClassVar[None] = None

    @property
    def prompt(self):  # --log-prompts
        return self.input

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)


def truncated(ids: list[int], limit: int | None, max_model_len: int, index: int, total: int) -> GuardResult:
    """An input's token ids as embedded: whole, cut to `limit` (-1: the window) when asked, else a 400 when over."""
    param = "input" if total == 1 else f"input[{index}]"
    if not ids:
        raise APIError(400, f"{param}: is empty once tokenized; send some text", param=param, code="invalid_value")
    if limit is not None:
        keep = max_model_len if limit == -1 else min(limit, max_model_len)
        if len(ids) > keep:
            return GuardResult(ids[:keep], 0, ContextPolicy.REJECT, "truncated")
    elif len(ids) > max_model_len:
        raise APIError(400, f"{param}: {len(ids)} tokens exceed this model's context window of {max_model_len}; send "
                            "less text, or ask for truncate_prompt_tokens (its first N tokens are embedded)",
                       param=param, code="context_length_exceeded")
    return GuardResult(ids, 0, ContextPolicy.REJECT)


class EmbeddingFormatter(Formatter):
    object_full = "list"

    def __init__(self, response_id: str, state, body: EmbeddingRequest, normalize: bool):
        super().__init__(response_id, state, want_logprobs=False)
        self.body, self.normalize = body, normalize

    def vector(self, values: list[float]) -> Any:
        v = np.asarray(values, dtype=np.float32)
        if self.body.dimensions is not None:
            if self.body.dimensions > v.size:
                raise APIError(400, f"dimensions: {self.body.dimensions} exceeds this model's {v.size}; ask for at "
                                    f"most {v.size}", param="dimensions", code="invalid_value")
            v = v[:self.body.dimensions]
        if self.normalize:
            norm = float(np.linalg.norm(v))
            v = v / norm if norm > 0 else v
        if self.body.encoding_format == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.tolist()

    def full_response(self, finals, jobs, guards, usage) -> dict[str, Any]:
        data = [{"object": "embedding", "index": job.index, "embedding": self.vector(finals[job.index].embedding)}
                for job in jobs]
        prompt_tokens = usage["prompt_tokens"]
        out = {"object": "list", "data": data, "model": self.model,
               "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
        if any(g.outcome == "truncated" for g in guards):
            out["brisk"] = {"truncated_inputs": [i for i, g in enumerate(guards) if g.outcome == "truncated"]}
        return out


def embedding_params(mode: str) -> SamplingParams:
    return SamplingParams(pooling=mode, max_tokens=1, output_kind="delta")
