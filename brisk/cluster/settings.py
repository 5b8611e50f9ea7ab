"""`brisk serve --replicas ...`: the scale-out flags, checked before Ray is imported or started.

Ray-free and torch-free: a bad flag is one line and exit 2 in the time Python takes to start.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass

from brisk.cluster.affinity import DEFAULT_MAX_IMBALANCE
from brisk.errors import BriskError

ROUTERS = {"prefix-affinity": "brisk.cluster.router.PrefixAffinityRouter",
           "pow2": "brisk.cluster.router.PowerOfTwoRouter"}
REPLICA_STREAMS = ("socket", "ray")  # brisk.cluster.channel, or Ray streaming-generator items
RAY_EXTRA_HINT = "install Ray Serve with: pip install 'brisk-llm[ray]' (the `ray` extra)"
ADDRESS_TIMEOUT_S = 5.0


def add_serve_arguments(p) -> None:
    """Every flag of `brisk serve`: its own (brisk.server.args) and the scale-out group. The CLI and
    `app_builder` (a Serve config's `flags`) parse the same set."""
    from brisk.server.args import add_serve_arguments as add_server_arguments

    add_server_arguments(p)
    add_arguments(p.add_argument_group("scale-out (Ray Serve)"))


def serve_parser() -> argparse.ArgumentParser:
    from brisk.argtypes import Parser

    p = Parser(prog="brisk serve", allow_abbrev=False)
    add_serve_arguments(p)
    return p


def add_arguments(p) -> None:
    p.add_argument("--replicas", type=int, default=None,
                   help="serve through Ray Serve with this many engine replicas behind one endpoint "
                        "(default: one process, no Ray); see docs/scale-out.md")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale on queue depth between --min-replicas and --max-replicas (Ray Serve)")
    p.add_argument("--max-replicas", type=int, default=None, help="the autoscaling ceiling (Ray Serve)")
    p.add_argument("--target-ongoing-requests", type=float, default=16.0,
                   help="autoscaling target: ongoing requests per replica (default 16)")
    p.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs each replica reserves from Ray (default 1); its torch threads follow it")
    p.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs each replica reserves (default: 1 with --device cuda, else 0)")
    p.add_argument("--ray-address", default=None,
                   help="join a running Ray cluster (auto, host:port or ray://host:port); "
                        "default: start a local Ray instance")
    p.add_argument("--request-router", default="prefix-affinity", choices=list(ROUTERS),
                   help="prefix-affinity (default: a prompt prefix goes back to the replica that served it) or "
                        "pow2 (Ray Serve's default: power of two choices on queue length)")
    p.add_argument("--router-max-imbalance", type=int, default=DEFAULT_MAX_IMBALANCE,
                   help="prefix affinity yields to load when the affine replica has this many more ongoing "
                        f"requests than the least-loaded one (default {DEFAULT_MAX_IMBALANCE})")
    p.add_argument("--replica-stream", default=None, choices=list(REPLICA_STREAMS),
                   help="how replicas send tokens to the HTTP process: socket (default: one TCP connection per "
                        "replica, one frame per engine step for all streams) or ray (a Ray streaming-generator "
                        "message per stream and step; for clusters whose nodes may talk only over Ray's ports)")
    p.add_argument("--ray-metrics", action="store_true", default=None,
                   help="let the local Ray instance export its metrics (Ray Serve's per-deployment request "
                        "series) on its metrics port, which listens on every interface without authentication; "
                        "off by default (brisk's own /metrics, behind the API key, has the engines' series)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="a replica sends each stream's tokens to the ingress this many at a time, the first at "
                        "once (vLLM's --stream-interval; default 1): fewer messages, burstier streaming")


@dataclass(frozen=True)
class ClusterSettings:
    replicas: int  # initial replicas
    min_replicas: int
    max_replicas: int
    autoscale: bool
    target_ongoing_requests: float
    replica_cpus: float
    replica_gpus: float
    ray_address: str | None
    router_max_imbalance: int
    request_router: str = "prefix-affinity"
    stream_interval: int = 1
    replica_stream: str = "socket"
    ray_metrics: bool = False  # Ray's own metrics export (unauthenticated, every interface)

    @property
    def cpus_needed(self) -> float:
        return self.max_replicas * self.replica_cpus


def wants_cluster(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) is not None for name in ("replicas", "min_replicas", "max_replicas"))


def from_args(args: argparse.Namespace, local_cpu_check: bool = True) -> ClusterSettings | None:
    """The cluster settings, or None for single-process serve (where cluster-only flags are refused).
    `local_cpu_check`: a local Ray instance must have the CPUs the replicas reserve (off inside a
    cluster, whose autoscaler may add nodes)."""
    if not wants_cluster(args):
        given = [flag for flag, value in (("--ray-address", args.ray_address), ("--replica-gpus", args.replica_gpus),
                                          ("--stream-interval", args.stream_interval),
                                          ("--replica-stream", args.replica_stream),
                                          ("--ray-metrics", getattr(args, "ray_metrics", None))) if value is not None]
        if given:
            flag = given[0]
            raise BriskError(f"{flag} applies to Ray Serve only; add --replicas N (or --min-replicas/--max-replicas)")
        return None
    replicas, low, high = args.replicas, args.min_replicas, args.max_replicas
    if replicas is not None and replicas < 1:
        raise BriskError(f"--replicas must be >= 1, got {replicas} (for one process without Ray, omit --replicas)")
    if low is not None and low < 0:
        raise BriskError(f"--min-replicas must be >= 0, got {low}")
    if high is not None and high < 1:
        raise BriskError(f"--max-replicas must be >= 1, got {high}")
    autoscale = low is not None or high is not None
    if autoscale:
        low = low if low is not None else min(1, high)
        high = high if high is not None else max(low, replicas or 1)
        if low > high:
            raise BriskError(f"--min-replicas {low} is greater than --max-replicas {high}")
        if replicas is not None and not low <= replicas <= high:
            raise BriskError(f"--replicas {replicas} must lie between --min-replicas {low} and --max-replicas {high}")
        replicas = replicas if replicas is not None else max(low, 1)
    else:
        low = high = replicas
    if args.target_ongoing_requests <= 0:
        raise BriskError(f"--target-ongoing-requests must be > 0, got {args.target_ongoing_requests}")
    if args.replica_cpus <= 0:
        raise BriskError(f"--replica-cpus must be > 0, got {args.replica_cpus}")
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1.0 if str(args.device).startswith("cuda") else 0.0
    if gpus < 0:
        raise BriskError(f"--replica-gpus must be >= 0, got {gpus}")
    if args.router_max_imbalance < 0:
        raise BriskError(f"--router-max-imbalance must be >= 0, got {args.router_max_imbalance}")
    interval = 1 if args.stream_interval is None else args.stream_interval
    if interval < 1:
        raise BriskError(f"--stream-interval must be >= 1 (tokens per message), got {interval}")
    settings = ClusterSettings(replicas, low, high, autoscale, args.target_ongoing_requests, args.replica_cpus,
                               gpus, args.ray_address, args.router_max_imbalance, args.request_router, interval,
                               args.replica_stream or "socket", bool(getattr(args, "ray_metrics", None)))
    if settings.ray_metrics and settings.ray_address is not None:
        raise BriskError("--ray-metrics configures the local Ray instance brisk starts; a cluster joined with "
                         "--ray-address keeps its own settings (ray start --metrics-export-port ...)")
    if settings.ray_address is None and local_cpu_check:
        cores = os.cpu_count() or 1
        if settings.cpus_needed > cores:
            raise BriskError(f"{settings.max_replicas} replicas x --replica-cpus {settings.replica_cpus:g} need "
                             f"{settings.cpus_needed:g} CPUs; this machine has {cores}. Lower --replica-cpus "
                             f"(e.g. {cores / settings.max_replicas:.2g}) or the replica count, or join a cluster "
                             "with --ray-address")
    elif settings.ray_address is not None:
        check_address(settings.ray_address)
    return settings


def check_address(address: str) -> None:
    """An unreachable --ray-address fails here within seconds (ray.init would retry for a minute)."""
    if address == "auto":
        return  # ray.init finds the local cluster from its session files, or fails at once
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise BriskError(f"--ray-address {address!r}: expected auto, host:port or ray://host:port")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_TIMEOUT_S):
            pass
    except OSError as e:
        raise BriskError(f"--ray-address {address}: cannot connect to {host}:{port} "
                         f"({e.strerror or e}); is the Ray head running (ray start --head)?") from None


def require_ray():
    """Ray Serve's modules, or one line naming the extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise BriskError(f"--replicas needs Ray Serve, which is not installed; {RAY_EXTRA_HINT}") from None
    return ray, serve
