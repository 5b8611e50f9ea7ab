"""The OpenAI-compatible HTTP API: routes, admission, the context guard, streaming.

Routes turn a request into engine requests (one per choice), stream or collect the
outputs, and always end: a client that leaves aborts its requests, a timeout or a
shutdown ends them with an error event, and a dead engine ends every open stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from brisk.engine.errors import EngineDeadError
from brisk.engine.outputs import RequestOutput
from brisk.engine.sampling_params import SamplingParams
from brisk.errors import ParamError
from brisk.loop_lag import LoopLagMonitor
from brisk.metrics.prometheus import CONTENT_TYPE
from brisk.server.context_guard import ContextLengthError, GuardResult, combined_headers, guard_chat, guard_prompt
from brisk.server.bodies import parse_body
from brisk.server.errors import APIError, install_handlers
from brisk.server.middleware import GuardMiddleware
from brisk.server.openapi import install_openapi, request_body
from brisk.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   message_dicts)
from brisk.server.logs import EngineStatsLogger
from brisk.server.responses import ChatFormatter, CompletionFormatter, Formatter, usage_block
from brisk.server.state import RequestTimeoutError, ServerState, ShutdownError
from brisk.structured.compiler import CompiledGrammar
from brisk.structured.spec import GrammarSpec, from_request as grammar_spec
from brisk.structured.tools import TOOLS_TEMPLATE_HINT, grammar as tool_grammar, plan as tool_plan, renders_tool_calls
from brisk.tokenizer import ChatTemplateError

log = logging.getLogger("brisk.server")

_DISCONNECT_POLL_S = 0.2
_LOOP_LAG_INTERVAL_S = 0.05  # brisk:event_loop_lag_seconds samples the loop 20 times a second


class ClientDisconnected(Exception):
    pass


async def _log_engine_stats(state: ServerState, interval_s: float) -> None:
    """The periodic engine line, from the moment the model is loaded."""
    while state.engine is None:
        if state.load_error is not None:
            return
        await asyncio.sleep(0.5)
    await EngineStatsLogger(state.engine, interval_s).run()


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.start_loading()
        lag = LoopLagMonitor(_LOOP_LAG_INTERVAL_S, state.metrics.loop_lag.observe)
        lag.start()
        stats = None
        if state.config.log_stats_interval_s:
            stats = asyncio.create_task(_log_engine_stats(state, state.config.log_stats_interval_s))
        yield
        lag.stop()
        if stats is not None:
            stats.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        if state.grammars is not None:
            await asyncio.to_thread(state.grammars.close)  # the compile sandbox's worker process
        if state.tracer is not None:
            await asyncio.to_thread(state.tracer.shutdown)  # flushes the last spans
        if state.request_log is not None:
            state.request_log.close()

    app = FastAPI(title="brisk", version=_version(), lifespan=lifespan)
    app.state.brisk = state
    install_handlers(app)
    install_openapi(app, state)
    app.add_middleware(GuardMiddleware, state=state)

    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        if state.engine is not None and not state.engine.is_alive:
            return JSONResponse({"status": "engine_dead"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.engine is not None and state.engine.is_alive and not state.draining:
            return {"status": "ready", "model": state.config.served_model_name,
                    "load_s": round(state.ready_ts - state.started_ts, 3)}
        if state.draining:
            body = {"status": "draining"}
        elif state.engine is not None:
            body = {"status": "engine_dead"}
        else:
            body = state.loading_status()
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(state.config.retry_after_s)})

    @app.get("/metrics")
    async def metrics():
        stats = None
        if state.engine is not None and state.engine.is_alive:
            try:
                stats = await state.engine.stats()
            except EngineDeadError:
                stats = None
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    def model_card(name: str) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": int(state.started_unix), "owned_by": "brisk"}
        if name != state.config.served_model_name:
            card["root"] = state.config.served_model_name  # an alias of the first name
        if state.engine is not None:
            card["max_model_len"] = state.max_model_len
        return card

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in state.config.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """The OpenAI SDK's models.retrieve."""
        _check_model(state, model_id)
        return model_card(model_id)

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(raw: Request):
        state.require_engine()
        body = await parse_body(state, raw, TokenizeRequest)
        _check_model(state, body.model)
        tok = state.tokenizer
        if body.messages is not None:
            messages = message_dicts(body.messages)
            _check_chars(state, _chat_chars(messages), "messages")
            _check_rendered(messages, tok)
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            if tools and "tools" not in tok.template_variables:
                raise APIError(400, f"tools: this model's chat template does not render tools; {TOOLS_TEMPLATE_HINT}",
                               param="tools", code="invalid_value")
            ids = await state.run_tokenizer(lambda: _encode_chat(tok, messages, body.add_generation_prompt, tools,
                                                                 **(body.chat_template_kwargs or {})))
        else:
            _check_chars(state, len(body.prompt), "prompt")
            ids = await state.run_tokenizer(tok.encode, body.prompt, body.add_special_tokens)
        # a JSONResponse skips FastAPI's per-element encoder (slow on the event loop for long lists)
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids})

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(raw: Request):
        state.require_engine()
        body = await parse_body(state, raw, DetokenizeRequest)
        _check_model(state, body.model)
        text = await state.run_tokenizer(_decode_checked, state, body.tokens)
        if len(text) > state.config.max_prompt_chars:
            raise APIError(413, f"tokens: decode to {len(text)} characters, over the server's limit of "
                                f"{state.config.max_prompt_chars} (--max-prompt-chars); send fewer tokens per call",
                           param="tokens", code="output_too_large")
        return JSONResponse({"prompt": text})

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(raw: Request):
        state.require_engine()
        body = await parse_body(state, raw, ChatCompletionRequest)
        _check_model(state, body.model)
        state.check_capacity(body.n)
        messages = message_dicts(body.messages)
        _check_chars(state, _chat_chars(messages), "messages")
        _check_rendered(messages, state.tokenizer)
        max_tokens = body.max_completion_tokens or body.max_tokens
        tok = state.tokenizer
        tools = _spec(lambda: tool_plan(body, tok.chat_template_source, tok.template_variables,
                                        state.config.tool_call_parser))
        spec = _spec(lambda: _one_constraint(grammar_spec(body), tool_grammar(tools) if tools else None))
        tool_defs = tools.tools if tools else None
        template_kwargs = body.chat_template_kwargs or {}
        guard = await _guard(state, lambda: guard_chat(
            messages, lambda m: _encode_chat(tok, m, tools=tool_defs, **template_kwargs), max_tokens,
            state.max_model_len, state.config.context_policy))
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await _grammar(state, spec)
        params = _sampling_params(body, guard.max_tokens, num_top, grammar)
        if tools is not None and tools.parses and tools.parallel:
            params.tool_plan = tools  # the engine ends a reply that loops on one call
        fmt = ChatFormatter(_new_id("chatcmpl"), state, body.logprobs, tools if tools and tools.parses else None,
                            state.config.reasoning_parser)
        return await _respond(state, raw, body, fmt, [guard], params)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(raw: Request):
        state.require_engine()
        body = await parse_body(state, raw, CompletionRequest)
        _check_model(state, body.model)
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
        return await _respond(state, raw, body, fmt, guards, params)

    return app


# -- request preparation -----------------------------------------------------------
def _chat_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) + len(m.get("name", "")) for m in messages)


def _check_chars(state: ServerState, chars: int, param: str) -> None:
    """Bound the tokenizer's work per request (it runs off the event loop, but still costs CPU)."""
    limit = state.config.max_prompt_chars
    if chars > limit:
        raise APIError(413, f"{param}: {chars} characters, over the server's limit of {limit} per request "
                            f"(--max-prompt-chars); send less text", param=param, code="prompt_too_large")


def _check_rendered(messages: list[dict[str, Any]], tok) -> None:
    """An assistant's earlier tool calls must reach the model: a 400 where the template drops them."""
    if renders_tool_calls(tok.chat_template_source):
        return
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            raise APIError(400, f"messages[{i}].tool_calls: this model's chat template does not render tool calls, "
                                f"so the model would not see them; {TOOLS_TEMPLATE_HINT}",
                           param=f"messages[{i}].tool_calls", code="invalid_messages")


def _decode_checked(state: ServerState, ids: list[int]) -> str:
    """/detokenize's work (in a worker thread): ids inside the vocabulary, then the text."""
    vocab = state.engine.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}]: token id {ids[bad]} is outside the vocabulary [0, {vocab})",
                       param=f"tokens[{bad}]", code="invalid_value")
    return state.tokenizer.decode(ids, skip_special_tokens=False)


def _encode_chat(tok, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
    try:
        return tok.encode_chat(messages, add_generation_prompt, tools=tools, **template_kwargs)
    except ChatTemplateError as e:
        raise APIError(400, f"messages: {e}", param="messages", code="invalid_messages") from None


def _check_model(state: ServerState, model: str | None) -> None:
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
        _check_chars(state, sum(len(t) for t in texts), "prompt")
        return await state.run_tokenizer(lambda: [tok.encode(t) for t in texts])
    prompts = [prompt] if isinstance(prompt[0], int) else prompt  # counted against --max-token-ids when read
    # NOTE: whether the ids are in the vocabulary is the engine's rule (LLMEngine._validate, the one
    # owner of what an engine request may hold, for every caller); its error becomes a 400 in _Run.start
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


# -- running and responding ----------------------------------------------------------
async def _respond(state: ServerState, raw: Request, body, fmt: Formatter, guards: list[GuardResult],
                   params: SamplingParams | list[SamplingParams]):
    """Admit, start one engine request per (prompt, choice), then stream or collect."""
    engine = state.require_engine()
    jobs = []  # (choice index, prompt index, prompt ids, params)
    for p_index, guard in enumerate(guards):
        base = params[p_index] if isinstance(params, list) else params
        for i in range(body.n):
            jobs.append((p_index * body.n + i, p_index, guard.prompt_ids, base.for_choice(i)))
    state.admit(len(jobs))
    for g in guards:
        state.metrics.context_guard.labels(g.outcome).inc()
    headers = combined_headers(guards)
    run = _Run(state, engine, fmt, guards, jobs, body, raw)
    try:
        await run.start()
    except BaseException:
        run.close()
        raise
    for g in guards:
        state.metrics.prompt_tokens.inc(g.prompt_tokens)
    if body.stream:
        return _RunStream(run, headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        result = await _until_disconnect(raw, run.collect())
    except ClientDisconnected:
        log.info("client disconnected before the response of %s; its %d engine request(s) were aborted",
                 fmt.id, len(jobs) - len(run.finals))
        return Response(status_code=499)  # nobody is listening; the engine requests are aborted
    finally:
        run.close()
    return JSONResponse(result, headers={**headers, "server-timing": run.server_timing()})


class _RunStream(StreamingResponse):
    """Server-sent events of a run; the run is closed (engine requests aborted, admission slot
    freed) however the response ends — even if the client left before the first byte."""

    def __init__(self, run: "_Run", headers: dict[str, str]):
        super().__init__(run.sse(), media_type="text/event-stream", headers=headers)
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


async def _until_disconnect(raw: Request, coro):
    """Await `coro`, cancelling it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - cancelled on purpose
                pass
            raise ClientDisconnected()


class _Run:
    """The engine requests behind one HTTP request, merged into one ordered output stream."""

    def __init__(self, state: ServerState, engine, fmt: Formatter, guards: list[GuardResult], jobs, body,
                 raw: Request):
        self.state, self.engine, self.fmt, self.guards, self.jobs, self.body = state, engine, fmt, guards, jobs, body
        self.raw = raw
        self.started = False
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice index, output or failure), every choice's
        self.streams: dict[int, Any] = {}  # choice index -> its engine request's handle
        self.finals: dict[int, RequestOutput] = {}
        self.generated: dict[int, int] = {}  # tokens streamed so far per choice (the trace of an abort)
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.abort_cause = "client_disconnect"
        self.arrival_unix = time.time()  # for the trace of a request the engine never finished

    async def start(self) -> None:
        """Add every engine request (validation errors surface here, before any response)."""
        for index, _, ids, params in self.jobs:
            try:
                priority = self.body.priority if self.state.config.allow_priority else 0
                self.streams[index] = await self.engine.add(ids, params, request_id=f"{self.fmt.id}-{index}",
                                                            priority=priority, cache_salt=self.body.cache_salt,
                                                            sink=(self.queue, index))
            except Exception as e:
                for stream in self.streams.values():
                    stream.close()
                if isinstance(e, EngineDeadError):
                    raise APIError(503, f"engine unavailable: {e}", code="engine_dead") from None
                if isinstance(e, ValueError):
                    raise APIError(400, str(e), param=getattr(e, "field", None), code="invalid_value") from None
                raise
        self.started = True
        if self.state.config.request_timeout_s is not None:
            self.timer = asyncio.get_running_loop().call_later(self.state.config.request_timeout_s, self._timeout)

    def _timeout(self) -> None:
        self.abort_cause = "timeout"
        error = RequestTimeoutError(f"the request ran past the server's --request-timeout "
                                    f"({self.state.config.request_timeout_s:g} s)")
        for index, *_ in self.jobs:
            self.engine.fail(f"{self.fmt.id}-{index}", error)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.jobs)
        while remaining:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):  # the engine already dropped this request
                self.streams[index].mark_done()
                raise item
            if item.produced_at:
                self.state.metrics.delivered.observe(time.monotonic() - item.produced_at)
            self.state.metrics.generation_tokens.inc(len(item.delta_token_ids))
            self.generated[index] = self.generated.get(index, 0) + len(item.delta_token_ids)
            if item.finished:
                remaining -= 1
                self.streams[index].mark_done()
                self._finished(index, item)
            yield index, item

    def _finished(self, index: int, out: RequestOutput) -> None:
        self.finals[index] = out
        self.state.metrics.observe_finished(out.finish_reason, out.metrics)

    async def collect(self) -> dict[str, Any]:
        try:
            async for index, out in self.outputs():
                self.fmt.observe(index, out)
        except asyncio.CancelledError:  # the client left (see _until_disconnect): not an error
            raise
        except BaseException as e:
            raise _as_api_error(e, self) from None
        return self.fmt.full_response(self.finals, self.jobs, self.guards, self._usage())

    async def sse(self) -> AsyncIterator[str]:
        try:
            for chunk in self.fmt.first_chunks(self.jobs, self.guards):
                yield _sse(chunk)
            async for index, out in self.outputs():
                chunks = self.fmt.chunks(index, out, self.body)
                for chunk in chunks:
                    yield _sse(chunk)
                if chunks and out.produced_at:  # resumed: the server wrote the chunk to the socket
                    self.state.metrics.written.observe(time.monotonic() - out.produced_at)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield _sse(self.fmt.usage_chunk(self._usage()))
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream must end with an error event, not hang
            yield _as_api_error(e, self).sse()
            yield "data: [DONE]\n\n"
        finally:
            self.close()

    def _usage(self) -> dict[str, Any]:
        return usage_block(self.finals, self.guards, self.jobs)

    def server_timing(self) -> str:
        first = self.finals.get(0)
        if first is None:
            return ""
        m = first.metrics
        parts = [f"{name};dur={m[key]:.1f}" for name, key in
                 (("queue", "queue_ms"), ("prefill", "prefill_ms"), ("decode", "decode_ms"), ("ttft", "ttft_ms"))
                 if m.get(key) is not None]
        return ", ".join(parts)

    def close(self) -> None:
        """Idempotent: abort the unfinished engine requests, free the slot."""
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        unfinished = len(self.jobs) - len(self.finals)
        for stream in self.streams.values():
            stream.close()  # aborts it unless its final output or failure arrived
        if unfinished and self.started:
            self.state.metrics.aborts.labels(self.abort_cause).inc(unfinished)
        self.state.release(len(self.jobs))
        if self.state.tracer is not None and self.finals:
            self._trace(unfinished)
        if self.state.request_log is not None:
            self._log_requests()
        if self.state.config.log_requests:  # for the access-log line the middleware writes at the end
            usage = self._usage()
            first = self.finals.get(0)
            self.raw.state.brisk_access = {
                "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": max(usage["completion_tokens"], sum(self.generated.values())),
                "ttft_ms": first.metrics.get("ttft_ms") if first is not None else None,
                "finish": ",".join(sorted({o.finish_reason for o in self.finals.values() if o.finish_reason}))
                or self.abort_cause,
                "prompt": _prompt_text(self.body) if self.state.config.log_prompts else None}

    def _log_requests(self) -> None:
        """One trace line per engine request (brisk/trace.py: bench replays it, kv-plan plans from it)."""
        from brisk.trace import TraceRequest, trace_row

        offset = time.time() - time.monotonic()
        for index, p_index, ids, params in self.jobs:
            out = self.finals.get(index)
            m = out.metrics if out is not None else {}
            stamps = m.get("timestamps") or {}
            arrival = stamps["arrival"] + offset if stamps.get("arrival") else self.arrival_unix
            request = TraceRequest(arrival, len(ids), len(out.token_ids) if out is not None else
                                   self.generated.get(index, 0),
                                   params.max_tokens, finish_reason=out.finish_reason if out is not None
                                   else self.abort_cause)
            self.state.request_log.write(trace_row(
                request, request_id=f"{self.fmt.id}-{index}", route=self.raw.url.path,
                cached_prompt_tokens=out.num_cached_prompt_tokens if out is not None else None,
                context_outcome=self.guards[p_index].outcome,
                **{k: m.get(k) for k in ("queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "e2e_ms")}))

    def _trace(self, unfinished: int) -> None:
        choices = []
        for index, p_index, ids, _ in self.jobs:
            out = self.finals.get(index)
            if out is not None:
                choices.append({"metrics": out.metrics, "prompt_tokens": len(ids), "output_tokens": len(out.token_ids),
                                "cached_tokens": out.num_cached_prompt_tokens,
                                "attributes": {"brisk.choice_index": index, "brisk.finish_reason": out.finish_reason}})
        usage = self._usage()
        guard = self.guards[0]
        attributes = {"http.route": self.raw.url.path, "gen_ai.system": "brisk",
                      "gen_ai.request.model": self.state.config.served_model_name, "brisk.request_id": self.fmt.id,
                      "gen_ai.usage.input_tokens": usage["prompt_tokens"],
                      "gen_ai.usage.output_tokens": usage["completion_tokens"],
                      "brisk.context_guard.outcome": guard.outcome, "brisk.context_policy": guard.policy.value,
                      "brisk.n": len(self.jobs), "brisk.stream": bool(self.body.stream)}
        if guard.truncated_messages:
            attributes["brisk.context_guard.truncated_messages"] = guard.truncated_messages
        if guard.max_tokens_clamped_to is not None:
            attributes["brisk.context_guard.max_tokens_clamped_to"] = guard.max_tokens_clamped_to
        error = f"{unfinished} choice(s) ended early: {self.abort_cause}" if unfinished else None
        self.state.tracer.record(f"POST {self.raw.url.path}", self.raw.headers, attributes, choices, error)


def _as_api_error(e: BaseException, run: _Run) -> APIError:
    if isinstance(e, APIError):
        if e.code == "replica_lost":  # the Ray replica serving it died: not the client's doing
            run.abort_cause = "replica_lost"
        return e
    if isinstance(e, RequestTimeoutError):
        run.abort_cause = "timeout"
        return APIError(504, str(e), code="timeout")
    if isinstance(e, ShutdownError):
        run.abort_cause = "shutdown"
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineDeadError):
        run.abort_cause = "engine_error"
        return APIError(503, f"the engine stopped: {e}; restart the server", code="engine_dead")
    log.exception("request failed", exc_info=e)
    run.abort_cause = "error"
    return APIError(500, "internal server error; the server log has the details")


def _prompt_text(body) -> str:
    """The request's prompt for --log-prompts, shortened to 2,000 characters."""
    if getattr(body, "messages", None) is not None:
        text = " | ".join(f"{m.role}: {m.content if isinstance(m.content, str) else '[parts]'}" for m in body.messages)
    else:
        text = str(body.prompt)
    return text if len(text) <= 2000 else text[:2000] + "..."


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _version() -> str:
    from brisk import __version__

    return __version__
