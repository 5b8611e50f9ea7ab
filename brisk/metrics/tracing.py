"""OpenTelemetry spans per request, built after the request ends from the engine's own
timestamps (one clock, the same phase definitions as /metrics and usage.brisk):

    <route> (arrival -> last choice finished; guard outcome, token counts)
      └─ queue, prefill, decode   (per choice; token counts, preemptions)

With no exporter configured the server holds no tracer and does no tracing work.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Status, StatusCode


class RequestTracer:
    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self.tracer = provider.get_tracer("brisk")
        # monotonic seconds -> epoch ns (engine stamps are monotonic)
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def with_exporter(cls, exporter: SpanExporter, service_name: str = "brisk") -> "RequestTracer":
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    @classmethod
    def otlp(cls, endpoint: str, service_name: str = "brisk") -> "RequestTracer":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        return cls.with_exporter(OTLPSpanExporter(endpoint=url), service_name)

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def record(self, name: str, headers: Mapping[str, str], attributes: dict[str, Any],
               choices: list[dict[str, Any]], error: str | None = None) -> None:
        """`choices`: per engine request, its final metrics (with `timestamps`) and attributes."""
        stamps = [c["metrics"]["timestamps"] for c in choices if c.get("metrics", {}).get("timestamps")]
        if not stamps:
            return
        start = min(s["arrival"] for s in stamps)
        end = max(s["finished"] or s["arrival"] for s in stamps)
        root = self.tracer.start_span(name, context=extract(dict(headers)), start_time=self._ns(start),
                                      kind=trace.SpanKind.SERVER, attributes=attributes)
        if error:
            root.set_status(Status(StatusCode.ERROR, error))
        ctx = trace.set_span_in_context(root)
        for choice in choices:
            s = choice["metrics"].get("timestamps")
            if not s:
                continue
            phases = [("queue", s["arrival"], s["first_scheduled"]), ("prefill", s["first_scheduled"], s["first_token"]),
                      ("decode", s["first_token"], s["finished"])]
            for phase, begin, finish in phases:
                if begin is None or finish is None:
                    continue
                span = self.tracer.start_span(phase, context=ctx, start_time=self._ns(begin),
                                              attributes={**choice["attributes"], **_phase_attributes(phase, choice)})
                span.end(end_time=self._ns(finish))
        root.end(end_time=self._ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()


def _phase_attributes(phase: str, choice: dict[str, Any]) -> dict[str, Any]:
    if phase == "prefill":
        return {"brisk.prompt_tokens": choice["prompt_tokens"], "brisk.cached_prompt_tokens": choice["cached_tokens"],
                "brisk.num_preemptions": choice["metrics"].get("num_preemptions", 0)}
    if phase == "decode":
        return {"brisk.output_tokens": choice["output_tokens"]}
    return {}
