"""What the server knows about itself: its settings, the load state (the HTTP socket is
open before the model is ready), the engine once loaded, admission (the bounded queue)
and draining on shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from brisk.loading.report import LoadReport
from brisk.metrics.prometheus import ServerMetrics
from brisk.server.context_guard import ContextPolicy
from brisk.server.reasoning import HARMONY
from brisk.errors import BriskError
from brisk.server.errors import APIError
from brisk.server.protocol import MAX_CHOICES
from brisk.server.responses_api import ResponseStore
from brisk.structured.compiler import GrammarCompiler

if TYPE_CHECKING:
    from brisk.engine.client import EngineClient
    from brisk.metrics.tracing import RequestTracer

log = logging.getLogger("brisk.server")

# The phases of a load, in order, for the readiness progress figure.
LOAD_PHASES = ("imports", "resolve", "gguf_read", "dequantize_write", "config", "open_mmap", "module_build",
               "tokenizer", "first_forward", "engine")


class ShutdownError(RuntimeError):
    """The server shut down before the request finished (after --shutdown-timeout)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past --request-timeout."""


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = "smollm2-135m-instruct"
    model_aliases: tuple[str, ...] = ()  # more names requests may use (vLLM's --served-model-name A B)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model answers to; responses carry the first."""
        return (self.served_model_name, *[a for a in self.model_aliases if a != self.served_model_name])
    context_policy: ContextPolicy = ContextPolicy.REJECT
    max_queued_requests: int = 256
    request_timeout_s: float | None = None
    shutdown_timeout_s: float = 30.0
    api_key: str | None = None
    max_request_bytes: int = 16 * 2**20
    retry_after_s: int = 2
    request_log: str | None = None  # JSONL path, one line per finished engine request
    allow_priority: bool = False  # honour the request's `priority` (else any client could jump the queue)
    max_prompt_chars: int = 1_000_000  # characters of text one request may ask the tokenizer to encode
    max_token_ids: int = 262_144  # token ids one request may send (/detokenize, token-id prompts)
    # messages one request may send: each costs template work beyond its characters (10,000 one-character
    # messages render and tokenize in ~0.2 s here; 400,000 took 8.5 s)
    max_messages: int = 10_000
    tokenizer_threads: int = 2  # requests tokenizing at once (off the event loop); the rest wait
    metrics_public: bool = False  # serve /metrics without the API key (for a scraper without one)
    body_timeout_s: float = 30.0  # a request body must arrive within this (slow clients hold a task each)
    header_timeout_s: float = 15.0  # a request head must arrive within this of connecting (or of its first byte)
    keep_alive_s: float = 75.0  # an idle keep-alive connection is closed after this (past clients' pool expiry)
    max_connections: int = 1000  # open connections at most; past it the oldest idle one is closed, or, none idle, 503
    log_requests: bool = False  # one access-log line per request (brisk serve: on unless --disable-log-requests)
    log_prompts: bool = False  # the prompt text in that line
    log_stats_interval_s: float | None = None  # the periodic engine line (brisk serve: every 10 s while busy)
    reasoning_parser: str | None = None  # --reasoning-parser: <think> into reasoning_content
    tool_call_parser: str | None = None  # --tool-call-parser; None: from the chat template
    webui: bool = True  # GET / serves the built-in page (brisk.server.webui); --no-webui turns it off

    def __post_init__(self):
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout_s}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"--max-prompt-chars must be >= 1, got {self.max_prompt_chars}")
        if self.max_token_ids < 1:
            raise ValueError(f"--max-token-ids must be >= 1, got {self.max_token_ids}")
        if self.max_messages < 1:
            raise ValueError(f"--max-messages must be >= 1, got {self.max_messages}")
        for flag, value in (("--header-timeout", self.header_timeout_s), ("--timeout-keep-alive", self.keep_alive_s)):
            if value <= 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"--body-timeout must be > 0 seconds, got {self.body_timeout_s}")
        if self.tokenizer_threads < 1:
            raise ValueError(f"--tokenizer-threads must be >= 1, got {self.tokenizer_threads}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty; set BRISK_API_KEY to a non-empty key or leave it unset")


EngineFactory = Callable[[LoadReport], "EngineClient"]


class ServerState:
    def __init__(self, config: ServerConfig, engine_factory: EngineFactory | None = None,
                 engine: EngineClient | None = None, tracer: RequestTracer | None = None):
        self.config = config
        self.metrics = ServerMetrics()
        self.tracer = tracer  # None: no tracing work at all
        self.request_log = open_request_log(config.request_log) if config.request_log else None
        self.report = LoadReport()
        self.engine: EngineClient | None = None
        self.load_error: str | None = None
        self.started_ts = time.monotonic()
        self.started_unix = time.time()  # the `created` of /v1/models
        self.ready_ts: float | None = None
        self.draining = False
        self.drained_from = 0  # requests in flight when the drain began
        self.drain_cut = 0  # of them, those still running at --shutdown-timeout (ended with an error)
        self.num_active = 0  # engine requests admitted and not yet finished
        self._factory = engine_factory
        self.on_load_failed: Callable[[str], None] | None = None  # set by `brisk serve`: exit
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, set at startup
        self._tokenizer_slots: asyncio.Semaphore | None = None
        self.grammars: GrammarCompiler | None = None  # structured outputs, set with the engine
        self.responses = ResponseStore()  # the Responses API's stored responses (store: true), in memory
        if engine is not None:
            self._set_ready(engine)

    @property
    def reasoning_parser(self) -> str | None:
        """--reasoning-parser, or the model family's own: gpt-oss replies in harmony (brisk.structured.harmony)."""
        if self.config.reasoning_parser:
            return self.config.reasoning_parser
        engine = self.engine
        return HARMONY if engine is not None and engine.model_info.architecture == "GptOssForCausalLM" else None

    # -- loading ----------------------------------------------------------------
    def start_loading(self) -> None:
        """Load in a thread, so the socket answers /ready (503, with the phase) meanwhile."""
        if self.engine is not None or self._factory is None:
            return
        threading.Thread(target=self._load, name="brisk-load", daemon=True).start()

    def _load(self) -> None:
        try:
            engine = self._factory(self.report)
        except Exception as e:  # noqa: BLE001 - reported on /ready and /health, then the server exits
            self.load_error = str(e) or repr(e)
            self.metrics.set_load_state("failed")
            log.error("model load failed: %s", self.load_error)
            if self.on_load_failed is not None:
                self.on_load_failed(self.load_error)
            return
        self._set_ready(engine)

    def _set_ready(self, engine: EngineClient) -> None:
        info = engine.model_info
        if info.load_phases_ms:
            self.metrics.observe_load(info.load_phases_ms, info.load_total_ms)
        else:
            self.metrics.observe_load(self.report.phases_ms, self.report.total_ms)
        self.metrics.build_info.labels(_version(), self.config.served_model_name, info.dtype, info.device).set(1)
        tok = engine.tokenizer
        self.grammars = GrammarCompiler(tok.fast, engine.vocab_size, tok.eos_token_ids)
        # llguidance's first use in a process costs 0.4-1.9 s: pay it now, not in the first request
        threading.Thread(target=self._warm_grammars, name="brisk-grammar-warm-up", daemon=True).start()
        self.ready_ts = time.monotonic()
        # Published last: the event loop takes `engine is not None` as "ready" (/ready reads ready_ts,
        # requests read grammars). Set first, a /ready landing between the two raised a 500 (seen
        # during a 7B warm start's polling).
        self.engine = engine
        # The model, tokenizer and imports are permanent: move them out of the cyclic GC's reach, so a
        # full collection walks only request-time objects (measured: gen-2 pauses of 90-270 ms in a
        # loaded process, each one stalling every stream), as vLLM does after its start-up. No
        # gc.collect() first: after a load it found nothing to free and cost 129 ms of start-up.
        gc.freeze()
        self.metrics.set_load_state("ready")

    def _warm_grammars(self) -> None:
        try:
            log.debug("structured outputs warmed up in %.2f s", self.grammars.warm_up())
        except Exception as e:  # noqa: BLE001 - a request will report the same failure with its field
            if not self.grammars.sandbox.closed:  # stopped before its warm-up ran: nothing to report
                log.warning("structured outputs unavailable: %s", e)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def loading_status(self) -> dict:
        if self.load_error is not None:
            return {"status": "failed", "error": self.load_error}
        phase = self.report.current_phase or "starting"
        done = sum(1 for p in LOAD_PHASES if p in self.report.phases_ms and p != self.report.current_phase)
        return {"status": "loading", "phase": phase, "progress": round(done / len(LOAD_PHASES), 2),
                "elapsed_s": round(time.monotonic() - self.started_ts, 2)}

    # -- tokenizing off the event loop ---------------------------------------------------
    async def run_tokenizer(self, fn: Callable, *args):
        """Run tokenizer work (encode, chat template, decode) in a worker thread, at most
        --tokenizer-threads at once, so /health and running streams never wait behind it."""
        if self._tokenizer_slots is None:
            self._tokenizer_slots = asyncio.Semaphore(self.config.tokenizer_threads)
        async with self._tokenizer_slots:
            return await asyncio.to_thread(fn, *args)

    # -- admission ----------------------------------------------------------------
    def require_engine(self) -> EngineClient:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", code="shutting_down",
                           headers=retry)
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
            status = self.loading_status()
            raise APIError(503, f"the model is still loading (phase {status['phase']}, "
                                f"{status['progress']:.0%} done); retry after {self.config.retry_after_s} s",
                           code="model_loading", headers=retry)
        if not self.engine.is_alive:
            raise APIError(503, "the engine stopped after an internal error; restart the server",
                           code="engine_dead")
        return self.engine

    @property
    def capacity(self) -> int:
        """Engine requests in flight at most: max_num_seqs running plus --max-queued-requests waiting."""
        return self.engine.max_num_seqs + self.config.max_queued_requests

    def check_capacity(self, n: int) -> None:
        """A request needing more engine requests than the server ever holds can never be admitted:
        a 400 (a retry cannot help), not a 429."""
        if n > self.capacity:
            raise APIError(400, f"this request needs {n} sequences (prompts x n), more than this server's capacity "
                                f"of {self.capacity} (max-num-seqs + max-queued-requests); lower n or send fewer "
                                f"prompts per request", param="n", code="exceeds_capacity")

    def check_prompt_list(self, num_prompts: int, n: int) -> None:
        """/v1/completions with a list of prompts: up to the capacity of them with n = 1; with n > 1 up to
        capacity // (the most choices a request may ask), so that prompts x n always fits. (The exact
        rule, prompts x n <= capacity, a JSON schema states only with a branch per n, which schema tools
        cannot generate from; this one the document states exactly.)"""
        most_choices = min(MAX_CHOICES, self.capacity)
        limit = self.capacity if n <= 1 else self.capacity // most_choices
        if num_prompts > limit:
            raise APIError(400, f"prompt: {num_prompts} prompts, more than the {limit} a request may list with "
                                f"n = {n} (this server's capacity of {self.capacity} sequences"
                                + (f", shared by up to {most_choices} choices of each prompt); send n = 1, or fewer "
                                   "prompts per request" if n > 1 else "); send fewer prompts per request"),
                           param="prompt", code="exceeds_capacity")

    def admit(self, n: int) -> None:
        """Bounded queue: up to max_num_seqs running plus --max-queued-requests waiting. (A request
        that could never fit was refused by check_capacity while it was prepared.)"""
        capacity = self.capacity
        if self.num_active + n > capacity:
            raise APIError(429, f"server overloaded: {self.num_active} requests in flight, capacity {capacity} "
                                f"(max-num-seqs + max-queued-requests); retry after {self.config.retry_after_s} s",
                           code="overloaded", headers={"Retry-After": str(self.config.retry_after_s)})
        self.num_active += n

    def release(self, n: int) -> None:
        self.num_active -= n

    # -- shutdown -----------------------------------------------------------------
    def begin_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop admitting; after --shutdown-timeout, end whatever still runs with an error."""
        if self.draining:
            return
        self.draining = True
        self.drained_from = self.num_active
        log.info("draining: %d requests in flight, up to %.0f s", self.num_active, self.config.shutdown_timeout_s)
        if self.engine is not None:
            loop.call_later(self.config.shutdown_timeout_s, self._end_drain, self.engine)

    def _end_drain(self, engine) -> None:
        self.drain_cut = self.num_active
        engine.fail_all(ShutdownError(f"the server shut down (after the {self.config.shutdown_timeout_s:g} s "
                                      "drain timeout) before this request finished"))

    def stopped_line(self, exit_code: int) -> str:
        """The last line `brisk serve` logs: how the drain went, so a log ends with the outcome, not mid-story."""
        if not self.draining:
            return f"stopped (exit {exit_code})"
        cut = self.drain_cut
        return (f"stopped (exit {exit_code}): {self.drained_from} requests were in flight at shutdown, "
                f"{self.drained_from - cut} finished, {cut} ended by the {self.config.shutdown_timeout_s:g} s "
                "drain timeout")


def open_request_log(path: str):
    """The request log is a trace (brisk/trace.py): bench replays it and kv-plan plans from it."""
    from brisk.trace import TraceWriter

    try:
        return TraceWriter(path)
    except BriskError as e:
        raise ValueError(f"--request-log {e}") from None


def _version() -> str:
    from brisk import __version__

    return __version__
