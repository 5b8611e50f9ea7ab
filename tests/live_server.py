"""A real uvicorn server on 127.0.0.1 (ephemeral port) in a background thread, for e2e tests."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import uvicorn

from brisk.server.app import create_app
from brisk.server.connections import uvicorn_config
from brisk.server.state import ServerConfig, ServerState


class LiveServer:
    def __init__(self, state: ServerState):
        self.state = state
        self.app = create_app(state)
        config = uvicorn_config(self.app, state.config, "127.0.0.1", 0, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.url = ""

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                             timeout=60, **kwargs)

    def engine_stats(self):
        """Engine stats taken on the engine thread (consistent between steps)."""
        loop = self.state.loop
        return asyncio.run_coroutine_threadsafe(self.state.engine.stats(), loop).result(timeout=30)

    def post_and_disconnect(self, path: str, body: dict, timeout_s: float = 30.0) -> None:
        """POST `body` on a raw connection and close it once the engine runs the request: a client
        that gives up mid-request, made by an event rather than a client timeout racing the reply."""
        import json
        import socket

        host, port = self.url[7:].split(":")
        data = json.dumps(body).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            deadline = time.monotonic() + timeout_s
            while self.engine_stats().num_running == 0:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the request did not start within {timeout_s} s")
                time.sleep(0.02)

    def wait_idle(self, timeout_s: float = 30.0):
        """Bounded wait until no request runs or waits; returns the stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine_stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {timeout_s} s: {stats}")
            time.sleep(0.05)


def serve_engine(engine, **config) -> LiveServer:
    from brisk.engine.async_engine import AsyncLLMEngine

    async_engine = engine if isinstance(engine, AsyncLLMEngine) else AsyncLLMEngine(engine)
    return LiveServer(ServerState(ServerConfig(**config), engine=async_engine))
