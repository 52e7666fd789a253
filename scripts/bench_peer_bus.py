#!/usr/bin/env python3
"""The pick bus's own CPU per request, by linger (extproc/peers/bus.py, --peers-linger-ms).

    .venv/bin/python scripts/bench_peer_bus.py --num-picks 2000 --lingers-ms 0,1,2,5 --rounds 2

Starts a real nats-server on loopback and two `PeerBus` replicas in this process (one event loop): replica a
publishes, per simulated request, a pick of 64 block hashes (a 4 KB prompt) and its release, one request every
``--interval-ms`` (plus the loop's own time), signed with a bus key as the gateway runs it; replica b receives and
counts. Process CPU (user + system, `time.process_time`) over the run, less a control run of the same loop without
the bus, divided by the requests: the bus's CPU per request, sender, NATS client and receiver together (the
nats-server process is not counted). Lingers are measured in rounds, alternating, and printed with their ratio
to linger 0 in the same round (this machine is noisy: compare within a round)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import time

from prefixroute.extproc.peers import codec
from prefixroute.extproc.peers.bus import PeerBus
from prefixroute.extproc.peers.server import nats_server_argv, nats_url
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.procs import free_port, tcp_open


class _Sink:
    def __init__(self) -> None:
        self.num_messages = 0

    def apply_peer_batch(self, origin, messages, now_s) -> None:  # noqa: ANN001
        self.num_messages += len(messages)

    def expire_peers(self, now_s: float) -> None:
        pass


async def _run(url: str, linger_ms: float | None, num_picks: int, interval_s: float) -> tuple[float, int, int]:
    """(CPU seconds, messages received, NATS messages sent) of one run; linger None: the control (no bus)."""
    sink = _Sink()
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
    hashes = [random.getrandbits(64) for _ in range(64)]
    c0 = time.process_time()
    for i in range(num_picks):
        if buses:
            buses[0].publish(codec.Pick(i, "10.0.0.1:8000", hashes, 100.0))
            buses[0].publish(codec.Release(i))
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
        print(f"bench_peer_bus: {n} requests (pick of 64 hashes + release) every {args.interval_ms} ms, "
              f"{args.rounds} rounds; CPU per request over a control loop without the bus")
        for r in range(args.rounds):
            control = (await _run(url, None, n, iv))[0]
            per: dict[float, float] = {}
            for lg in lingers:
                cpu, got, sent = await _run(url, lg, n, iv)
                per[lg] = (cpu - control) / n * 1e6
                print(f"  round {r + 1}  linger {lg:4.1f} ms: {per[lg]:6.1f} us/request "
                      f"(x{per[lg] / per[0.0]:.2f} of linger 0), {2 * n / max(sent, 1):.1f} messages per NATS "
                      f"message, {got}/{2 * n} received")
    finally:
        nats.terminate()
        nats.wait(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-picks", type=int, default=2000)
    ap.add_argument("--interval-ms", type=float, default=0.5)
    ap.add_argument("--lingers-ms", default="0,1,2,5")
    ap.add_argument("--rounds", type=int, default=2)
    asyncio.run(_main(ap.parse_args()))


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    main()
