"""`brisk serve --replicas N`: start or join Ray, deploy the engine replicas, and serve HTTP from
this process with the single-process server.

The socket is open at once (preflight bound it); /ready answers 503 `loading` until the replicas
are deployed and one answered. HTTP handling is brisk.server's, unchanged: uvicorn with the same
connection limits, the same API, and the same drain on SIGTERM (new requests 503, running ones get
--shutdown-timeout); then Serve stops the replicas and Ray stops. The ingress here talks to the
replicas through the engine deployment's handle (brisk.cluster.remote), routed by
brisk.cluster.router.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from brisk.cluster.settings import ClusterSettings, require_ray

log = logging.getLogger("brisk.cluster")


def serve_cluster(args: argparse.Namespace, checked, settings: ClusterSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    ray, serve = require_ray()
    from brisk.cluster.app import APP_NAME, engine_application
    from brisk.cluster.ingress import attach_router_metrics
    from brisk.cluster.remote import RemoteEngine
    from brisk.server.serve import serve as serve_http

    started = time.monotonic()
    if settings.ray_address is not None:
        log.info("joining the Ray cluster at %s", settings.ray_address)
        ray.init(address=settings.ray_address, namespace="brisk", logging_level=logging.WARNING)
    else:
        # Ray runs its workers at nice 15 by default, which starves the replicas' engines behind every
        # nice-0 thread on the machine (this process's HTTP handling, Ray's own daemons): measured
        # 0.77x of one process's tok/s; the engine thread lowers its own priority (+5) as in one process
        os.environ.setdefault("RAY_worker_niceness", "0")
        # NOTE: Ray's daemons listen on every interface (Ray cannot bind them to loopback: it resolves
        # 127.0.0.1 to the node's address); its metrics export, which carries Serve's per-deployment
        # request series without authentication, stays off unless --ray-metrics asks for it
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, namespace="brisk", logging_level=logging.WARNING,
                 _system_config={"enable_metrics_collection": settings.ray_metrics})
    try:
        _check_resources(ray, settings)
        serve.start(proxy_location="Disabled")  # HTTP is served by this process

        def connect(report):
            with report.phase("engine"):
                scaling = (f"autoscaling {settings.min_replicas}-{settings.max_replicas}" if settings.autoscale
                           else str(settings.replicas))
                log.info("deploying %s engine replica(s), %g CPU each", scaling, settings.replica_cpus)
                handle = serve.run(engine_application(args, checked, settings), name=APP_NAME, route_prefix=None,
                                   blocking=False)
                engine = RemoteEngine.connect(handle, settings.max_replicas, channel_host(ray, settings))
            log.info("replicas ready after %.1f s (Ray Serve)", time.monotonic() - started)
            return engine

        return serve_http(args, checked, remote_engine=connect, on_state=attach_router_metrics)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def channel_host(ray, settings: ClusterSettings) -> str | None:
    """Where the replicas' output channel reaches this process (brisk.cluster.channel): loopback for
    a local Ray instance, else this node's address in the cluster; None with --replica-stream ray."""
    if settings.replica_stream != "socket":
        return None
    if settings.ray_address is None:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def _check_resources(ray, settings: ClusterSettings) -> None:
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if settings.min_replicas and settings.min_replicas * settings.replica_cpus > cpus:
        log.warning("the cluster has %g CPUs; %d replica(s) x %g CPU will wait for more nodes", cpus,
                    settings.min_replicas, settings.replica_cpus)
