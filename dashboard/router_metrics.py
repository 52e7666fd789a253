"""The router's own Prometheus text read for the dashboard's live columns: `parse_router_metrics` gives each
endpoint's `EndpointLive` figures (its ``prefixroute_endpoint_*{endpoint}`` gauges, fed by the endpoint pool's
snapshot; telemetry/metrics.py writes them)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class EndpointLive:
    """Live figures of one endpoint, as the router's pool last saw them (None = not known)."""

    kv_cache_usage_ratio: float | None = None
    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    healthy: bool | None = None
    index_source: str | None = None  # where the router's prefix index learns this endpoint (events, feedback, ...)
    kv_events_connected: bool | None = None  # for an events endpoint: its subscriber receives
    kv_events_state: str | None = None  # for an events endpoint: live, syncing, down, undecodable, ... (link.py)



_ROUTER_GAUGES = {  # gauge (telemetry/metrics.py) -> EndpointLive field
    "prefixroute_endpoint_kv_cache_usage_ratio": "kv_cache_usage_ratio",
    "prefixroute_endpoint_requests_running": "num_requests_running",
    "prefixroute_endpoint_requests_waiting": "num_requests_waiting",
    "prefixroute_endpoint_healthy": "healthy",
    "prefixroute_kv_events_connected": "kv_events_connected",
    "prefixroute_index_source_info": "index_source",  # the value is the `source` label
    "prefixroute_kv_events_state": "kv_events_state",  # the value is the `state` label
}
MAX_LIVE_ENDPOINTS = 1024  # a fleet's worth; bounds what an odd metrics text can make the page draw


def parse_router_metrics(text: str) -> dict[str, EndpointLive]:
    """Endpoint -> live figures from the router's Prometheus text (its ``prefixroute_endpoint_*{endpoint}``
    gauges, fed by the endpoint pool's snapshot). Other families are ignored; a malformed text gives
    what was parsed before the bad line."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, Any]] = {}
    try:
        for fam in text_string_to_metric_families(text):
            field = _ROUTER_GAUGES.get(fam.name)
            if field is None:
                continue
            for sample in fam.samples:
                name = sample.labels.get("endpoint")
                if not name or math.isnan(sample.value) or (name not in found and len(found) >= MAX_LIVE_ENDPOINTS):
                    continue
                if field in ("index_source", "kv_events_state"):
                    label = "source" if field == "index_source" else "state"
                    if sample.value >= 0.5:
                        found.setdefault(name, {})[field] = str(sample.labels.get(label, ""))[:32]
                    continue
                found.setdefault(name, {})[field] = (sample.value >= 0.5) if field in (
                    "healthy", "kv_events_connected") else sample.value
    except ValueError:  # the parser's answer to a malformed line
        pass
    return {name: EndpointLive(**fields) for name, fields in found.items()}
