#!/usr/bin/env python3
"""What each hop adds to a streamed request's TTFT, one request at a time (the hop behind the P50 gap).

One simulated model server; the same streamed chat request (a --prompt-kb KB system prompt, a full prefix-cache
hit after the first) sent one at a time, --gap-ms apart, over keep-alive connections, in turn:

- **direct** to the server;
- **bare-envoy**: an Envoy rendered by `prefixroute envoy-config` with no ext_proc filter and no Lua filter,
  round-robin to that one server (Envoy's own hop);
- **gateway**: `prefixroute gateway` with its defaults (Envoy, the routing ext_proc, the facts path), as
  `prefixroute bench` starts it, plus any --gateway-args.

With --peers (e.g. sglang-router), each peer router fronts the same server in the same rounds, and its hop (its
TTFT - direct's) is printed beside ours.

Each round sends --num-requests requests to each target and prints the median client TTFT of each and the
differences: Envoy's hop (bare-envoy - direct) and the router's (gateway - bare-envoy). Only figures of the
same round compare (this host's noise moves them between rounds). Unlike `prefixroute overhead-bench` (requests
back to back, a small JSON answer, Envoy's added latency over Envoy alone) this is the benches' request shape:
streamed, with idle time between requests, as each of a few dozen requests per second per server meets it.

    .venv/bin/python scripts/hop_ttft.py --prompt-kb 16
    .venv/bin/python scripts/hop_ttft.py --prompt-kb 12 --gap-ms 50 --peers sglang-router
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from prefixroute.bench import client as bench_client
from prefixroute.bench import runner
from prefixroute.bench.fleet import FleetConfig, served_model, start_fleet
from prefixroute.bench.routers import parse_router
from prefixroute.bench.workload_spec import RequestSpec
from prefixroute.extproc.envoy_config import EnvoySettings, render
from prefixroute.extproc.gateway import envoy_binary
from prefixroute.procs import ProcessGroup, free_port, http_get

TARGETS = ("direct", "bare-envoy", "gateway")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--prompt-kb", type=int, default=16, help="System prompt size in KiB (16: ~4k tokens).")
    p.add_argument("--num-requests", type=int, default=100, help="Requests per target and round.")
    p.add_argument("--num-rounds", type=int, default=3, help="Rounds, each target in turn.")
    p.add_argument("--gap-ms", type=float, default=10.0, help="Idle time between two requests.")
    p.add_argument("--gateway-args", default="", help="Extra `prefixroute gateway` flags, comma-separated "
                   "(e.g. --response-path=observe), as `prefixroute bench --gateway-args` takes them.")
    p.add_argument("--compare-gateway-args", action="append", default=[], metavar="ARGS",
                   help="Another gateway measured in the same rounds, with these extra flags (comma-separated; "
                   "repeatable; with '=' since the value starts with a dash): e.g. "
                   "--compare-gateway-args=--routing-filter=ext_authz_http beside the default.")
    p.add_argument("--peers", default="", help="Peer routers measured in the same rounds, comma-separated "
                   "`prefixroute bench` router names (e.g. sglang-router): each one's hop is its TTFT - direct's.")
    p.add_argument("--log-dir", type=Path, default=None, help="Children's logs (default: a temporary folder).")
    return p.parse_args(argv)


async def _ttfts(base_url: str, spec: RequestSpec, model: str, n: int, gap_s: float) -> list[float]:
    """Client TTFTs (ms) of `n` sequential requests; raises on any failed one (a figure over errors is no figure)."""
    async with aiohttp.ClientSession() as session:
        out = []
        for _ in range(n):
            res = await bench_client.send_one(session, base_url, spec, model, time.perf_counter(), 30.0)
            if res.error is not None or res.ttft_ms is None:
                raise RuntimeError(f"request to {base_url} failed: {res.error}")
            out.append(res.ttft_ms)
            await asyncio.sleep(gap_s)
        return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    text = ("You are a helpful assistant. " * (a.prompt_kb * 40 + 1))[: a.prompt_kb * 1024]
    spec = RequestSpec(index=0, max_tokens=4, messages=({"role": "system", "content": text},
                                                        {"role": "user", "content": "hi"}))
    with contextlib.ExitStack() as stack:
        log_dir = a.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hop-ttft-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        group = stack.enter_context(ProcessGroup(log_dir))
        (endpoint,) = start_fleet(group, FleetConfig(num_servers=1, kv_events=False))
        model = served_model(endpoint)
        port, admin = free_port(), free_port()
        config = log_dir / "bare-envoy.yaml"
        config.write_text(render(EnvoySettings(gateway_port=port, admin_port=admin, listen_address="127.0.0.1",
                                               extproc_enabled=False, response_facts_lua=False,
                                               endpoints=(endpoint,))))
        group.start("bare-envoy", [envoy_binary(), "-c", str(config), "--disable-hot-restart", "--base-id",
                                   str(admin), "--concurrency", "1", "-l", "warning"],
                    ready=lambda: http_get(f"http://127.0.0.1:{port}/v1/models")[0] == 200)
        gateway = runner.start_router(group, stack, parse_router("prefixroute:prefix"), [endpoint], seed=1,
                                      gateway_args=[x for x in a.gateway_args.split(",") if x])
        urls = {"direct": f"http://{endpoint}", "bare-envoy": f"http://127.0.0.1:{port}", "gateway": gateway.base_url}
        for i, args in enumerate(a.compare_gateway_args, 1):
            # its own name: the logs of each gateway in a folder of their own
            router = dataclasses.replace(parse_router("prefixroute:prefix"), name=f"prefixroute:prefix-compare{i}")
            urls[f"gateway {args}"] = runner.start_router(group, stack, router, [endpoint], seed=1,
                                                          gateway_args=[x for x in args.split(",") if x]).base_url
        peers = [x for x in a.peers.split(",") if x]
        for name in peers:
            urls[name] = runner.start_router(group, stack, parse_router(name), [endpoint], seed=1).base_url
        targets = tuple(urls)
        for url in urls.values():  # warm: the prompt cached, connections and the router's tables made
            asyncio.run(_ttfts(url, spec, model, 5, a.gap_ms / 1e3))
        print(f"{a.prompt_kb} KB streamed chat requests, one at a time, {a.gap_ms:g} ms apart; median client TTFT, ms")
        for rnd in range(a.num_rounds):
            med = {name: statistics.median(asyncio.run(_ttfts(urls[name], spec, model, a.num_requests,
                                                                a.gap_ms / 1e3))) for name in targets}
            print(f"  round {rnd}: " + ", ".join(f"{name} {med[name]:.2f}" for name in targets)
                  + f"; Envoy's hop {med['bare-envoy'] - med['direct']:+.2f}, the router's "
                  f"{med['gateway'] - med['bare-envoy']:+.2f}"
                  + "".join(f", the router's with {name[8:]} {med[name] - med['bare-envoy']:+.2f}"
                            for name in targets[len(TARGETS):] if name not in peers)
                  + "".join(f", {name}'s hop {med[name] - med['direct']:+.2f}" for name in peers), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
