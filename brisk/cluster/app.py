"""The Ray Serve application: one ingress deployment (the HTTP API) and one engine deployment
(the replicas), routed by prefix affinity.

`brisk serve --replicas N` builds it from its flags (brisk.cluster.launch); `serve run` /
`serve deploy` build it from a config file through `app_builder` (deploy/ray/serve.yaml), with the
same flags as an argument list.
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


def build_application(args: argparse.Namespace, checked, settings: ClusterSettings):
    """`checked`: brisk.server.preflight's result (model, window, chat template)."""
    _, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    from brisk.cluster.ingress import Ingress
    from brisk.cluster.replica import EngineReplica
    from brisk.models.registry import CATALOG

    per_replica = args.max_num_seqs + args.max_queued_requests
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
        max_ongoing_requests=per_replica,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[settings.request_router],
            request_router_kwargs={"max_imbalance": settings.router_max_imbalance}),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
        graceful_shutdown_wait_loop_s=0.5,
        **scaling)
    ingress = serve.deployment(
        serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=per_replica * settings.max_replicas + 64,
        graceful_shutdown_timeout_s=args.shutdown_timeout + 5,
        graceful_shutdown_wait_loop_s=0.5)
    source = checked.source
    served = source.name if source.name in CATALOG else source.path.stem
    values = serve_args(args)
    return ingress.bind(engine.bind(values, checked.max_model_len, checked.chat_template), values, served,
                        settings.max_replicas)


def app_builder(config: dict[str, Any]):
    """For `serve run` / `serve deploy`: `args: {flags: "--model /models/m.gguf --replicas 2 ..."}`,
    the flags of `brisk serve` (host and port are the Serve config's http_options)."""
    from brisk.cli import build_parser
    from brisk.cluster.settings import from_args
    from brisk.server.preflight import preflight

    flags = config.get("flags", "")
    argv = shlex.split(flags) if isinstance(flags, str) else [str(f) for f in flags]
    args = build_parser().parse_args(["serve", *argv])
    if args.model_arg is not None:
        args.model = args.model_arg
    if args.replicas is None and args.min_replicas is None and args.max_replicas is None:
        args.replicas = 1
    args.ray_address = None  # already inside the cluster
    checked = preflight(args, bind_port=False)
    settings = from_args(args, local_cpu_check=False)
    return build_application(args, checked, settings)
