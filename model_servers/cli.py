"""`prefixroute model-server`: run one simulated vLLM-like GPU model server (see server.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from prefixroute import settings
from prefixroute.model_servers.server import ServerSettings, serve


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, ServerSettings)


def main(args: argparse.Namespace) -> int:
    s = settings.from_namespace(ServerSettings, args)
    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    return asyncio.run(serve(s))
