"""overhead-bench's replica projection (issue 26: what N replicas would route on a larger machine), from CPU per
request: the replicas' CPU grows by one pick's application per further replica; Envoy's stays."""

from __future__ import annotations

import pytest

from prefixroute.bench.overhead import project_replicas


@pytest.mark.parametrize("route_us, apply_us, envoy_us, n, replicas_us, rps_per_core, cores_at_1k", [
    (800.0, 200.0, 500.0, 1, 800.0, 1e6 / 1300, 1.3),
    (800.0, 200.0, 500.0, 2, 1000.0, 1e6 / 1500, 1.5),
    (800.0, 200.0, 500.0, 8, 2200.0, 1e6 / 2700, 2.7),
    (800.0, -30.0, 500.0, 4, 800.0, 1e6 / 1300, 1.3),  # a negative measurement is noise: no saving per replica
])
def test_projection_table(route_us, apply_us, envoy_us, n, replicas_us, rps_per_core, cores_at_1k):
    (p,) = project_replicas(route_us, apply_us, envoy_us, (n,))
    assert p.num_replicas == n
    assert p.replicas_us == pytest.approx(replicas_us)
    assert p.rps_per_core == pytest.approx(rps_per_core)
    assert p.cores_at_1k_rps == pytest.approx(cores_at_1k)
    assert p.rps_core_each == pytest.approx(n * 1e6 / replicas_us)
    assert p.envoy_cores == pytest.approx(p.rps_core_each * envoy_us / 1e6)


def test_more_replicas_never_route_more_per_core():
    ps = project_replicas(850.0, 120.0, 480.0)
    assert [p.num_replicas for p in ps] == [2, 4, 8]
    assert all(a.rps_per_core > b.rps_per_core for a, b in zip(ps, ps[1:]))
