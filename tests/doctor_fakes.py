"""Small OpenAI-compatible servers that misbehave in exactly one way, for `brisk doctor`'s
tests. A "token" is a whitespace-separated word; generation is simulated with sleeps.

    python tests/doctor_fakes.py PORT '{"serial": true}'
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

WINDOW = 4096
TOKEN_DELAY_S = 0.004
# A serial server's request must outlast the client's own per-request overhead (HTTP, parsing:
# 5-20 ms on a loaded 2-core CI box) by far, as a real one's (seconds) does; otherwise the ramp's
# parallel clients overlap that overhead with service and "serial" measures x1.1 or more.
SERIAL_TOKEN_DELAY_S = 0.02
PREFILL_S_PER_TOKEN = 0.000005


def create_app(truncate_to: int | None = None, cold_start_s: float = 0.0, first_request_delay_s: float = 0.0,
               buffered: bool = False, serial: bool = False, accept_overlong: bool = False,
               compute_bound: bool = False, kv_pressure: bool = False, hang_over: int | None = None,
               kv_tier_churn: bool = False) -> FastAPI:
    """Each flag is one misbehaviour:
    - truncate_to: keeps only the last N tokens of a prompt, silently, and reports N;
    - accept_overlong: takes prompts over its advertised window and processes (reports) all of them;
    - compute_bound: streams share one processor (each token takes longer the more streams run),
      with vLLM-style /metrics showing an almost empty KV cache and no preemptions;
    - kv_pressure: /metrics show a full KV cache and preemptions growing with every request;
    - hang_over: a prompt over N tokens is never answered (a stuck or very slow prefill);
    - kv_tier_churn: brisk-style /metrics of a KV disk tier that is full and holds almost none of the prompt
      tokens asked of it (a budget smaller than what users come back to)."""
    app = FastAPI()
    started = time.monotonic()
    lock = asyncio.Lock()
    state = {"served": 0, "active": 0, "preemptions": 0}

    def loading() -> bool:
        return time.monotonic() - started < cold_start_s

    def busy_503():
        return JSONResponse({"status": "loading", "phase": "weights", "progress": 0.5}, status_code=503,
                            headers={"Retry-After": "1"})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": WINDOW}]}

    @app.get("/ready")
    async def ready():
        return busy_503() if loading() else {"status": "ready"}

    if compute_bound or kv_pressure:
        @app.get("/metrics")
        async def metrics():
            usage = 0.95 if kv_pressure else 0.02
            text = (f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {usage}\n"
                    f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
                    f"# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total {state['preemptions']}\n")
            return Response(text, media_type="text/plain; version=0.0.4")

    if kv_tier_churn:
        @app.get("/metrics")
        async def tier_metrics():
            text = ("# TYPE brisk:kv_disk_budget_bytes gauge\nbrisk:kv_disk_budget_bytes 268435456\n"
                    "# TYPE brisk:kv_disk_bytes gauge\nbrisk:kv_disk_bytes 268393216\n"
                    "# TYPE brisk:kv_disk_hits counter\nbrisk:kv_disk_hits_total 64\n"
                    "# TYPE brisk:kv_disk_misses counter\nbrisk:kv_disk_misses_total 41000\n")
            return Response(text, media_type="text/plain; version=0.0.4")

    async def generate(prompt_tokens: int, max_tokens: int):
        """Yields (token text) with the simulated timing; serial servers hold a global lock."""
        if serial:
            await lock.acquire()
        try:
            state["active"] += 1
            if state["served"] == 0 and first_request_delay_s:
                await asyncio.sleep(first_request_delay_s)
            state["served"] += 1
            if kv_pressure:
                state["preemptions"] += 1
            if hang_over is not None and prompt_tokens > hang_over:
                await asyncio.sleep(600)
            await asyncio.sleep(0.01 + prompt_tokens * PREFILL_S_PER_TOKEN)
            for i in range(max_tokens):
                if i:  # shared compute: every running stream slows every token
                    await asyncio.sleep(0.008 * (1 + 1.0 * (state["active"] - 1)) if compute_bound else
                                        SERIAL_TOKEN_DELAY_S if serial else TOKEN_DELAY_S)
                yield "tok "
        finally:
            state["active"] -= 1
            if serial:
                lock.release()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if loading():
            return busy_503()
        body = await request.json()
        words = sum(len(str(m.get("content", "")).split()) + 4 for m in body["messages"])
        if truncate_to is not None:
            words = min(words, truncate_to)  # silently keep only the end of the prompt
        elif words >= WINDOW and not accept_overlong:
            return JSONResponse({"error": {"message": f"prompt of {words} tokens exceeds {WINDOW}",
                                           "type": "invalid_request_error", "param": "messages",
                                           "code": "context_length_exceeded"}}, status_code=400)
        max_tokens = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": words, "completion_tokens": max_tokens, "total_tokens": words + max_tokens}
        if not body.get("stream"):
            text = "".join([t async for t in generate(words, max_tokens)])
            return {"id": "x", "object": "chat.completion", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "length"}], "usage": usage}

        async def events():
            async for piece in generate(words, max_tokens):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        if buffered:  # what a buffering proxy does: everything arrives at once, at the end
            payload = "".join([e async for e in events()])
            return Response(payload, media_type="text/event-stream")
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    import uvicorn

    port, flags = int(sys.argv[1]), json.loads(sys.argv[2])
    uvicorn.run(create_app(**flags), host="127.0.0.1", port=port, log_level="warning")
