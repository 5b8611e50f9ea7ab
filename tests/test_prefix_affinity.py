"""The prefix-affinity policy of the Ray Serve router (brisk.cluster.affinity), without a cluster."""

import random
from pathlib import Path

import pytest

from brisk.cluster.affinity import Decision, PrefixAffinity
from brisk.engine.kv_cache.hashing import hash_full_blocks

BLOCK = 16


def hashes(tokens):
    return hash_full_blocks(tokens, BLOCK)


SYSTEM = list(range(1000, 1000 + 8 * BLOCK))  # an 8-block shared prefix


def test_shared_prefix_sticks_to_the_replica_that_served_it():
    policy = PrefixAffinity(rng=random.Random(0))
    other = hashes([5] * 3 * BLOCK)  # other traffic: the system prompt is not what every request shares
    policy.record(other, policy.choose(other, {"a": 0, "b": 0}).replica)
    first = policy.choose(hashes(SYSTEM + [1, 2, 3]), {"a": 0, "b": 0})
    assert first.reason == "load"
    policy.record(hashes(SYSTEM + [1, 2, 3]), first.replica)
    for question in range(20):
        ids = SYSTEM + [7, question] * 9  # the same system prompt, another question (one more full block)
        decision = policy.choose(hashes(ids), {"a": 0, "b": 0})
        assert decision == Decision(first.replica, "prefix", 8)
        policy.record(hashes(ids), decision.replica)
        if question % 4 == 0:  # the other traffic goes on
            policy.record(other, policy.choose(other, {"a": 0, "b": 0}).replica)


def test_a_system_prompt_every_request_carries_is_not_affinity():
    """Issue 37: every chat carried the model's default system prompt, and affinity sent all 7
    requests (4 at once) to one of two replicas. 8 concurrent chats with that prompt and their own
    questions spread 4/4; a conversation's next turn (its own blocks past the shared prompt) still
    goes back to its replica."""
    policy = PrefixAffinity(rng=random.Random(5))
    load, placed, chats = {"a": 0, "b": 0}, [], []
    for k in range(8):
        ids = SYSTEM + [9000 + k] * 2 * BLOCK
        decision = policy.choose(hashes(ids), load)
        assert decision.reason == "load", k
        policy.record(hashes(ids), decision.replica)
        load[decision.replica] += 1  # all 8 running at once
        placed.append(decision.replica)
        chats.append(ids)
    assert sorted(placed) == ["a"] * 4 + ["b"] * 4
    turn_two = chats[5] + [7] * BLOCK
    assert policy.choose(hashes(turn_two), load) == Decision(placed[5], "prefix", 10)
    assert policy.shared_depth(hashes(turn_two)) == 8


def test_longest_recorded_prefix_wins():
    policy = PrefixAffinity()
    short, long_ = SYSTEM[:2 * BLOCK], SYSTEM
    policy.record(hashes(short), "a")
    policy.record(hashes(long_), "b")  # b also took over the two shared leading blocks
    policy.record(hashes(short + [5] * BLOCK), "a")  # a holds a different continuation of 2 blocks
    assert policy.lookup(hashes(long_ + [9] * BLOCK), ["a", "b"]) == ("b", 8)
    assert policy.lookup(hashes(short + [5] * BLOCK), ["a", "b"]) == ("a", 3)
    # b is not a candidate (dead, scaled away): a's 2 leading blocks (re-recorded by its last request) remain
    assert policy.lookup(hashes(long_), ["a"]) == ("a", 2)
    assert policy.lookup(hashes([9] * BLOCK + long_), ["a", "b"]) == (None, 0)


def test_overloaded_affine_replica_yields_to_load():
    policy = PrefixAffinity(max_imbalance=2)
    policy.record(hashes(SYSTEM), "a")
    assert policy.choose(hashes(SYSTEM), {"a": 2, "b": 0}).reason == "prefix"  # 2 more: within the threshold
    decision = policy.choose(hashes(SYSTEM), {"a": 3, "b": 0})
    assert (decision.replica, decision.reason) == ("b", "load")


def test_new_prefixes_spread_over_equally_loaded_replicas():
    policy = PrefixAffinity(rng=random.Random(1))
    placed = []
    for i in range(10):
        ids = [50_000 + i] + SYSTEM
        decision = policy.choose(hashes(ids), {"a": 0, "b": 0})
        assert decision.reason == "load"
        policy.record(hashes(ids), decision.replica)
        placed.append(decision.replica)
    assert placed.count("a") == placed.count("b") == 5  # ties go to the replica holding fewer blocks
    assert policy.owned == {"a": 40, "b": 40}


def test_load_choice_prefers_the_shorter_queue():
    policy = PrefixAffinity(rng=random.Random(2))
    for _ in range(20):
        assert policy.choose(hashes(SYSTEM), {"a": 5, "b": 1}).replica == "b"


def test_state_is_bounded_and_forgets_dead_replicas():
    policy = PrefixAffinity(max_entries=10)
    policy.record(hashes(SYSTEM), "a")
    policy.record(hashes([3] * 4 * BLOCK), "b")
    assert len(policy) == 10 and sum(policy.owned.values()) == 10  # 12 recorded, the 2 oldest evicted
    assert policy.lookup(hashes(SYSTEM[:BLOCK]), ["a", "b"]) == (None, 0)  # its first block went first
    policy.forget("b")
    assert len(policy) == 6 and policy.owned == {"a": 6}
    assert policy.lookup(hashes([3] * 4 * BLOCK), ["a", "b"]) == (None, 0)


def test_bad_settings_and_no_replicas():
    with pytest.raises(ValueError, match="max_entries"):
        PrefixAffinity(max_entries=0)
    with pytest.raises(ValueError, match="max_imbalance"):
        PrefixAffinity(max_imbalance=-1)
    with pytest.raises(ValueError, match="no replica"):
        PrefixAffinity().choose(hashes(SYSTEM), {})


def test_the_ray_serve_config_file_builds_brisks_application():
    """deploy/ray/serve.yaml's application, built as `serve run` builds it (no cluster needed)."""
    pytest.importorskip("ray.serve")
    import yaml

    from brisk.cluster.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, app_builder
    from brisk.models.registry import resolve

    config = yaml.safe_load((Path(__file__).resolve().parent.parent / "deploy/ray/serve.yaml").read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "brisk.cluster.app:app_builder"
    flags = application["args"]["flags"].split()
    flags[0] = str(resolve("smollm2-135m-instruct").path)  # the demo model in place of /models/...
    app = app_builder({"flags": " ".join(flags)})
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert (ingress.name, engine.name) == (INGRESS_DEPLOYMENT, ENGINE_DEPLOYMENT)
    scaling = engine._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 8, 16)
    assert engine.ray_actor_options["num_cpus"] == 4
    assert engine._deployment_config.request_router_config.request_router_class == \
        "brisk.cluster.router.PrefixAffinityRouter"
    # the replicas get the flags as values: the model, the scheduler's limits
    serve_args, max_model_len, _ = engine.init_args
    assert serve_args["max_num_seqs"] == 64 and max_model_len == 8192
    # a wrong flag in the file is the CLI's one-line error
    from brisk.errors import BriskError

    with pytest.raises(BriskError, match="--min-replicas 3 is greater than --max-replicas 2"):
        app_builder({"flags": f"{flags[0]} --min-replicas 3 --max-replicas 2"})


def test_new_prefixes_go_to_the_replica_holding_fewer_blocks_unless_it_is_overloaded():
    policy = PrefixAffinity(max_imbalance=2, rng=random.Random(3))
    policy.record(hashes(SYSTEM), "a")  # a holds 8 blocks, b none
    fresh = hashes([77] * 4 * BLOCK)
    assert policy.choose(fresh, {"a": 0, "b": 2}) == Decision("b", "load")
    assert policy.choose(fresh, {"a": 0, "b": 3}).replica == "a"  # b is 3 past the least loaded: not a fit


def test_a_shared_chat_template_header_is_not_affinity():
    """Every chat prompt starts with the same template block: following that match would send every
    new system prompt to one replica (measured: all 8 on one pool, which then thrashed its LRU)."""
    policy = PrefixAffinity(rng=random.Random(4))
    header = [1, 2, 3, 4] * (BLOCK // 4)
    placed = []
    for k in range(8):
        ids = header + [5000 + k] * 40 * BLOCK  # one shared block, then 40 of the prompt's own
        decision = policy.choose(hashes(ids), {"a": 0, "b": 0})
        assert decision.reason == "load"
        policy.record(hashes(ids), decision.replica)
        placed.append(decision.replica)
    assert sorted(placed) == ["a"] * 4 + ["b"] * 4
    again = policy.choose(hashes(header + [5003] * 40 * BLOCK + [9] * BLOCK), {"a": 0, "b": 0})
    assert (again.replica, again.reason) == (placed[3], "prefix")
