"""Turning an HTTP request into engine requests: the checks that answer before any engine work
(model name, characters, what the template renders), the prompt's token ids, the context guard,
the grammar, and the sampling parameters; `prepare_chat` / `prepare_completion` do it per route."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

from brisk.engine.sampling_params import SamplingParams
from brisk.errors import ParamError
from brisk.server.context_guard import ContextLengthError, GuardResult, guard_chat, guard_prompt
from brisk.server.embeddings import EmbeddingFormatter, EmbeddingRequest, embedding_params, truncated
from brisk.server.errors import APIError
from brisk.server.protocol import ChatCompletionRequest, CompletionRequest, message_dicts
from brisk.server.responses import ChatFormatter, CompletionFormatter, Formatter
from brisk.server.responses_api import ResponsesFormatter, ResponsesRequest, chat_request, response_id
from brisk.server.reasoning import HARMONY
from brisk.structured import harmony
from brisk.server.state import ServerState
from brisk.structured.compiler import CompiledGrammar
from brisk.structured.spec import GrammarSpec, from_request as grammar_spec
from brisk.structured.tools import TOOLS_TEMPLATE_HINT, grammar as tool_grammar, plan as tool_plan, renders_tool_calls
from brisk.tokenizer import ChatTemplateError


@dataclass
class Prepared:
    """What a completion route hands to the run: the response formatter, one context-guard result
    per prompt, and the sampling parameters (one for all prompts, or one per prompt)."""

    fmt: Formatter
    guards: list[GuardResult]
    params: SamplingParams | list[SamplingParams]


GENERATION_ROUTES = "/v1/chat/completions, /v1/completions and /v1/responses"


def check_generative(state: ServerState) -> None:
    """An embedding model answers /v1/embeddings only."""
    pooling = state.engine.pooling if state.engine is not None else None
    if pooling is not None:
        raise APIError(400, f"this model is an embedding model ({pooling.describe()}): it serves /v1/embeddings, not "
                            f"{GENERATION_ROUTES}; serve a generative model for those (or --pooling none to generate "
                            "with it)", code="wrong_model_type")


def check_embedding(state: ServerState):
    """A generative model answers the generation routes only; returns the embedding model's pooling."""
    pooling = state.engine.pooling if state.engine is not None else None
    if pooling is None:
        raise APIError(400, f"this model is generative: it serves {GENERATION_ROUTES}, not /v1/embeddings; serve an "
                            "embedding model (sentence-transformers files, a GGUF with a pooling type) or pass "
                            "--pooling last|mean|cls", code="wrong_model_type")
    return pooling


async def prepare_embeddings(state: ServerState, body: EmbeddingRequest) -> Prepared:
    check_model(state, body.model)
    pooling = check_embedding(state)
    inputs = body.inputs()
    state.check_prompt_list(len(inputs), 1)
    state.check_capacity(len(inputs))
    ids = await _prompt_ids(state, body.input)  # the tokenizer's special tokens too, as sentence-transformers adds them
    guards = [truncated(i, body.truncate_prompt_tokens, state.max_model_len, n, len(ids)) for n, i in enumerate(ids)]
    fmt = EmbeddingFormatter(_new_id("embd"), state, body, pooling.normalize)
    return Prepared(fmt, guards, [embedding_params(pooling.mode) for _ in guards])


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Prepared:
    check_model(state, body.model)
    check_generative(state)
    state.check_capacity(body.n)
    messages = message_dicts(body.messages)
    check_chars(state, chat_chars(messages), "messages")
    check_rendered(messages, state.tokenizer)
    max_tokens = body.max_completion_tokens or body.max_tokens
    tok = state.tokenizer
    tools = _spec(lambda: tool_plan(body, tok.chat_template_source, tok.template_variables,
                                    state.config.tool_call_parser))

    def forced_calls():
        if tools is None:
            return None
        if state.reasoning_parser == HARMONY:  # gpt-oss: calls in harmony's own syntax
            special = {t.content for t in tok.fast.get_added_tokens_decoder().values() if t.special}
            return harmony.call_grammar(tools, special)
        return tool_grammar(tools)

    spec = _spec(lambda: _one_constraint(grammar_spec(body), forced_calls()))
    tool_defs = tools.tools if tools else None
    template_kwargs = reasoning_kwargs(tok.template_variables, body.reasoning_effort, body.chat_template_kwargs)
    guard = await _guard(state, lambda: guard_chat(
        messages, lambda m: encode_chat(tok, m, tools=tool_defs, **template_kwargs), max_tokens,
        state.max_model_len, state.config.context_policy))
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await _grammar(state, spec)
    params = _sampling_params(body, guard.max_tokens, num_top, grammar)
    parser = state.reasoning_parser
    if parser == HARMONY:  # the channel markers are special tokens: the parser reads them in the text
        params.skip_special_tokens = False
    elif tools is not None and tools.parses and tools.parallel:
        params.tool_plan = tools  # the engine ends a reply that loops on one call
    fmt = ChatFormatter(_new_id("chatcmpl"), state, body.logprobs, tools if tools and tools.parses else None, parser)
    return Prepared(fmt, [guard], params)


async def prepare_responses(state: ServerState, body: ResponsesRequest) -> tuple[ChatCompletionRequest, Prepared]:
    """A Responses request as the chat completion it is computed as (brisk.server.responses_api), with a
    formatter that answers in Responses items and events."""
    check_generative(state)
    history = state.responses.history(body.previous_response_id) if body.previous_response_id else []
    chat, conversation = chat_request(body, history)
    prepared = await prepare_chat(state, chat)
    chat_fmt = prepared.fmt
    prepared.fmt = ResponsesFormatter(response_id(), state, body, chat_fmt.tools, chat_fmt.reasoning_parser,
                                      conversation)
    return chat, prepared


async def prepare_completion(state: ServerState, body: CompletionRequest) -> Prepared:
    check_model(state, body.model)
    check_generative(state)
    num_prompts = 1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else len(body.prompt)
    state.check_prompt_list(num_prompts, body.n)
    state.check_capacity(num_prompts * body.n)
    prompts = await _prompt_ids(state, body.prompt)
    guards = [await _guard(state, lambda ids=ids: guard_prompt(ids, body.max_tokens, state.max_model_len,
                                                                state.config.context_policy))
              for ids in prompts]
    grammar = await _grammar(state, _spec(lambda: grammar_spec(body)))
    params = [_sampling_params(body, g.max_tokens, body.logprobs, grammar) for g in guards]
    fmt = CompletionFormatter(_new_id("cmpl"), state, body.logprobs is not None, body.echo)
    return Prepared(fmt, guards, params)


def reasoning_kwargs(variables: set[str], effort: str | None, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat template's variables for a request's reasoning_effort (chat_template_kwargs win where both say):
    a template that reads `reasoning_effort` gets it as sent (gpt-oss: low, medium, high in its system message);
    one that reads `enable_thinking` (Qwen3, Qwen3-MoE, SmolLM3) thinks unless the effort is none or minimal;
    a template that reads neither cannot honour it: a 400, never an effort silently dropped."""
    kwargs = dict(kwargs or {})
    if effort is None:
        return kwargs
    if "reasoning_effort" in variables:
        return {"reasoning_effort": effort, **kwargs}
    if "enable_thinking" in variables:
        return {"enable_thinking": effort not in ("none", "minimal"), **kwargs}
    raise APIError(400, f"reasoning_effort: this model's chat template reads neither reasoning_effort nor "
                        f"enable_thinking, so {effort!r} would change nothing; remove it, or serve a reasoning "
                        "model (Qwen3, gpt-oss) or a --chat-template that reads it", param="reasoning_effort",
                   code="invalid_value")


def chat_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) + len(m.get("name", "")) for m in messages)


def check_chars(state: ServerState, chars: int, param: str) -> None:
    """Bound the tokenizer's work per request (it runs off the event loop, but still costs CPU)."""
    limit = state.config.max_prompt_chars
    if chars > limit:
        raise APIError(413, f"{param}: {chars} characters, over the server's limit of {limit} per request "
                            f"(--max-prompt-chars); send less text", param=param, code="prompt_too_large")


def check_rendered(messages: list[dict[str, Any]], tok) -> None:
    """An assistant's earlier tool calls must reach the model: a 400 where the template drops them."""
    if renders_tool_calls(tok.chat_template_source):
        return
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            raise APIError(400, f"messages[{i}].tool_calls: this model's chat template does not render tool calls, "
                                f"so the model would not see them; {TOOLS_TEMPLATE_HINT}",
                           param=f"messages[{i}].tool_calls", code="invalid_messages")


def decode_checked(state: ServerState, ids: list[int]) -> str:
    """/detokenize's work (in a worker thread): ids inside the vocabulary, then the text."""
    vocab = state.engine.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}]: token id {ids[bad]} is outside the vocabulary [0, {vocab})",
                       param=f"tokens[{bad}]", code="invalid_value")
    return state.tokenizer.decode(ids, skip_special_tokens=False)


def encode_chat(tok, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
    try:
        return tok.encode_chat(messages, add_generation_prompt, tools=tools, **template_kwargs)
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages", code="invalid_messages") from None


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.config.model_names:
        shown = model if len(model) <= 100 else model[:100] + "..."
        raise APIError(404, f"The model `{shown}` does not exist; this server serves "
                            + ", ".join(f"`{n}`" for n in state.config.model_names) + " (GET /v1/models)",
                       param="model", code="model_not_found")


async def _prompt_ids(state: ServerState, prompt) -> list[list[int]]:
    """OpenAI's four prompt shapes -> a list of token-id prompts (the schema has checked the shapes)."""
    tok = state.tokenizer
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        texts = [prompt] if isinstance(prompt, str) else prompt
        check_chars(state, sum(len(t) for t in texts), "prompt")
        return await state.run_tokenizer(lambda: [tok.encode(t) for t in texts])
    prompts = [prompt] if isinstance(prompt[0], int) else prompt  # counted against --max-token-ids when read
    # NOTE: whether the ids are in the vocabulary is the engine's rule (LLMEngine._validate, the one
    # owner of what an engine request may hold, for every caller); its error becomes a 400 in Run.start
    return [list(p) for p in prompts]


async def _guard(state: ServerState, run: Callable[[], GuardResult]) -> GuardResult:
    """Count and fit the prompt off the event loop. The outcome is counted once the request is
    admitted (a request refused for capacity is no context-guard "ok")."""
    try:
        return await state.run_tokenizer(run)
    except ContextLengthError as e:
        state.metrics.context_guard.labels("rejected").inc()
        raise APIError(400, str(e), param=e.param, code=e.code) from None


def _one_constraint(output: GrammarSpec | None, tools: GrammarSpec | None) -> GrammarSpec | None:
    if output is not None and tools is not None:
        raise ParamError(output.field, "cannot constrain the output together with a forced tool call "
                                       "(tool_choice required or a named function); keep one")
    return output or tools


def _spec(build: Callable[[], GrammarSpec | None]) -> GrammarSpec | None:
    try:
        return build()
    except ParamError as e:
        raise APIError(400, str(e), param=e.field, code="invalid_value") from None


async def _grammar(state: ServerState, spec: GrammarSpec | None) -> CompiledGrammar | None:
    """Compile (or fetch from the cache) in a worker thread: never on the engine's step loop."""
    if spec is None:
        return None
    try:
        return await state.run_tokenizer(state.grammars.compile, spec)
    except ParamError as e:
        raise APIError(400, str(e), param=e.field, code="invalid_grammar") from None


def _logit_bias(body) -> dict[int, float] | None:
    """OpenAI's string keys (checked to be token ids by the protocol) as ints."""
    return {int(key): value for key, value in body.logit_bias.items()} if body.logit_bias else None


def _sampling_params(body, max_tokens: int, logprobs: int | None, grammar: CompiledGrammar | None = None
                     ) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    top_k = body.top_k
    if top_p == 0.0:  # OpenAI accepts top_p=0: keep only the most likely token
        top_p, top_k = 1.0, 1
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=body.min_p,
            seed=body.seed, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, stop=body.stop or [], stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, logprobs=logprobs, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output, logit_bias=_logit_bias(body),
            grammar=grammar, output_kind="delta", speculative=body.speculative)
    except ParamError as e:
        raise APIError(400, str(e), param=e.field, code="invalid_value") from None


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
