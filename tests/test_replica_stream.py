"""A replica's stream to the ingress (brisk.cluster.replica.EngineReplica.generate), run directly on
a real engine outside Ray: with --stream-interval N every message after the first token carries at
least N new tokens (except the last), nothing is lost or reordered, and the default sends one
message per engine step. (The two runs are not compared token for token: the second one reuses the
first one's cached prompt, and with quantized weights that can change a greedy token; RESULTS.md.)"""

import asyncio

import pytest

from brisk.cli import build_parser
from brisk.cluster.messages import Accepted
from brisk.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # Ray Serve replicas: `pytest -m 'not slow'` skips it locally

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def replica(brisk_cache):
    from brisk.cluster.replica import EngineReplica

    args = build_parser().parse_args(["serve", "smollm2-135m-instruct", "--replicas", "1"])
    made = EngineReplica(vars(args), max_model_len=2048, chat_template=None)
    yield made
    made.engine.shutdown()


def _messages(replica, interval, prompt, tokens):
    replica.stream_interval = interval

    async def collect():
        got = []
        async for item in replica.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                                           request_id=f"interval-{interval}"):
            got.append(item)
        return got

    return asyncio.run(collect())


def test_stream_interval_batches_tokens_without_losing_any(replica):
    prompt = replica.engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me about owls."}])
    one = _messages(replica, 1, prompt, 21)
    four = _messages(replica, 4, prompt, 21)
    for messages in (one, four):
        assert messages[0] == Accepted()
        outputs = [o for batch in messages[1:] for o in batch]
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        deltas = [t for o in outputs for t in o.delta_token_ids]
        assert deltas == outputs[-1].token_ids and len(deltas) == 21  # every token, in order
    sizes = [sum(len(o.delta_token_ids) for o in batch) for batch in four[1:]]
    assert sizes[0] == 1  # the first token goes at once (time to first token unchanged)
    assert all(size >= 4 for size in sizes[1:-1]) and len(four) < len(one)
    assert len(one) - 1 >= 15  # interval 1: about one message per step (a few steps may coalesce)


def test_with_a_channel_outputs_take_the_socket_and_the_ray_stream_only_accepts(replica):
    """brisk.cluster.channel: the outputs of a real engine arrive whole and in order over the
    ingress's listener, and the Ray stream carries only the accept (then ends, the last output sent)."""
    from brisk.cluster.channel import OutputListener

    prompt = replica.engine.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers."}])
    replica.stream_interval = 1

    async def run():
        received = []
        listener = OutputListener("127.0.0.1", lambda rid, item: received.append((rid, item)) or True,
                                  lambda rids, message: None)
        address = await listener.address()
        ray_items = [item async for item in replica.generate(
            prompt, SamplingParams(max_tokens=17, temperature=0, ignore_eos=True), request_id="via-channel",
            channel=address)]
        for _ in range(100):  # the last frame is on the socket when the Ray stream ends; let it be read
            if received and received[-1][1][-1].finished:
                break
            await asyncio.sleep(0.05)
        listener.close()
        return ray_items, received

    ray_items, received = asyncio.run(run())
    assert ray_items == [Accepted()]
    assert {rid for rid, _ in received} == {"via-channel"}
    outputs = [o for _, batch in received for o in batch]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    deltas = [t for o in outputs for t in o.delta_token_ids]
    assert deltas == outputs[-1].token_ids and len(deltas) == 17
