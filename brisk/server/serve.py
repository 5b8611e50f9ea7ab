"""`brisk serve`: open the socket at once, load the model in the background, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import uvicorn

from brisk.errors import BriskError
from brisk.loading.report import LoadReport
from brisk.server.app import create_app
from brisk.server.connections import uvicorn_config
from brisk.server.context_guard import ContextPolicy
from brisk.server.state import ServerConfig, ServerState

log = logging.getLogger("brisk.server")


class BriskServer(uvicorn.Server):
    """uvicorn, plus: the first SIGTERM/SIGINT starts brisk's drain (new requests get 503,
    running ones get --shutdown-timeout to finish, then an error)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        loop = self.state.loop
        if loop is not None and not self.state.draining:
            loop.call_soon_threadsafe(self.state.begin_drain, loop)
        # NOTE: not super(): uvicorn re-raises captured signals after shutdown, which would turn
        # a complete, clean drain into a death-by-signal exit status.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True

    def fail(self, message: str) -> None:
        """The model could not load: say so once and exit (a supervisor restarts or alerts)."""
        print(f"brisk: error: {message}", file=sys.stderr)
        self.exit_code = 2
        self.should_exit = True


def server_config(args: argparse.Namespace, served_name: str) -> ServerConfig:
    import os

    try:
        return ServerConfig(
            served_model_name=(args.served_model_name or [served_name])[0],
            model_aliases=tuple(args.served_model_name or ()),
            context_policy=ContextPolicy(args.context_policy),
            max_queued_requests=args.max_queued_requests,
            request_timeout_s=args.request_timeout,
            shutdown_timeout_s=args.shutdown_timeout,
            api_key=args.api_key or os.environ.get("BRISK_API_KEY") or None,
            max_request_bytes=args.max_request_bytes,
            request_log=args.request_log,
            allow_priority=args.allow_priority,
            max_prompt_chars=args.max_prompt_chars,
            max_token_ids=args.max_token_ids,
            max_messages=args.max_messages,
            tokenizer_threads=args.tokenizer_threads,
            metrics_public=args.metrics_public,
            body_timeout_s=args.body_timeout,
            header_timeout_s=args.header_timeout,
            keep_alive_s=args.timeout_keep_alive,
            max_connections=args.max_connections,
            log_requests=not args.disable_log_requests,
            log_prompts=args.log_prompts,
            log_stats_interval_s=None if args.disable_log_stats else args.log_stats_interval,
            reasoning_parser=getattr(args, "reasoning_parser", None),
            tool_call_parser=None if getattr(args, "tool_call_parser", "auto") == "auto" else args.tool_call_parser,
            webui=getattr(args, "webui", True),
        )
    except ValueError as e:
        raise BriskError(str(e)) from None


def warn_about_key_flag(args: argparse.Namespace) -> None:
    if args.api_key:
        log.warning("--api-key is visible to every user of this machine (`ps`); set BRISK_API_KEY instead")


def serve(args: argparse.Namespace, checked, remote_engine=None, on_state=None) -> int:
    """Serve with the socket and model that `preflight` checked (`checked`). `remote_engine`
    (report -> engine) replaces loading the model here (brisk.cluster: the engines are Ray Serve
    replicas); `on_state` sees the ServerState before the socket answers."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    source = checked.source
    config = server_config(args, source.served_name)
    warn_about_key_flag(args)

    def factory(report: LoadReport):
        if remote_engine is not None:
            engine = remote_engine(report)
        else:
            from brisk.engine.factory import load_async_engine

            engine = load_async_engine(args, checked.max_model_len, checked.chat_template, report,
                                       source=checked.source)
        log.info("ready: http://%s:%d/v1 serves %s", args.host, args.port, config.served_model_name)
        return engine

    tracer = None
    if args.otlp_endpoint:
        from brisk.metrics.tracing import RequestTracer

        tracer = RequestTracer.otlp(args.otlp_endpoint, service_name=f"brisk:{config.served_model_name}")
    try:
        state = ServerState(config, factory, tracer=tracer)
    except ValueError as e:
        raise BriskError(str(e)) from None
    if on_state is not None:
        on_state(state)
    app = create_app(state)
    uv_config = uvicorn_config(app, config, args.host, args.port, log_level=args.uvicorn_log_level,
                               timeout_graceful_shutdown=config.shutdown_timeout_s + 5)
    server = BriskServer(uv_config, state)
    state.on_load_failed = server.fail
    log.info("listening on http://%s:%d (model loading; GET /ready)", args.host, args.port)
    asyncio.run(server.serve(sockets=[checked.sock]))  # bound by preflight: a busy port failed there
    log.info(state.stopped_line(server.exit_code))
    return server.exit_code
