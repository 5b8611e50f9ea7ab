"""The ingress: brisk's own FastAPI app (brisk.server.app) over the engine replicas.

Context guard, readiness, API key, errors, streaming and `usage.brisk` are the single-process
server's code; only the engine behind `ServerState` is a RemoteEngine. The model is not loaded
here: the tokenizer and limits come from a replica (`info`), so the ingress needs no model files
and /ready answers 503 (loading) until the first replica has loaded.
"""

from __future__ import annotations

import argparse
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class RouterCollector:
    """The routers' decisions and replica count on the ingress's /metrics."""

    def describe(self):
        return []

    def collect(self):
        from brisk.cluster.registry import decisions, replica_ids

        family = CounterMetricFamily("brisk:router_decisions", "Requests routed, by reason: prefix "
                                     "(affinity to the replica that served the prefix) or load "
                                     "(power of two choices on queue length).", labels=["reason"])
        for reason, count in sorted(decisions().items()):
            family.add_metric([reason], count)
        yield family
        yield GaugeMetricFamily("brisk:replicas", "Engine replicas the router can send to.", value=len(replica_ids()))


def attach_router_metrics(state) -> None:
    state.metrics.registry.register(RouterCollector())


class Ingress:
    """The ingress as a Ray Serve deployment (deploy/ray/serve.yaml); `brisk serve --replicas`
    serves the same app from its own process instead (brisk.cluster.launch)."""

    def __init__(self, engine_handle, serve_args: dict[str, Any], served_name: str, max_replicas: int):
        from brisk.cluster.remote import RemoteEngine
        from brisk.server.serve import server_config
        from brisk.server.state import ServerState

        args = argparse.Namespace(**serve_args)
        args.disable_log_stats = True  # each replica's engine logs its own line
        config = server_config(args, served_name)
        tracer = None
        if args.otlp_endpoint:
            from brisk.metrics.tracing import RequestTracer

            tracer = RequestTracer.otlp(args.otlp_endpoint, service_name=f"brisk:{config.served_model_name}")

        host = None
        if getattr(args, "replica_stream", None) in (None, "socket"):
            import ray

            host = ray.util.get_node_ip_address()  # replicas may run on other nodes

        def factory(report):
            with report.phase("engine"):
                return RemoteEngine.connect(engine_handle, max_replicas, host)

        self.state = ServerState(config, factory, tracer=tracer)
        attach_router_metrics(self.state)

    def __serve_build_asgi_app__(self):
        from brisk.server.app import create_app

        return create_app(self.state)
