"""The OpenAI-compatible HTTP API: the app, its lifespan and its routes. A completion route
checks the engine, prepares the request (brisk.server.prepare) and hands it to a run
(brisk.server.run), which answers and always ends."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from brisk.engine.errors import EngineDeadError
from brisk.loop_lag import LoopLagMonitor
from brisk.metrics.prometheus import CONTENT_TYPE
from brisk.server.bodies import parse_body
from brisk.server.errors import APIError, install_handlers
from brisk.server.logs import EngineStatsLogger
from brisk.server.middleware import GuardMiddleware
from brisk.server.openapi import install_openapi, request_body
from brisk.server.prepare import (chat_chars, check_chars, check_model, check_rendered, decode_checked, encode_chat,
                                  prepare_chat, prepare_completion, prepare_embeddings, prepare_responses,
                                  reasoning_kwargs)
from brisk.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   message_dicts)
from brisk.server.embeddings import EmbeddingRequest
from brisk.server.responses_api import ResponsesRequest
from brisk.server.run import respond
from brisk.server.state import ServerState
from brisk.structured.tools import TOOLS_TEMPLATE_HINT

log = logging.getLogger("brisk.server")

_LOOP_LAG_INTERVAL_S = 0.05  # brisk:event_loop_lag_seconds samples the loop 20 times a second


async def _log_engine_stats(state: ServerState, interval_s: float) -> None:
    """The periodic engine line, from the moment the model is loaded."""
    while state.engine is None:
        if state.load_error is not None:
            return
        await asyncio.sleep(0.5)
    await EngineStatsLogger(state.engine, interval_s).run()


def _lifespan(state: ServerState):
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

    return lifespan


def create_app(state: ServerState) -> FastAPI:
    # /docs is served below with Swagger UI's files from a PyPI package: FastAPI's own loads them from a CDN, and
    # shows a blank page offline
    app = FastAPI(title="brisk", version=_version(), lifespan=_lifespan(state), docs_url=None, redoc_url=None)
    app.state.brisk = state
    install_handlers(app)
    install_openapi(app, state)
    app.add_middleware(GuardMiddleware, state=state)
    _status_routes(app, state)
    _docs_routes(app)
    _engine_routes(app, state)
    _model_routes(app, state)
    _token_routes(app, state)
    _completion_routes(app, state)
    return app


def _status_routes(app: FastAPI, state: ServerState) -> None:
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
            try:  # behind Ray Serve each replica's series carries its id
                stats = await state.engine.stats_by_replica()
                if stats is None:
                    stats = await state.engine.stats()
            except EngineDeadError:
                stats = None
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)


def _docs_routes(app: FastAPI) -> None:
    """Swagger UI at /docs with its JavaScript and CSS from the fastapi-swagger package (Swagger UI 5, which reads
    OpenAPI 3.1; works offline)."""
    from importlib.resources import files

    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount("/docs/static", StaticFiles(directory=str(files("fastapi_swagger") / "resources")), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url=app.openapi_url, title="brisk API",
                                   swagger_js_url="/docs/static/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/static/swagger-ui.css",
                                   swagger_favicon_url="/docs/static/favicon-32x32.png")


def _engine_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/brisk/engine")
    async def engine_view():
        """What the engine is doing now: its stats and a picture of the KV block pool (brisk.server.webui reads it)."""
        engine = state.require_engine()
        stats = await engine.stats()
        picture = await engine.block_map() if hasattr(engine, "block_map") else {}
        return JSONResponse({"stats": stats.to_dict(), **picture})

    if state.config.webui:
        @app.get("/", include_in_schema=False)
        async def webui():
            """The built-in page: a chat that streams, and the engine at work (brisk/server/webui/index.html)."""
            return HTMLResponse(_WEBUI_PAGE.read_text(encoding="utf-8"))


_WEBUI_PAGE = Path(__file__).resolve().parent / "webui" / "index.html"


def _model_routes(app: FastAPI, state: ServerState) -> None:
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
        check_model(state, model_id)
        return model_card(model_id)


def _token_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(raw: Request):
        state.require_engine()
        body = await parse_body(state, raw, TokenizeRequest)
        check_model(state, body.model)
        tok = state.tokenizer
        if body.messages is not None:
            messages = message_dicts(body.messages)
            check_chars(state, chat_chars(messages), "messages")
            check_rendered(messages, tok)
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            if tools and "tools" not in tok.template_variables:
                raise APIError(400, f"tools: this model's chat template does not render tools; {TOOLS_TEMPLATE_HINT}",
                               param="tools", code="invalid_value")
            kwargs = reasoning_kwargs(tok.template_variables, body.reasoning_effort, body.chat_template_kwargs)
            ids = await state.run_tokenizer(lambda: encode_chat(tok, messages, body.add_generation_prompt, tools,
                                                                **kwargs))
        else:
            check_chars(state, len(body.prompt), "prompt")
            ids = await state.run_tokenizer(tok.encode, body.prompt, body.add_special_tokens)
        # a JSONResponse skips FastAPI's per-element encoder (slow on the event loop for long lists)
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids})

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(raw: Request):
        state.require_engine()
        body = await parse_body(state, raw, DetokenizeRequest)
        check_model(state, body.model)
        text = await state.run_tokenizer(decode_checked, state, body.tokens)
        if len(text) > state.config.max_prompt_chars:
            raise APIError(413, f"tokens: decode to {len(text)} characters, over the server's limit of "
                                f"{state.config.max_prompt_chars} (--max-prompt-chars); send fewer tokens per call",
                           param="tokens", code="output_too_large")
        return JSONResponse({"prompt": text})


def _completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(raw: Request):
        engine = state.require_engine()
        body = await parse_body(state, raw, ChatCompletionRequest)
        return await respond(state, engine, raw, body, await prepare_chat(state, body))

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(raw: Request):
        engine = state.require_engine()
        body = await parse_body(state, raw, CompletionRequest)
        return await respond(state, engine, raw, body, await prepare_completion(state, body))

    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def responses(raw: Request):
        engine = state.require_engine()
        body = await parse_body(state, raw, ResponsesRequest)
        chat, prepared = await prepare_responses(state, body)
        return await respond(state, engine, raw, chat, prepared)

    @app.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
    async def embeddings(raw: Request):
        engine = state.require_engine()
        body = await parse_body(state, raw, EmbeddingRequest)
        return await respond(state, engine, raw, body, await prepare_embeddings(state, body))

    @app.get("/v1/responses/{response_id}")
    async def response(response_id: str):
        """A stored response (store: true), as responses.create returned it."""
        found = state.responses.get(response_id)
        if found is None:
            raise APIError(404, f"response {response_id!r} is not in brisk's store (it keeps the last "
                                f"{state.responses.size} responses sent with store: true, in memory)",
                           code="response_not_found")
        return JSONResponse(found[0])


def _version() -> str:
    from brisk import __version__

    return __version__
