#!/usr/bin/env python3
"""The pick bus's own CPU per request, by linger (extproc/peers/bus.py, --peers-linger-ms), and what applying
the messages costs the receiving replica (--sink router).

    .venv/bin/python scripts/bench_peer_bus.py --num-picks 2000 --lingers-ms 0,1,2,5 --rounds 2
    .venv/bin/python scripts/bench_peer_bus.py --sink router --messages gateway --lingers-ms 2 --rounds 3

Starts a real nats-server on loopback and two `PeerBus` replicas in this process (one event loop): replica a
publishes, per simulated request, a pick of 64 block hashes (a 4 KB prompt) and its release, one request every
``--interval-ms`` (plus the loop's own time), signed with a bus key as the gateway runs it; replica b receives and
counts. Process CPU (user + system, `time.process_time`) over the run, less a control run of the same loop without
the bus, divided by the requests: the bus's CPU per request, sender, NATS client and receiver together (the
nats-server process is not counted). Lingers are measured in rounds, alternating, and printed with their ratio
to linger 0 in the same round (this machine is noisy: compare within a round).

``--messages gateway`` sends what one routed request of the facts path makes a replica publish: its pick, its
first token (`Done`), its end (`Release`) and the time model's observation (`Observed`), instead of pick and
release. ``--sink router`` has replica b apply them to a real `PoolRouter` (`factory.build_router` over four
fixed endpoints, prefill tracked, as `prefixroute extproc` builds it) instead of counting them, and then, the
bus aside, times that apply alone per message kind in process (`PoolRouter.apply_peer_batch`, one kind at a
time over the same requests): the part of a further replica's cost in the gateway that is the replicated
state (prefix index, prefill queues, in-flight counts), not the transport."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import time

from prefixroute.bench.decision_replay import ReplayPool
from prefixroute.extproc.factory import build_router
from prefixroute.extproc.peers import codec
from prefixroute.extproc.peers.bus import PeerBus
from prefixroute.extproc.peers.server import nats_server_argv, nats_url
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.server import new_event_loop
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port, tcp_open


class _Sink:
    def __init__(self) -> None:
        self.num_messages = 0

    def apply_peer_batch(self, origin, messages, now_s) -> None:  # noqa: ANN001
        self.num_messages += len(messages)

    def expire_peers(self, now_s: float) -> None:
        pass


class _RouterSink(_Sink):
    """Applies what it receives to a real `PoolRouter` (as the gateway's replicas do) and counts it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = build_router(RoutingSettings(), ReplayPool(ENDPOINTS))

    def apply_peer_batch(self, origin, messages, now_s) -> None:  # noqa: ANN001
        self.num_messages += len(messages)
        self.router.apply_peer_batch(origin, messages, now_s)


ENDPOINTS = tuple(f"10.0.0.{i}:8000" for i in range(1, 5))
SYSTEM_HASHES = [random.getrandbits(64) for _ in range(48)]
"""Every request's first 48 blocks (a shared system prompt), then 16 of its own: 64 blocks, a 4 KB prompt."""


def _request_messages(i: int, mix: str) -> list[codec.Message]:
    """What replica a publishes for request `i` (module docstring: --messages)."""
    ep = ENDPOINTS[i % len(ENDPOINTS)]
    hashes = SYSTEM_HASHES + [random.getrandbits(64) for _ in range(16)]
    if mix == "pick-release":
        return [codec.Pick(i, ep, hashes, 100.0), codec.Release(i)]
    return [codec.Pick(i, ep, hashes, 100.0), codec.Done(i), codec.Release(i),
            codec.Observed(ep, 1024.0, 768.0, 0.05, 256.0, 2)]


def _apply_alone(num_requests: int, mix: str) -> dict[str, float]:
    """Microseconds per request `PoolRouter.apply_peer_batch` takes for each message kind, in process, no bus."""
    sink = _RouterSink()
    requests = [_request_messages(i, mix) for i in range(num_requests)]
    origin = ("a", 1)
    spent: dict[str, float] = {}
    now = 1000.0
    for msgs in requests:
        now += 0.001
        for m in msgs:
            t0 = time.perf_counter()
            sink.router.apply_peer_batch(origin, [m], now)
            kind = codec.KINDS[type(m)]
            spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - t0
    return {k: v / num_requests * 1e6 for k, v in spent.items()}


async def _run(url: str, linger_ms: float | None, num_picks: int, interval_s: float, mix: str = "pick-release",
               sink_kind: str = "count") -> tuple[float, int, int]:
    """(CPU seconds, messages received, NATS messages sent) of one run; linger None: the control (no bus)."""
    sink = _RouterSink() if sink_kind == "router" else _Sink()
    buses = []
    if linger_ms is not None:
        for name in ("a", "b"):
            bus = PeerBus(PeerSettings(url=url, replica_id=name, linger_ms=linger_ms), sink)
            await bus.start()
            buses.append(bus)
        while not all(b.connected for b in buses):
            await asyncio.sleep(0.01)
        for b in buses:
            await b._nc.flush()  # noqa: SLF001 - subscriptions in place before timing
    requests = [_request_messages(i, mix) for i in range(num_picks)]
    c0 = time.process_time()
    for msgs in requests:
        if buses:
            for m in msgs:
                buses[0].publish(m)
        await asyncio.sleep(interval_s)
    await asyncio.sleep(0.05)
    cpu = time.process_time() - c0
    sent = buses[0].num_batches_sent if buses else 0
    for b in buses:
        await b.close()
    return cpu, sink.num_messages, sent


async def _main(args: argparse.Namespace) -> None:
    os.environ["PREFIXROUTE_PEERS_KEY"] = "bench-bus-key-" + "k" * 16
    port = free_port()
    nats = subprocess.Popen(nats_server_argv(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not tcp_open(port):
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server did not start")
            await asyncio.sleep(0.05)
        url, n, iv = nats_url(port), args.num_picks, args.interval_ms / 1000
        lingers = [float(x) for x in args.lingers_ms.split(",")]
        if 0.0 not in lingers:
            lingers.insert(0, 0.0)
        per_request = 2 if args.messages == "pick-release" else 4
        what = "pick of 64 hashes + release" if per_request == 2 else "pick of 64 hashes, done, release, observed"
        print(f"bench_peer_bus: {n} requests ({what}) every {args.interval_ms} ms, sink {args.sink}, {args.loop}, "
              f"{args.rounds} rounds; CPU per request over a control loop without the bus")
        for r in range(args.rounds):
            control = (await _run(url, None, n, iv, args.messages, args.sink))[0]
            per: dict[float, float] = {}
            for lg in lingers:
                cpu, got, sent = await _run(url, lg, n, iv, args.messages, args.sink)
                per[lg] = (cpu - control) / n * 1e6
                print(f"  round {r + 1}  linger {lg:4.1f} ms: {per[lg]:6.1f} us/request "
                      f"(x{per[lg] / per[0.0]:.2f} of linger 0), {per_request * n / max(sent, 1):.1f} messages per "
                      f"NATS message, {got}/{per_request * n} received")
        if args.sink == "router":
            for r in range(args.rounds):
                alone = _apply_alone(n, args.messages)
                print(f"  apply alone, round {r + 1}: {sum(alone.values()):5.1f} us/request ("
                      + ", ".join(f"{k} {v:.1f}" for k, v in alone.items()) + ")")
    finally:
        nats.terminate()
        nats.wait(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-picks", type=int, default=2000)
    ap.add_argument("--interval-ms", type=float, default=0.5)
    ap.add_argument("--lingers-ms", default="0,1,2,5")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--messages", choices=("pick-release", "gateway"), default="pick-release")
    ap.add_argument("--sink", choices=("count", "router"), default="count")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="asyncio",
                    help="The event loop: asyncio's (the figures in bench-results/) or uvloop, which the router's "
                         "replicas run (extproc/server.py new_event_loop); uvloop's timers tick in whole "
                         "milliseconds, so give it --interval-ms 1 or more.")
    args = ap.parse_args()
    loop = new_event_loop(args.loop == "uvloop")
    try:
        loop.run_until_complete(_main(args))
    finally:
        loop.close()


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    main()
