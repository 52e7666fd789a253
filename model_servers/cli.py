"""`prefixroute model-server`: run one simulated vLLM-like GPU model server (see server.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import zmq

from prefixroute import settings
from prefixroute.model_servers.server import ServerSettings, serve


HELP_ESSENTIALS = (
    "host", "port", "id", "log_level",
    "profile", "served_model_name", "lora_modules", "time_scale", "default_max_tokens",  # the model and GPU
    "num_gpu_blocks", "block_size", "kv_offloading_size", "max_num_seqs", "max_num_batched_tokens",
    "max_model_len",  # vLLM's engine flags
    "kv_events_config",  # KV events (the bench's fleet reads this --help to learn that the servers publish)
    "fail_ratio", "extra_latency_ms", "admin_port",  # fault injection
)
"""The settings `prefixroute model-server --help` lists; --help-all lists all of them."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, ServerSettings)
    settings.essential_help(parser, HELP_ESSENTIALS)


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
