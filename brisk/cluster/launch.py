"""`brisk serve --replicas N`: start or join Ray, deploy the application, serve until SIGTERM.

Ray Serve's HTTP proxy listens on --host/--port. SIGTERM or Ctrl-C shuts Serve down gracefully:
each replica finishes its ongoing requests within --shutdown-timeout, as single-process serve does.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from brisk.cluster.settings import ClusterSettings, require_ray

log = logging.getLogger("brisk.cluster")


class _Stop(Exception):
    pass


def serve_cluster(args: argparse.Namespace, checked, settings: ClusterSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    ray, serve = require_ray()
    from brisk.cluster.app import APP_NAME, build_application

    if checked.sock is not None:
        checked.sock.close()  # the port was free; Serve's proxy binds it now
    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            return
        stop.set()
        if not deployed.is_set():
            raise _Stop()  # still starting: interrupt serve.run's wait

    deployed = threading.Event()
    started = time.monotonic()
    if settings.ray_address is not None:
        log.info("joining the Ray cluster at %s", settings.ray_address)
        ray.init(address=settings.ray_address, namespace="brisk", logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, namespace="brisk", logging_level=logging.WARNING)
    # after ray.init, whose core worker installs a SIGTERM handler that aborts the process
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _check_resources(ray, settings)
        serve.start(http_options={"host": args.host, "port": args.port,
                                  "keep_alive_timeout_s": int(max(args.timeout_keep_alive, 1))})
        app = build_application(args, checked, settings)
        scaling = (f"autoscaling {settings.min_replicas}-{settings.max_replicas}" if settings.autoscale
                   else f"{settings.replicas}")
        log.info("deploying %s engine replica(s), %g CPU each; the endpoint answers once one has loaded", scaling,
                 settings.replica_cpus)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        deployed.set()
        log.info("ready: http://%s:%d/v1 (Ray Serve, %.1f s)", args.host, args.port, time.monotonic() - started)
        while not stop.wait(1.0):
            pass
    except _Stop:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            try:
                if deployed.is_set():
                    _drain(serve, args.shutdown_timeout)
                serve.shutdown()
            finally:
                ray.shutdown()
    return 0


def _drain(serve, timeout_s: float) -> None:
    """Like single-process serve: no new requests, running ones finish (or end with an error event
    after --shutdown-timeout), then Serve stops the replicas."""
    from brisk.cluster.app import APP_NAME, INGRESS_DEPLOYMENT

    try:
        ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, APP_NAME)
        active = ingress.drain.remote().result(timeout_s=10)
        log.info("draining: %d requests in flight, up to %.0f s", active, timeout_s)
        deadline = time.monotonic() + timeout_s + 2  # the ingress ends stragglers at timeout_s
        while active and time.monotonic() < deadline:
            time.sleep(0.25)
            active = ingress.in_flight.remote().result(timeout_s=10)
    except Exception as e:  # noqa: BLE001 - a dead ingress has nothing to drain; shut down anyway
        log.warning("drain skipped: %r", e)


def _check_resources(ray, settings: ClusterSettings) -> None:
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if settings.min_replicas and settings.min_replicas * settings.replica_cpus > cpus:
        log.warning("the cluster has %g CPUs; %d replica(s) x %g CPU will wait for more nodes", cpus,
                    settings.min_replicas, settings.replica_cpus)
