"""The Ray Serve application: one ingress deployment (the HTTP API) and one engine deployment
(the replicas), routed by prefix affinity.

`serve run` / `serve deploy` build it from a config file through `app_builder`
(deploy/ray/serve.yaml), with the flags of `brisk serve`. `brisk serve --replicas N`
(brisk.cluster.launch) deploys only the engine deployment and serves HTTP from its own process
with the single-process server (uvicorn, the same connection limits and drain): one Ray hop per
streamed token instead of two (proxy -> ingress -> replica), measured in benchmarks/scale_out.py.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from brisk.cluster.settings import ROUTERS, ClusterSettings, require_ray

APP_NAME = "brisk"
ENGINE_DEPLOYMENT = "BriskEngine"
INGRESS_DEPLOYMENT = "BriskIngress"
HEALTH_CHECK_PERIOD_S = 2.0


def serve_args(args: argparse.Namespace) -> dict[str, Any]:
    """The serve flags as plain values, for the replicas' constructors."""
    return {k: v for k, v in vars(args).items() if k != "func"}


def engine_application(args: argparse.Namespace, checked, settings: ClusterSettings):
    """The engine deployment alone (`brisk serve --replicas` runs the HTTP ingress in its own
    process). `checked`: brisk.server.preflight's result (model, window, chat template)."""
    _, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    from brisk.cluster.replica import EngineReplica

    scaling: dict[str, Any]
    if settings.autoscale:
        scaling = {"autoscaling_config": {
            "min_replicas": settings.min_replicas, "max_replicas": settings.max_replicas,
            "initial_replicas": settings.replicas, "target_ongoing_requests": settings.target_ongoing_requests}}
    else:
        scaling = {"num_replicas": settings.replicas}
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_cpus": settings.replica_cpus, "num_gpus": settings.replica_gpus},
        max_ongoing_requests=_per_replica(args),
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[settings.request_router],
            request_router_kwargs={"max_imbalance": settings.router_max_imbalance}),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        # Serve's per-call access log (every generate, every /metrics scrape) would be written to a
        # file and forwarded to this process's stderr; the ingress logs each request (brisk.access)
        logging_config={"enable_access_log": False},
        graceful_shutdown_timeout_s=args.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.5,
        **scaling)
    return engine.bind(serve_args(args), checked.max_model_len, checked.chat_template)


def build_application(args: argparse.Namespace, checked, settings: ClusterSettings):
    """Ingress + engine: the whole application, for `serve run` / `serve deploy`."""
    _, serve = require_ray()
    from brisk.cluster.ingress import Ingress
    from brisk.models.registry import CATALOG

    ingress = serve.deployment(
        serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=_per_replica(args) * settings.max_replicas + 64,
        graceful_shutdown_timeout_s=args.shutdown_timeout + 5,
        graceful_shutdown_wait_loop_s=0.5)
    source = checked.source
    served = source.name if source.name in CATALOG else source.path.stem
    return ingress.bind(engine_application(args, checked, settings), serve_args(args), served, settings.max_replicas)


def _per_replica(args: argparse.Namespace) -> int:
    """Requests one replica holds: running plus queued (the ingress's admission bounds the total)."""
    return args.max_num_seqs + args.max_queued_requests


def app_builder(config: dict[str, Any]):
    """For `serve run` / `serve deploy`: `args: {flags: "--model /models/m.gguf --replicas 2 ..."}`,
    the flags of `brisk serve` (host and port are the Serve config's http_options)."""
    from brisk.cluster.settings import from_args, serve_parser
    from brisk.server.preflight import preflight

    flags = config.get("flags", "")
    argv = shlex.split(flags) if isinstance(flags, str) else [str(f) for f in flags]
    args = serve_parser().parse_args(argv)
    if args.model_arg is not None:
        args.model = args.model_arg
    if args.replicas is None and args.min_replicas is None and args.max_replicas is None:
        args.replicas = 1
    args.ray_address = None  # already inside the cluster
    checked = preflight(args, bind_port=False)
    settings = from_args(args, local_cpu_check=False)
    return build_application(args, checked, settings)
