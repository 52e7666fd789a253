"""The KV-events plan's ports: free on this host, pairs never overlapping (the rest of its tests:
tests/unit/bench/test_bench_index_sources.py)."""

from __future__ import annotations

import json
import pytest
from prefixroute.bench.fleet import FleetConfig, KVEventsPlan, fleet_publishes_events, resolve_kv_events, start_fleet
from prefixroute.procs import free_ports

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test


def test_kv_events_plan_gives_each_server_a_pair_and_the_gateway_their_addresses():
    plan = KVEventsPlan.allocate(3)
    assert len(set(plan.pub_ports)) == 3
    used = {p for port in plan.pub_ports for p in (port, port + 1)}
    assert len(used) == 6  # pairs never overlap
    for k, port in enumerate(plan.pub_ports):
        flag, value = plan.server_args(k)
        assert flag == "--kv-events-config"
        assert json.loads(value) == {"enable_kv_cache_events": True, "publisher": "zmq",
                                     # loopback in the form real vLLM binds too (it connects to 127.0.0.1)
                                     "endpoint": f"tcp://[::ffff:127.0.0.1]:{port}",
                                     "replay_endpoint": f"tcp://[::ffff:127.0.0.1]:{port + 1}",
                                     # vLLM's default topic: the only one vllm-router 0.1.17's kv_aware receives
                                     "topic": ""}
    eps = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]
    assert plan.gateway_endpoints(eps) == [f"{e}@tcp://127.0.0.1:{p}" for e, p in zip(eps, plan.pub_ports)]
    # Later free ports never land on a replay port the plan reserved.
    assert not used & set(free_ports(200))
    with pytest.raises(ValueError):
        plan.gateway_endpoints(eps[:2])
