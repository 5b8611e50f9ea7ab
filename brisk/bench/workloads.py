"""Workloads for `brisk bench`: length distributions, prompts of a given token length, and
request sets (synthetic, shared-prefix, ShareGPT, replay of a timed trace).

Prompt lengths are exact when the server offers POST /tokenize (brisk, vLLM); otherwise a
prompt of n common words stands in for n tokens, and the server's `usage` reports the truth.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from brisk.bench.client import BenchRequest
from brisk.errors import BriskError

WORDS = ("the of and to in is was for on are with as his they be at one have this from or had by hot word "
         "but what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two has "
         "look more day could go come did number sound no most people my over know water than call first who "
         "may down side been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under name very through just form sentence great "
         "think say help low line differ turn cause much mean before move right boy old too same tell does set "
         "three want air well also play small end put home read hand port large spell add even land here must "
         "big high such follow act why ask men change went light kind off need house picture try us again "
         "animal point mother world near build self earth father head stand own page should country found "
         "answer school grow study still learn plant cover food sun four between state keep eye never last let "
         "thought city tree cross farm hard start might story saw far sea draw left late run while press close "
         "night real life few north open seem together next white children begin got walk example ease paper "
         "group always music those both mark often letter until mile river car feet care second book carry took "
         "science eat room friend began idea fish mountain stop once base hear horse cut sure watch color face "
         "wood main enough plain girl usual young ready above ever red list though feel talk bird soon body dog "
         "family direct pose leave song measure door product black short numeral class wind question happen "
         "complete ship area half rock order fire south problem piece told knew pass since top whole king space "
         "heard best hour better true during hundred five remember step early hold west ground interest reach "
         "fast verb sing listen six table travel less morning ten simple several vowel toward war lay against "
         "pattern slow center love person money serve appear road map rain rule govern pull cold notice voice "
         "unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field "
         "rest correct able pound done beauty drive stood contain front teach week final gave green oh quick "
         "develop ocean warm free minute strong special mind behind clear tail produce fact street inch multiply "
         "nothing course stay wheel full force blue object decide surface deep moon island foot system busy test "
         "record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate "
         "miss brought heat snow tire bring yes distant fill east paint language among").split()


# -- length distributions ---------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | normal | lognormal
    mean: float
    spread: float = 0.0  # normal: std; lognormal: sigma; uniform: unused
    low: int = 1
    high: int = 1 << 20

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.mean)] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]
        out: list[int] = []
        for _ in range(64):  # truncation by rejection, bounded; clip whatever is left
            if len(out) >= n:
                break
            if self.kind == "normal":
                draw = rng.normal(self.mean, self.spread, size=2 * n)
            else:  # lognormal parameterised by its mean and sigma
                mu = math.log(self.mean) - self.spread ** 2 / 2
                draw = rng.lognormal(mu, self.spread, size=2 * n)
            out += [int(round(x)) for x in draw if self.low <= x <= self.high]
        while len(out) < n:
            out.append(int(min(max(self.mean, self.low), self.high)))
        return out[:n]


def parse_length_dist(spec: str, what: str) -> LengthDist:
    """`256`, `fixed:256`, `uniform:64-512`, `normal:mean=256,std=64[,min=..,max=..]`,
    `lognormal:mean=512,sigma=0.8[,min=16,max=2048]`."""
    text = spec.strip()
    if re.fullmatch(r"\d+", text):
        text = f"fixed:{text}"
    kind, _, rest = text.partition(":")
    try:
        if kind == "fixed":
            value = int(rest)
            if value < 1:
                raise ValueError
            return LengthDist("fixed", value, low=value, high=value)
        if kind == "uniform":
            low, high = (int(x) for x in rest.split("-"))
            if not 1 <= low <= high:
                raise ValueError
            return LengthDist("uniform", (low + high) / 2, low=low, high=high)
        if kind in ("normal", "lognormal"):
            params = dict(item.split("=") for item in rest.split(","))
            spread_key = "std" if kind == "normal" else "sigma"
            dist = LengthDist(kind, float(params["mean"]), float(params[spread_key]), int(params.get("min", 1)),
                              int(params.get("max", 1 << 20)))
            if dist.mean <= 0 or dist.spread <= 0 or not 1 <= dist.low <= dist.high:
                raise ValueError
            return dist
    except (ValueError, KeyError):
        pass
    raise BriskError(f"{what} {spec!r} is not a length distribution; use N, fixed:N, uniform:A-B, "
                     "normal:mean=M,std=S[,min=A,max=B] or lognormal:mean=M,sigma=S[,min=A,max=B]")


# -- prompts of an exact token length ---------------------------------------------------------------
Counter = Callable[[str], int]


class PromptMaker:
    """Texts of n tokens: word soup, trimmed with the server's tokenizer when it has one."""

    def __init__(self, rng: np.random.Generator, count_tokens: Counter | None = None):
        self.rng = rng
        self.count = count_tokens

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS, size=max(n, 1)))

    def make(self, n: int, prefix: str = "") -> str:
        text = prefix + self.words(n)
        if self.count is None:
            return text
        words = text.split(" ")
        for _ in range(6):  # each pass removes or adds the difference, in words
            # a prefix's trailing space joins the next word's token: count the prefix without it
            diff = self.count(" ".join(words)) - (n + (self.count(prefix.rstrip(" ")) if prefix else 0))
            if diff == 0:
                break
            if diff > 0:
                words = words[:max(len(words) - diff, 1)]
            else:
                words += list(self.rng.choice(WORDS, size=-diff))
        return " ".join(words)


# -- request sets ---------------------------------------------------------------------------------
def synthetic(maker: PromptMaker, rng, n: int, inputs: LengthDist, outputs: LengthDist, extra: dict) -> list[BenchRequest]:
    ins, outs = inputs.sample(rng, n), outputs.sample(rng, n)
    return [BenchRequest(prompt=maker.make(i), max_tokens=o, extra=dict(extra)) for i, o in zip(ins, outs)]


def shared_prefix(maker: PromptMaker, rng, n: int, num_prefixes: int, prefix_len: int, suffixes: LengthDist,
                  outputs: LengthDist, extra: dict, prefix_maker: PromptMaker | None = None) -> list[BenchRequest]:
    """Requests whose prompts start with one of `num_prefixes` shared prefixes (made by
    `prefix_maker`, so several runs can share them) and end with a fresh suffix."""
    if num_prefixes < 1 or prefix_len < 1:
        raise BriskError("shared-prefix needs --num-prefixes >= 1 and --prefix-len >= 1")
    prefixes = [(prefix_maker or maker).make(prefix_len) + " " for _ in range(num_prefixes)]
    sfx, outs = suffixes.sample(rng, n), outputs.sample(rng, n)
    return [BenchRequest(prompt=maker.make(s, prefix=prefixes[i % num_prefixes]), max_tokens=o, extra=dict(extra))
            for i, (s, o) in enumerate(zip(sfx, outs))]


def sharegpt(path: Path, rng, n: int, count_tokens: Counter | None, max_output: int, extra: dict,
             skip: int = 0) -> list[BenchRequest]:
    """`n` conversations in a shuffled order (`rng`), starting `skip` into it, so consecutive runs
    take different conversations until the dataset runs out (then it wraps around)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise BriskError(f"--dataset {path}: cannot read a ShareGPT JSON file ({e})") from None
    pairs = []
    for item in data if isinstance(data, list) else []:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) >= 2 and isinstance(turns[0], dict) and isinstance(turns[1], dict):
            human, reply = turns[0].get("value"), turns[1].get("value")
            if isinstance(human, str) and isinstance(reply, str) and human and reply:
                pairs.append((human, reply))
    if not pairs:
        raise BriskError(f"--dataset {path}: no conversations with a human turn and a reply (ShareGPT format)")
    order = rng.permutation(len(pairs))
    out = []
    for i in range(n):
        human, reply = pairs[order[(skip + i) % len(pairs)]]
        reply_tokens = count_tokens(reply) if count_tokens else len(reply.split())
        out.append(BenchRequest(messages=[{"role": "user", "content": human}],
                                max_tokens=max(1, min(reply_tokens, max_output)), extra=dict(extra)))
    return out


class GroupTexts:
    """The text of each prefix group of a trace: words drawn from a generator seeded by the group's name, so that
    every request of the group, in this replay and in any other of the same trace (after a restart, on another
    server), starts with the same words, and a longer prefix of the group (a chat's history, grown by a turn)
    continues the same text."""

    CHUNK = 256  # words drawn at a time, each chunk from its own seed: the text does not depend on how far it grew

    def __init__(self, count_tokens: Counter | None = None):
        self.count = count_tokens
        self._words: dict[str, list[str]] = {}
        self._texts: dict[tuple[str, int], str] = {}

    def _stream(self, group: str, n: int) -> list[str]:
        words = self._words.setdefault(group, [])
        seed = int.from_bytes(hashlib.sha256(group.encode()).digest()[:8], "little")
        while len(words) < n:
            words += list(np.random.default_rng([seed, len(words) // self.CHUNK]).choice(WORDS, size=self.CHUNK))
        return words[:n]

    def prefix(self, group: str, n: int) -> str:
        """The group's first n tokens as text (n words without a token counter)."""
        key = (group, n)
        if key not in self._texts:
            k = max(n, 1)
            if self.count is not None:
                for _ in range(8):  # each pass moves by the difference, in words of ~one token
                    diff = self.count(" ".join(self._stream(group, k))) - n
                    if diff == 0 or k - diff < 1:
                        break
                    k -= diff
            self._texts[key] = " ".join(self._stream(group, k))
        return self._texts[key]


def replay(path: Path, maker: PromptMaker, limit: int | None, extra: dict) -> tuple[list[BenchRequest], list[float],
                                                                                     str]:
    """A trace (brisk/trace.py: `brisk serve --request-log`, or JSONL with arrival_s, prompt_tokens,
    output_tokens). A request with a `prefix_group` and `prefix_tokens` starts with that group's text
    (`GroupTexts`: the same in every request of the group and in every replay), then fresh words up to its
    length. Returns requests, arrival offsets in seconds, and a note on requests that ended early in the
    recording."""
    from brisk.trace import read_trace

    trace = read_trace(path)
    groups = GroupTexts(maker.count)
    requests, arrivals = [], []
    for r in trace.requests[:limit]:
        arrivals.append(r.arrival_s)
        shared = min(r.prefix_tokens, r.prompt_tokens) if r.prefix_group is not None else 0
        if shared <= 0:
            prompt = maker.make(r.prompt_tokens)
        elif shared == r.prompt_tokens:
            prompt = groups.prefix(r.prefix_group, shared)
        else:
            prompt = maker.make(r.prompt_tokens - shared, prefix=groups.prefix(r.prefix_group, shared) + " ")
        requests.append(BenchRequest(prompt=prompt, max_tokens=r.output_tokens, extra=dict(extra)))
    return requests, arrivals, trace.describe()


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival times for `rate` requests/s: Poisson (burstiness 1) or gamma-distributed gaps
    (burstiness < 1 burstier, > 1 more regular), as vLLM's benchmark does."""
    if rate <= 0 or burstiness <= 0:
        raise BriskError(f"--request-rate and --burstiness must be > 0 (got {rate}, {burstiness})")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return list(np.cumsum(gaps) - gaps[0])
