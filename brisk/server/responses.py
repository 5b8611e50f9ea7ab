"""OpenAI response bodies and stream chunks for chat and text completions."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from brisk.engine.outputs import RequestOutput
from brisk.server.context_guard import GuardResult
from brisk.server.reasoning import HARMONY, ReasoningSplitter
from brisk.structured.harmony import HarmonyParser
from brisk.structured.tools import ToolCallParser, ToolDelta, ToolPlan, merged

_TIMING_KEYS = ("queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "e2e_ms")


def usage_block(finals: dict[int, RequestOutput], guards: list[GuardResult], jobs) -> dict[str, Any]:
    """OpenAI usage (prompt counted once per prompt, however many choices), cached prompt
    tokens, and brisk's per-request phase timings (of the first choice)."""
    prompt_tokens = sum(g.prompt_tokens for g in guards)
    completion_tokens = sum(len(o.token_ids) for o in finals.values())
    first_choice_of_prompt = {}
    for job in jobs:
        first_choice_of_prompt.setdefault(job.prompt_index, job.index)
    firsts = [finals[i] for i in first_choice_of_prompt.values() if i in finals]
    cached = sum(o.num_cached_prompt_tokens for o in firsts)
    disk = sum(o.num_disk_prompt_tokens for o in firsts)
    host = sum(o.num_host_prompt_tokens for o in firsts)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": cached}}
    first = finals.get(0)
    if first is not None:
        # the cached prompt by where it was found: the KV pool ("memory"), the host tier (--kv-cache-host-bytes:
        # blocks the pool evicted) or the disk tier (--kv-cache-dir)
        usage["brisk"] = {**{k: first.metrics.get(k) for k in _TIMING_KEYS}, "cached_prompt_tokens": cached,
                          "cached_prompt_tokens_by_tier": {"memory": cached - disk - host, "host": host, "disk": disk},
                          "num_preemptions": first.metrics.get("num_preemptions", 0)}
        if "spec_drafted_tokens" in first.metrics:  # the request ran with speculative decoding
            usage["brisk"]["spec_drafted_tokens"] = first.metrics["spec_drafted_tokens"]
            usage["brisk"]["spec_accepted_tokens"] = first.metrics["spec_accepted_tokens"]
    return usage


def _delta_logprobs(out: RequestOutput) -> list[dict[str, Any]]:
    return out.delta_logprobs or []


class Formatter:
    object_full = ""
    object_chunk = ""
    done_marker = True  # a stream ends with `data: [DONE]` (chat, completions; not the Responses API)

    def __init__(self, response_id: str, state, want_logprobs: bool):
        self.id = response_id
        self.created = int(time.time())
        self.model = state.config.served_model_name
        self.tokenizer = state.tokenizer
        self.want_logprobs = want_logprobs

    def _envelope(self, obj: str, choices: list, **extra) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [], usage=usage)

    def last_chunks(self, body, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """What a stream sends after every choice finished: the usage chunk, when asked for."""
        include = body.stream_options is not None and body.stream_options.include_usage
        return [self.usage_chunk(usage)] if include else []

    @staticmethod
    def encode(chunk: dict[str, Any]) -> str:
        """One server-sent event."""
        return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def error_events(self, error) -> list[str]:
        """A stream under way that fails ends with the error (an OpenAI error object)."""
        return [error.sse()]

    def observe(self, index: int, out: RequestOutput) -> None:
        """Every output of a choice, in order, when the reply is collected rather than streamed."""

    def first_chunks(self, jobs, guards: list[GuardResult]) -> list[dict[str, Any]]:
        return []

    def chunks(self, index: int, out: RequestOutput, body) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _stream_chunk(self, index: int, out: RequestOutput, body, has_text: bool,
                      fields: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
        """One choice's chunk; none when there is nothing to send (no text, logprobs or finish)."""
        if not has_text and not out.finished and not (self.want_logprobs and out.delta_token_ids):
            return []
        choice = {"index": index, **fields(), "finish_reason": out.finish_reason if out.finished else None}
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        return [self._envelope(self.object_chunk, [choice], **self._usage_field(body))]

    def full_response(self, finals, jobs, guards, usage) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _usage_field(body) -> dict[str, Any]:
        include = body.stream_options is not None and body.stream_options.include_usage
        return {"usage": None} if include else {}


class _ChoiceReply:
    """One choice's reply as it arrives: thinking apart (a reasoning parser), then content and tool
    calls (a tool plan). Streamed and whole replies are read the same way, so they agree."""

    def __init__(self, tools: ToolPlan | None, reasoning_parser: str | None):
        # gpt-oss: its harmony channels carry reasoning, content and calls alike (brisk.structured.harmony)
        self.harmony = HarmonyParser() if reasoning_parser == HARMONY else None
        self.thinking = ReasoningSplitter(reasoning_parser) if reasoning_parser and not self.harmony else None
        self.tools = ToolCallParser(tools) if tools is not None and not self.harmony else None
        self.content = ""

    @property
    def reasoning(self) -> str:
        if self.harmony:
            return self.harmony.reasoning
        return self.thinking.reasoning if self.thinking else ""

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolDelta]]:
        """(reasoning, content, call deltas) of this much more text (and of the end, when finished)."""
        if self.harmony:
            step = self.harmony.feed(text)
            if finished:
                end = self.harmony.finish()
                step.reasoning, step.content = step.reasoning + end.reasoning, step.content + end.content
                step.tool_calls += end.tool_calls
            self.content += step.content
            return step.reasoning, step.content, step.tool_calls
        reasoning, answer = self.thinking.feed(text) if self.thinking else ("", text)
        if finished and self.thinking:
            more_reasoning, more_answer = self.thinking.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        content, deltas = self.tools.feed(answer) if self.tools else (answer, [])
        if finished and self.tools:
            more_content, more_deltas = self.tools.finish()
            content, deltas = content + more_content, deltas + more_deltas
        self.content += content
        return reasoning, content, deltas

    @property
    def calls(self) -> list[dict[str, Any]]:
        parser = self.harmony or self.tools
        return [c.as_openai() for c in parser.calls] if parser else []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a reply that ended by itself with calls; one cut inside a call
        stays "length"."""
        if self.calls and engine_reason == "stop" and not (self.harmony or self.tools).cut:
            return "tool_calls"
        return engine_reason


class ChatFormatter(Formatter):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, response_id: str, state, want_logprobs: bool, tools: ToolPlan | None = None,
                 reasoning_parser: str | None = None):
        super().__init__(response_id, state, want_logprobs)
        self.tools = tools  # parse replies for tool calls (None: plain content)
        self.reasoning_parser = reasoning_parser
        self._replies: dict[int, _ChoiceReply] = {}

    def _reply(self, index: int) -> _ChoiceReply:
        if index not in self._replies:
            self._replies[index] = _ChoiceReply(self.tools, self.reasoning_parser)
        return self._replies[index]

    def _logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        content = []
        for e in entries:
            token, raw = self._token_text(e["token_id"])
            top = []
            for tid, lp in e["top"]:
                t, b = self._token_text(tid)
                top.append({"token": t, "logprob": lp, "bytes": b})
            content.append({"token": token, "logprob": e["logprob"], "bytes": raw, "top_logprobs": top})
        return {"content": content, "refusal": None}

    def first_chunks(self, jobs, guards):
        chunks = []
        for job in jobs:
            choice = {"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            chunks.append(self._envelope(self.object_chunk, [choice], brisk=guards[job.prompt_index].report()))
        return chunks

    def observe(self, index, out):
        self._reply(index).feed(out.delta_text, out.finished)

    def chunks(self, index, out, body):
        reply = self._reply(index)
        reasoning, content, calls = reply.feed(out.delta_text, out.finished)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.as_openai() for c in merged(calls)]
        chunks = self._stream_chunk(index, out, body, bool(delta), lambda: {
            "delta": delta, "logprobs": self._logprobs(_delta_logprobs(out))})
        if out.finished and chunks:
            chunks[-1]["choices"][0]["finish_reason"] = reply.finish_reason(out.finish_reason)
        return chunks

    def full_response(self, finals, jobs, guards, usage):
        choices = []
        for job in jobs:
            index = job.index
            out, reply = finals[index], self._reply(index)
            message: dict[str, Any] = {"role": "assistant", "content": reply.content or None, "refusal": None}
            if self.reasoning_parser:
                message["reasoning_content"] = reply.reasoning or None
            if reply.calls:
                message["tool_calls"] = reply.calls
            elif not message["content"] and not self.reasoning_parser:
                message["content"] = reply.content  # an empty reply is "", not null
            choices.append({"index": index, "message": message, "logprobs": self._logprobs(out.logprobs or []),
                            "finish_reason": reply.finish_reason(out.finish_reason), "stop_reason": out.stop_reason})
        return self._envelope(self.object_full, choices, usage=usage, system_fingerprint=None,
                              brisk=guards[0].report())


class CompletionFormatter(Formatter):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, response_id: str, state, want_logprobs: bool, echo: bool):
        super().__init__(response_id, state, want_logprobs)
        self.echo = echo
        self._echo_chars: dict[int, int] = {}  # choice -> characters of its echoed prompt

    def _logprobs(self, entries: list[dict[str, Any]], offset: int) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for e in entries:
            token, _ = self._token_text(e["token_id"])
            tokens.append(token)
            token_logprobs.append(e["logprob"])
            tops.append({self._token_text(tid)[0]: lp for tid, lp in e["top"]})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _echo_text(self, out: RequestOutput) -> str:
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) if self.echo else ""

    def first_chunks(self, jobs, guards):
        """One empty chunk per choice carrying its prompt's context-guard report (as chat's first
        chunk does), so a clamped prompt of a multi-prompt stream is reported, not silent."""
        return [self._envelope(self.object_chunk, [{"index": job.index, "text": "", "logprobs": None,
                                                    "finish_reason": None}], brisk=guards[job.prompt_index].report())
                for job in jobs]

    def chunks(self, index, out, body):
        first = out.num_output_tokens == len(out.delta_token_ids)
        echo = self._echo_text(out) if first else ""
        if first:
            self._echo_chars[index] = len(echo)
        text = echo + out.delta_text
        offset = self._echo_chars.get(index, 0) + out.text_offset  # as the whole reply counts it
        return self._stream_chunk(index, out, body, bool(text), lambda: {
            "text": text, "logprobs": self._logprobs(_delta_logprobs(out), offset)})

    def full_response(self, finals, jobs, guards, usage):
        choices = []
        for job in jobs:
            index = job.index
            out = finals[index]
            echo = self._echo_text(out)
            choices.append({"index": index, "text": echo + out.text,
                            "logprobs": self._logprobs(out.logprobs or [], len(echo)),
                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        return self._envelope(self.object_full, choices, usage=usage, system_fingerprint=None,
                              brisk=[g.report() for g in guards] if len(guards) > 1 else guards[0].report())
