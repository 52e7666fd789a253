"""Decision-time overhead of flow control when nothing is held: PoolRouter.route with and without FlowHold on an
idle simulated pool (admits_now reads every endpoint's load), 4 and 64 endpoints."""
import time, statistics, asyncio, orjson
from prefixroute.bench.sim_pool import SimulatedPool
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.factory import build_router
from prefixroute.extproc.flow.settings import FlowSettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.model_servers.virtual_fleet import VirtualFleet

def run(n, flow):
    fleet = VirtualFleet(num_servers=n)
    pool = SimulatedPool(fleet, PoolSettings(), seed=0)
    router = build_router(RoutingSettings(policy="prefix", rng_seed=0), pool, clock=lambda: fleet.now_s,
                          flow=FlowSettings() if flow else None, flow_tick_s=0.05, flow_stale_after_s=1.0)
    bodies = [orjson.dumps({"messages": [{"role": "system", "content": f"system {i % 50} " * 300},
                                         {"role": "user", "content": f"q{i}"}]}) for i in range(2000)]
    h = {"content-type": "application/json"}
    ts = []
    for b in bodies:
        t0 = time.perf_counter()
        pick = router.route("POST", "/v1/chat/completions", h, b, can_hold=True)
        ts.append(time.perf_counter() - t0)
        router.release(pick)
    ts = ts[200:]
    return statistics.median(ts) * 1e6, sorted(ts)[int(len(ts) * 0.99)] * 1e6

for n in (4, 64):
    for rep in range(2):
        a = run(n, False); b = run(n, True)
        print(f"{n} endpoints: route p50/p99 us without flow {a[0]:.1f}/{a[1]:.1f}, with flow (nothing held) {b[0]:.1f}/{b[1]:.1f}")
