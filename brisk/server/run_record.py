"""What is recorded about a run, in one observer: the metrics as outputs arrive and are written,
and once the run is over the abort count, the OpenTelemetry span, the request-log lines and the
access-log line's fields."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request

from brisk.engine.outputs import RequestOutput
from brisk.server.state import ServerState


class RunRecord:
    def __init__(self, state: ServerState, raw: Request, body, prepared, jobs):
        self.state, self.raw, self.body, self.jobs = state, raw, body, jobs
        self.id, self.guards = prepared.fmt.id, prepared.guards
        self.arrival_unix = time.time()  # for the trace of a request the engine never finished

    # -- as outputs arrive ------------------------------------------------------------
    def delivered(self, out: RequestOutput) -> None:
        """An output reached the event loop."""
        if out.produced_at:
            self.state.metrics.delivered.observe(time.monotonic() - out.produced_at)
        self.state.metrics.generation_tokens.inc(len(out.delta_token_ids))

    def written(self, out: RequestOutput) -> None:
        """An output's chunks went to the socket."""
        if out.produced_at:
            self.state.metrics.written.observe(time.monotonic() - out.produced_at)

    def finished(self, out: RequestOutput) -> None:
        self.state.metrics.observe_finished(out.finish_reason, out.metrics)

    def failed(self, out: RequestOutput) -> None:
        """An engine request ended by a failure of its own (its reason: internal_error, grammar_rejected, grammar_unsatisfiable)."""
        self.state.metrics.request_errors.labels(out.error[0]).inc()

    # -- once the run is over -----------------------------------------------------------
    def closed(self, finals: dict[int, RequestOutput], generated: dict[int, int], unfinished: int, started: bool,
               abort_cause: str, usage: dict[str, Any]) -> None:
        if unfinished and started:
            self.state.metrics.aborts.labels(abort_cause).inc(unfinished)
        if self.state.tracer is not None and finals:
            self._trace(finals, unfinished, abort_cause, usage)
        if self.state.request_log is not None:
            self._log_requests(finals, generated, abort_cause)
        if self.state.config.log_requests:  # for the access-log line the middleware writes at the end
            first = finals.get(0)
            self.raw.state.brisk_access = {
                "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": max(usage["completion_tokens"], sum(generated.values())),
                "ttft_ms": first.metrics.get("ttft_ms") if first is not None else None,
                "finish": ",".join(sorted({o.finish_reason for o in finals.values() if o.finish_reason}))
                or abort_cause,
                "prompt": _prompt_text(self.body) if self.state.config.log_prompts else None}

    def _log_requests(self, finals: dict[int, RequestOutput], generated: dict[int, int], abort_cause: str) -> None:
        """One trace line per engine request (brisk/trace.py: bench replays it, kv-plan plans from it)."""
        from brisk.trace import TraceRequest, trace_row

        offset = time.time() - time.monotonic()
        for job in self.jobs:
            out = finals.get(job.index)
            m = out.metrics if out is not None else {}
            stamps = m.get("timestamps") or {}
            arrival = stamps["arrival"] + offset if stamps.get("arrival") else self.arrival_unix
            output_tokens = len(out.token_ids) if out is not None else generated.get(job.index, 0)
            request = TraceRequest(arrival, len(job.prompt_ids), output_tokens, job.params.max_tokens,
                                   finish_reason=out.finish_reason if out is not None else abort_cause)
            self.state.request_log.write(trace_row(
                request, request_id=f"{self.id}-{job.index}", route=self.raw.url.path,
                cached_prompt_tokens=out.num_cached_prompt_tokens if out is not None else None,
                context_outcome=self.guards[job.prompt_index].outcome,
                **{k: m.get(k) for k in ("queue_ms", "prefill_ms", "ttft_ms", "decode_ms", "e2e_ms")}))

    def _trace(self, finals: dict[int, RequestOutput], unfinished: int, abort_cause: str,
               usage: dict[str, Any]) -> None:
        choices = []
        for job in self.jobs:
            out = finals.get(job.index)
            if out is not None:
                choices.append({"metrics": out.metrics, "prompt_tokens": len(job.prompt_ids),
                                "output_tokens": len(out.token_ids), "cached_tokens": out.num_cached_prompt_tokens,
                                "attributes": {"brisk.choice_index": job.index,
                                               "brisk.finish_reason": out.finish_reason}})
        guard = self.guards[0]
        attributes = {"http.route": self.raw.url.path, "gen_ai.system": "brisk",
                      "gen_ai.request.model": self.state.config.served_model_name, "brisk.request_id": self.id,
                      "gen_ai.usage.input_tokens": usage["prompt_tokens"],
                      "gen_ai.usage.output_tokens": usage["completion_tokens"],
                      "brisk.context_guard.outcome": guard.outcome, "brisk.context_policy": guard.policy.value,
                      "brisk.n": len(self.jobs), "brisk.stream": bool(self.body.stream)}
        if guard.truncated_messages:
            attributes["brisk.context_guard.truncated_messages"] = guard.truncated_messages
        if guard.max_tokens_clamped_to is not None:
            attributes["brisk.context_guard.max_tokens_clamped_to"] = guard.max_tokens_clamped_to
        error = f"{unfinished} choice(s) ended early: {abort_cause}" if unfinished else None
        self.state.tracer.record(f"POST {self.raw.url.path}", self.raw.headers, attributes, choices, error)


def _prompt_text(body) -> str:
    """The request's prompt for --log-prompts, shortened to 2,000 characters."""
    if getattr(body, "messages", None) is not None:
        text = " | ".join(f"{m.role}: {m.content if isinstance(m.content, str) else '[parts]'}" for m in body.messages)
    else:
        text = str(body.prompt)
    return text if len(text) <= 2000 else text[:2000] + "..."
