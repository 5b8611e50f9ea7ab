"""The async engine: streaming outputs, abort on consumer exit, errors to the caller."""

import asyncio
import os
import threading

import pytest

from brisk.engine.async_engine import AsyncLLMEngine
from brisk.engine.engine import RequestError
from brisk.engine.sampling_params import SamplingParams

from engines import make_engine


@pytest.fixture
def async_engine(demo):
    engine = AsyncLLMEngine(make_engine(demo))
    yield engine
    engine.shutdown()


def test_streams_incremental_outputs(demo, async_engine):
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Name three fruits."}])

    async def consume():
        return [out async for out in async_engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0))]

    outs = asyncio.run(consume())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert [t for o in outs for t in o.delta_token_ids] == outs[-1].token_ids


def test_consumer_leaving_aborts_and_frees_blocks(demo, async_engine):
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Write a long essay about rivers."}])

    async def leave_early():
        agen = async_engine.generate(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async for out in agen:
            if len(out.token_ids) >= 3:
                break
        await agen.aclose()
        for _ in range(200):  # the abort is applied before the engine's next step
            if not async_engine.engine.has_unfinished_requests():
                return
            await asyncio.sleep(0.01)

    asyncio.run(leave_early())
    stats = async_engine.engine.stats()
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_validation_error_reaches_the_caller(async_engine):
    async def too_long():
        async for _ in async_engine.generate([1] * 1020, SamplingParams(max_tokens=10)):
            pass

    with pytest.raises(RequestError, match="exceeds max_model_len"):
        asyncio.run(too_long())


def test_event_loop_stays_responsive_while_generating(demo, async_engine):
    prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story."}])

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.create_task(ticker())
        async for _ in async_engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)):
            pass
        task.cancel()
        return ticks

    assert asyncio.run(main()) > 5


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread niceness is Linux-only")
def test_engine_thread_yields_cpu_to_the_event_loop(demo):
    """The engine thread (and the OpenMP team it starts) runs niced, the caller's thread does not."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    engine = AsyncLLMEngine(make_engine(demo), engine_niceness=3)
    try:
        prompt = demo.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])

        async def one():
            return [o async for o in engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0))]

        assert asyncio.run(one())[-1].finished  # the thread has started and stepped
        assert os.getpriority(os.PRIO_PROCESS, engine._thread.native_id) == min(base + 3, 19)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    finally:
        engine.shutdown()


def test_bad_niceness_setting_is_one_clear_error(monkeypatch):
    from brisk.engine.async_engine import engine_niceness_from_env
    from brisk.errors import BriskError

    monkeypatch.setenv("BRISK_ENGINE_NICENESS", "high")
    with pytest.raises(BriskError, match="BRISK_ENGINE_NICENESS='high': expected an integer from 0 to 19"):
        engine_niceness_from_env()
    monkeypatch.setenv("BRISK_ENGINE_NICENESS", "0")
    assert engine_niceness_from_env() == 0
