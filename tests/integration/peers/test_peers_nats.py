"""Two replicas (PoolRouters) sharing state through a REAL nats-server on loopback (extproc/peers/bus.py):
they agree within a bounded delay; NATS killed: routing goes on, metrics say disconnected and dropped; NATS
back: they reconnect and share again; NATS down at start: the replica routes alone until it comes."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from helpers.peers import POST, chat, replica
from helpers.waiting import until_async
from prefixroute.extproc.peers import bus as bus_module
from prefixroute.extproc.peers.bus import PeerBus, PeersCollector
from prefixroute.extproc.peers.server import nats_server_argv, nats_url
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.procs import ManagedProcess, free_ports, tcp_open

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

AGREE_S = 1.0  # the bound the replicas must agree within (a loopback hop is well under a millisecond)


def _nats(port: int, tmp_path) -> ManagedProcess:
    p = ManagedProcess("nats-server", nats_server_argv(port), log_path=tmp_path / f"nats-{time.monotonic_ns()}.log",
                       ports=(port,), ready=lambda: tcp_open(port))
    p.spawn()
    p.wait_ready(10.0)
    return p


async def _subscribed(*buses: PeerBus) -> None:
    """Each bus's subscription has reached the server: a NATS flush is a PING answered after every message the
    client sent before it, SUB included (a condition, where a fixed sleep would only make it likely)."""
    for bus in buses:
        await bus._nc.flush()  # noqa: SLF001 - the bus exposes no flush of its own; tests only


def _metrics(bus: PeerBus) -> str:
    reg = CollectorRegistry()
    reg.register(PeersCollector(bus))
    return generate_latest(reg).decode()


async def _pair(url: str):
    routers, buses = [], []
    for name in ("r1", "r2"):
        r = replica(peers=lambda r: PeerBus(PeerSettings(url=url, replica_id=name, reconnect_wait_s=0.1), r,
                                            clock=r.clock))
        bus = r.peers
        await bus.start()
        routers.append(r)
        buses.append(bus)
    return routers, buses


async def test_two_replicas_share_through_nats_survive_its_death_and_reconnect(tmp_path):
    port = free_ports(1)[0]
    nats = _nats(port, tmp_path)
    (a, b), (bus_a, bus_b) = await _pair(nats_url(port))
    try:
        await until_async(lambda: bus_a.connected and bus_b.connected, 10.0)
        await _subscribed(bus_a, bus_b)
        pick = a.route(*POST, {}, chat("system " * 400, "doc one " * 300))
        ep = pick.endpoint_ids[0]
        t0 = time.monotonic()
        await until_async(lambda: b.core.learner.num_peer_picks() == 1, AGREE_S, interval_s=0.005)
        waited = time.monotonic() - t0
        assert b.pool.in_flight == {ep: 1}
        assert a.core.learner.num_peer_picks() == 0  # its own message is not applied to itself
        a.release(pick)
        await until_async(lambda: b.pool.in_flight == {} and b.core.learner.num_peer_picks() == 0, AGREE_S)
        print(f"agreed after {waited * 1000:.1f} ms")

        nats.kill()
        await until_async(lambda: not bus_a.connected and not bus_b.connected, 5.0)
        assert "prefixroute_peer_connected 0.0" in _metrics(bus_a)
        p2 = a.route(*POST, {}, chat("system " * 400, "doc two " * 300))  # routing goes on, alone
        a.release(p2)
        assert bus_a.num_dropped["pick"] >= 1 and bus_a.num_dropped["release"] >= 1
        assert 'prefixroute_peer_messages_total{direction="dropped",kind="pick"} 1.0' in _metrics(bus_a)
        await asyncio.sleep(0.3)  # lets time pass on purpose: nothing may arrive meanwhile
        assert b.core.learner.num_peer_picks() == 0  # nothing arrived

        nats = _nats(port, tmp_path)  # back on the same port
        await until_async(lambda: bus_a.connected and bus_b.connected, 10.0)
        await _subscribed(bus_a, bus_b)  # the resubscriptions reached the server
        p3 = a.route(*POST, {}, chat("system " * 400, "doc three " * 300))
        await until_async(lambda: b.core.learner.num_peer_picks() == 1, AGREE_S)
        assert b.pool.in_flight == {p3.endpoint_ids[0]: 1}
        assert "prefixroute_peer_connected 1.0" in _metrics(bus_b)
    finally:
        await bus_a.close()
        await bus_b.close()
        nats.stop()


async def test_nats_down_at_start_routes_alone_then_connects(tmp_path):
    port = free_ports(1)[0]
    (a, b), (bus_a, bus_b) = await _pair(nats_url(port))
    nats = None
    try:
        await asyncio.sleep(0.3)  # lets time pass on purpose: its connection attempts fail meanwhile
        assert not bus_a.connected
        pick = a.route(*POST, {}, chat("system " * 400, "doc " * 300))  # never blocks, never fails
        a.release(pick)
        assert bus_a.num_dropped["pick"] == 1
        nats = _nats(port, tmp_path)
        await until_async(lambda: bus_a.connected and bus_b.connected, 10.0)
        await _subscribed(bus_a, bus_b)
        a.route(*POST, {}, chat("system " * 400, "doc again " * 300))
        await until_async(lambda: b.core.learner.num_peer_picks() == 1, AGREE_S)
    finally:
        await bus_a.close()
        await bus_b.close()
        if nats is not None:
            nats.stop()


async def test_a_linger_sends_several_requests_in_one_nats_message_and_nothing_echoes(tmp_path, monkeypatch):
    """Picks made within --peers-linger-ms of each other travel in one NATS message (the receivers pay its
    per-message cost once), and the server does not send a replica its own batches back (no_echo)."""
    monkeypatch.setattr(bus_module, "EXPIRE_INTERVAL_S", 3600.0)  # no heartbeat batches in the counts
    port = free_ports(1)[0]
    nats = _nats(port, tmp_path)
    buses = []
    routers = []
    try:
        for name in ("r1", "r2"):
            r = replica(peers=lambda r, name=name: PeerBus(PeerSettings(url=nats_url(port), replica_id=name,
                                                                       linger_ms=100.0), r, clock=r.clock))
            bus = r.peers
            await bus.start()
            routers.append(r)
            buses.append(bus)
        a, b = routers
        bus_a, bus_b = buses
        await until_async(lambda: bus_a.connected and bus_b.connected, 10.0)
        await _subscribed(bus_a, bus_b)
        sent0, recv_b0, recv_a0 = bus_a.num_batches_sent, bus_b.num_batches_received, bus_a.num_batches_received
        for i in range(8):  # 8 requests over ~8 ticks, well within one linger
            a.route(*POST, {}, chat("system " * 50, f"doc {i} " * 50))
            await asyncio.sleep(0)
        await until_async(lambda: b.core.learner.num_peer_picks() == 8, AGREE_S, interval_s=0.005)
        assert bus_a.num_batches_sent - sent0 == 1, "8 picks within the linger: one NATS message"
        await bus_a._nc.flush()  # noqa: SLF001 - anything echoed would have arrived before the PONG
        assert bus_b.num_batches_received - recv_b0 == 1
        assert bus_a.num_batches_received - recv_a0 == 0, "the server echoed the replica's own batch"
        text = _metrics(bus_a)
        assert 'prefixroute_peer_batches_total{direction="sent"}' in text
    finally:
        for bus in buses:
            await bus.close()
        nats.stop()
