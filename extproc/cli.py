"""`prefixroute extproc`: run the ext_proc routing service that Envoy calls.

Prints one ready line (``prefixroute extproc ready on HOST:PORT (..., metrics http://HOST:PORT/metrics)``)
once it serves; SIGTERM or SIGINT stops it cleanly (in-flight gRPC streams get a short grace period, the
pool's probes are cancelled, queued spans are flushed for up to 2 s).

Telemetry (RouterTelemetrySettings, telemetry/router.py): one OTLP span per routed request,
exported in the background per the standard ``OTEL_*`` variables (or --otlp-endpoint), and Prometheus
/metrics on --metrics-port.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from prefixroute import settings
from prefixroute.extproc.endpoints.pool import EndpointPool
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.server import (ExtprocSettings, new_event_loop, resolved_auth_token, server_credentials,
                                        start_server)
from prefixroute.extproc.service import PoolRouter
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.telemetry.router import RouterTelemetry, RouterTelemetrySettings

READY_PREFIX = "prefixroute extproc ready on "


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, ExtprocSettings)
    settings.add_arguments(parser, RoutingSettings)
    settings.add_arguments(parser, PoolSettings)
    settings.add_arguments(parser, RouterTelemetrySettings)


async def serve(ext: ExtprocSettings, routing: RoutingSettings, pool_settings: PoolSettings,
                stop: asyncio.Event, tele: RouterTelemetrySettings | None = None) -> None:
    """Run until `stop` is set."""
    pool = EndpointPool(pool_settings)
    # track_prefill: PoolRouter.release calls core.on_release once per routed request.
    core = RouterCore(routing, track_prefill=True)
    router = PoolRouter(core, pool)
    telemetry = RouterTelemetry.from_settings(tele or RouterTelemetrySettings(metrics_port=-1),
                                              in_flight=lambda: pool.in_flight,
                                              index_size=core.index.num_entries_by_endpoint,
                                              endpoint_states=pool.snapshot,
                                              time_model=getattr(core.scheduler.policy, "time_model_figures", None))
    tracker = RequestTracker(telemetry.on_decision, telemetry.on_response, router.endpoint_of,
                             max_body_bytes=routing.max_body_bytes, on_first_token=router.first_token,
                             on_usage=router.usage)
    await pool.start()
    try:
        all_up = await pool.wait_ready(ext.ready_timeout_s)
        # Startup objects (modules, protobuf descriptors, settings) never die: move them out of the GC's view,
        # and collect young objects less often, so collections are rarer and shorter (tail latency).
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 100)
        server, port = await start_server(router, ext, tracker)
        healthy = sum(1 for s in pool.snapshot() if s.healthy)
        ms = telemetry.metrics_server
        metrics = f"http://{ms.server_address[0]}:{ms.server_address[1]}/metrics" if ms is not None else "off"
        print(f"{READY_PREFIX}{ext.listen_address}:{port} (policy {routing.policy}, "
              f"{healthy}/{len(pool.endpoints)} endpoints healthy{'' if all_up else ', still probing'}, "
              f"metrics {metrics}, traces {'on' if telemetry.recorder.enabled else 'off'}"
              f"{': ' + telemetry.recorder.disabled_reason if telemetry.recorder.disabled_reason else ''})", flush=True)
        await stop.wait()
        await server.stop(grace=1.0)
    finally:
        await pool.close()
        # Off the loop: flushing waits on the exporter (bounded), the loop must not stall meanwhile.
        await asyncio.get_running_loop().run_in_executor(None, telemetry.close, 2.0)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ext = settings.from_namespace(ExtprocSettings, args)
        routing = settings.from_namespace(RoutingSettings, args)
        pool_settings = settings.from_namespace(PoolSettings, args)
        tele = settings.from_namespace(RouterTelemetrySettings, args)
        # Validate endpoints, TLS files and the token before starting anything (clear message, exit 2).
        EndpointPool(pool_settings)
        server_credentials(ext)
        resolved_auth_token(ext)
    except (ValueError, OSError) as exc:
        print(f"prefixroute extproc: {exc}", file=sys.stderr)
        return 2
    loop = new_event_loop(ext.uvloop)
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        loop.run_until_complete(serve(ext, routing, pool_settings, stop, tele))
    except OSError as exc:
        print(f"prefixroute extproc: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    return 0
