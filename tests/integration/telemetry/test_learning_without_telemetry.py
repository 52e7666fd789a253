"""The router learns with telemetry off: `gateway --no-telemetry` exports no span, yet each response's facts
(first token, usage, served endpoint, Responses id) still reach the replica that routed it, so the time model
learns, the in-flight count drains and the queue of pending prefill empties, whichever routing filter runs."""

from __future__ import annotations

import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers.fleet import start_fleet, start_gateway
from helpers.gateway_requests import send
from helpers.waiting import until


pytestmark = pytest.mark.integration

OBSERVATIONS = "prefixroute_endpoint_ttft_observations_total{"
QUEUED = "prefixroute_endpoint_queued_prefill_tokens{"


def metric_samples(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, _, value in (ln.rpartition(" ") for ln in lines if ln and ln[0] != "#")}


def metric_total(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


@pytest.mark.parametrize("routing_filter", ["ext_proc", "ext_authz_http"])
def test_the_time_model_learns_with_telemetry_off(tmp_path: Path, routing_filter: str) -> None:
    with ExitStack() as stack:
        fleet = start_fleet(stack, 2, tmp_path)
        gw = start_gateway(stack, fleet.endpoints, tmp_path, telemetry=False, routing_filter=routing_filter)
        config = gw.config_path.read_text()  # type: ignore[union-attr]
        assert "prefixroute.facts" in config  # the facts path is rendered without telemetry
        before = metric_samples(gw.metrics_port)
        sent = [send(gw, f"learn {i} " + "delta epsilon zeta " * 60, stream=i % 2 == 0, max_tokens=4)
                for i in range(6)]
        assert all(s.status == 200 for s in sent), [s.status for s in sent]

        def learned() -> dict[str, float] | None:
            s = metric_samples(gw.metrics_port)
            done = metric_total(s, OBSERVATIONS) - metric_total(before, OBSERVATIONS) >= 3
            return s if done and metric_total(s, QUEUED) == 0 else None

        samples = until(learned, 10, message="3 first tokens learned and the prefill queue empty")
        # The streamed ones: a whole answer has no first token of its own.
        assert metric_total(samples, OBSERVATIONS) - metric_total(before, OBSERVATIONS) == 3
        assert metric_total(samples, "prefixroute_endpoint_in_flight{") == 0
        rates = [v for k, v in samples.items() if k.startswith("prefixroute_endpoint_prefill_tokens_per_second{")]
        assert rates and all(v > 0 for v in rates)
        # No span leaves the replica: its ready line says traces off.
        assert "traces off" in (tmp_path / "extproc.log").read_text()
