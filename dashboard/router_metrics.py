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
    # the server's own prefix-cache counters (prompt tokens since it started): queried, found on the GPU, loaded
    # from its CPU tier (the hit ratio by tier)
    queried_tokens: float | None = None
    gpu_hit_tokens: float | None = None
    cpu_hit_tokens: float | None = None
    # the router's prediction by tier for the requests it routed there (since the router started): their prompt
    # tokens, and how many it predicted the GPU and the CPU tier would serve (lifecycle_listeners.py)
    predicted_prompt_tokens: float | None = None
    predicted_gpu_tokens: float | None = None
    predicted_cpu_tokens: float | None = None
    # conversations whose last turn went there, and the router's estimate of its recent prefill utilisation
    # (what the prefix policy prices a conversation's further turns at; routing/conversations.py)
    num_conversations: float | None = None
    prefill_utilization_ratio: float | None = None


_ROUTER_GAUGES = {  # gauge (telemetry/metrics.py) -> EndpointLive field
    "prefixroute_endpoint_kv_cache_usage_ratio": "kv_cache_usage_ratio",
    "prefixroute_endpoint_requests_running": "num_requests_running",
    "prefixroute_endpoint_requests_waiting": "num_requests_waiting",
    "prefixroute_endpoint_healthy": "healthy",
    "prefixroute_kv_events_connected": "kv_events_connected",
    "prefixroute_index_source_info": "index_source",  # the value is the `source` label
    "prefixroute_kv_events_state": "kv_events_state",  # the value is the `state` label
    "prefixroute_endpoint_prefix_cache_tokens": "prefix_cache",  # the `kind` label names the field
    "prefixroute_tier_predicted_prompt_tokens": "predicted_prompt_tokens",
    "prefixroute_predicted_tier_hit_tokens": "predicted_tier",  # the `tier` label names the field
    "prefixroute_conversations": "num_conversations",
    "prefixroute_endpoint_prefill_utilization_ratio": "prefill_utilization_ratio",
}
_PREDICTED_TIERS = {"gpu": "predicted_gpu_tokens", "cpu": "predicted_cpu_tokens"}
_CACHE_KINDS = {"queried": "queried_tokens", "gpu_hit": "gpu_hit_tokens", "cpu_hit": "cpu_hit_tokens"}
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
                if not name or sample.name.endswith("_created") or math.isnan(sample.value) or (
                        name not in found and len(found) >= MAX_LIVE_ENDPOINTS):
                    continue
                if field in ("prefix_cache", "predicted_tier"):
                    kind = (_CACHE_KINDS.get(sample.labels.get("kind", "")) if field == "prefix_cache"
                            else _PREDICTED_TIERS.get(sample.labels.get("tier", "")))
                    if kind is not None and sample.value >= 0:
                        found.setdefault(name, {})[kind] = sample.value
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


@dataclasses.dataclass(frozen=True)
class FlowLive:
    """The router's gateway queue now (flow control; its ``prefixroute_flow_*`` families): requests held
    per priority class and the flows (tenants or clients; the router names none) holding them, counts since the
    router started, the mean wait of held requests, and the saturation signal (>= 1: no endpoint had room at the
    last decision)."""

    queue: dict[str, float] = dataclasses.field(default_factory=dict)  # priority -> held now
    flows: dict[str, float] = dataclasses.field(default_factory=dict)  # priority -> flows holding them
    num_held_total: float = 0.0
    num_admitted_total: float = 0.0
    released: dict[str, float] = dataclasses.field(default_factory=dict)  # reason -> count
    shed: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)  # (reason, code) -> count
    num_dropped_total: float = 0.0
    wait_count: float = 0.0
    wait_sum_s: float = 0.0
    saturation: float | None = None

    @property
    def num_held(self) -> float:
        return sum(self.queue.values())

    @property
    def mean_wait_s(self) -> float | None:
        return self.wait_sum_s / self.wait_count if self.wait_count else None


def parse_flow_metrics(text: str) -> FlowLive | None:
    """The router's gateway queue from its Prometheus text; None when the router exports no flow family (flow
    control off, or a router older than it). A malformed text gives what was parsed before the bad line."""
    from prometheus_client.parser import text_string_to_metric_families

    seen = False
    f: dict[str, Any] = {"queue": {}, "flows": {}, "released": {}, "shed": {}}
    try:
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("prefixroute_flow_"):
                continue
            seen = True
            for s in fam.samples:
                if math.isnan(s.value):
                    continue
                name, labels = s.name, s.labels
                if name in ("prefixroute_flow_queue_length", "prefixroute_flow_queue_flows"):
                    by_class = f["queue" if name == "prefixroute_flow_queue_length" else "flows"]
                    if len(by_class) < MAX_LIVE_ENDPOINTS:
                        key = labels.get("priority", "")[:16]
                        by_class[key] = by_class.get(key, 0.0) + s.value
                elif name == "prefixroute_flow_released_total":
                    f["released"][labels.get("reason", "")[:32]] = s.value
                elif name == "prefixroute_flow_shed_total":
                    f["shed"][(labels.get("reason", "")[:32], labels.get("code", "")[:3])] = s.value
                elif name in _FLOW_SCALARS:
                    f[_FLOW_SCALARS[name]] = s.value
    except ValueError:
        pass
    return FlowLive(**f) if seen else None


_FLOW_SCALARS = {
    "prefixroute_flow_held_total": "num_held_total",
    "prefixroute_flow_admitted_total": "num_admitted_total",
    "prefixroute_flow_dropped_total": "num_dropped_total",
    "prefixroute_flow_wait_seconds_count": "wait_count",
    "prefixroute_flow_wait_seconds_sum": "wait_sum_s",
    "prefixroute_flow_saturation": "saturation",
}
