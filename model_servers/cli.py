"""`prefixroute model-server`: run one simulated vLLM-like GPU model server (see server.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import zmq

from prefixroute import settings
from prefixroute.model_servers.server import ServerSettings, serve


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, ServerSettings)


def main(args: argparse.Namespace) -> int:
    try:
        s = settings.from_namespace(ServerSettings, args)
    except ValueError as exc:  # e.g. a bad --kv-events-config: its reason, not a traceback
        print(f"prefixroute model-server: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    try:
        return asyncio.run(serve(s))
    except zmq.ZMQError as exc:  # the KV-event sockets could not bind/connect (address in use, bad address)
        print(f"prefixroute model-server: error: KV events ({s.kv_events_config}): {exc}", file=sys.stderr)
        return 1
