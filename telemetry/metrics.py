"""The router's Prometheus metrics (prometheus_client), cheap enough for every request.

Metric families (``prefixroute_`` prefix; seconds and tokens in base units as Prometheus prefers):

    prefixroute_decisions_total{endpoint,policy,reason}       counter  decisions (endpoint = primary, "none" if none)
    prefixroute_decision_duration_seconds                     histogram  time spent deciding
    prefixroute_requests_total{endpoint,status_class}         counter  finished requests (2xx..5xx, "reset")
    prefixroute_ttft_seconds{endpoint}                        histogram  gateway TTFT
    prefixroute_request_duration_seconds{endpoint}            histogram  gateway latency
    prefixroute_prompt_tokens_total{endpoint}                 counter  prompt tokens of requests with usage
    prefixroute_predicted_hit_tokens_total{endpoint}          counter  predicted_hit_ratio x prompt tokens
    prefixroute_actual_hit_tokens_total{endpoint}             counter  server-reported cached tokens
    prefixroute_ttft_prediction_error_ratio{endpoint}         histogram  (actual - predicted) / predicted TTFT
    prefixroute_predicted_ttft_seconds_total{endpoint}        counter  predicted TTFT of the same requests
    prefixroute_compared_ttft_seconds_total{endpoint}         counter  actual TTFT of the same requests
    prefixroute_endpoint_in_flight{endpoint}                  gauge    (callback) requests picked, not finished
    prefixroute_prefix_index_blocks[{endpoint}]               gauge    (callback) prefix index size
    prefixroute_endpoint_healthy{endpoint}                    gauge    (callback, pool snapshot) 1 routable, 0 down
    prefixroute_endpoint_requests_running{endpoint}           gauge    (callback, pool snapshot) scraped running
    prefixroute_endpoint_requests_waiting{endpoint}           gauge    (callback, pool snapshot) scraped waiting
    prefixroute_endpoint_kv_cache_usage_ratio{endpoint}       gauge    (callback, pool snapshot) scraped KV usage 0-1
    prefixroute_endpoint_scrape_age_seconds{endpoint}         gauge    (callback, pool snapshot) age of those figures
    prefixroute_endpoint_prefix_cache_tokens_total{endpoint,kind}  counter  (callback, pool snapshot) the server's
                                                              prompt tokens queried / gpu_hit / cpu_hit (by tier)
    prefixroute_endpoint_prefill_tokens_per_second{endpoint}  gauge    (callback, time model) learned prefill rate
    prefixroute_endpoint_base_ttft_seconds{endpoint}          gauge    (callback, time model) TTFT at zero work
    prefixroute_endpoint_queued_prefill_tokens{endpoint}      gauge    (callback, time model) prefill picked, no token
    prefixroute_endpoint_ttft_observations_total{endpoint}    counter  (callback, time model) responses learned from
    prefixroute_telemetry_spans_dropped_total{reason}         counter  (callback) every lost span, by reason
    prefixroute_telemetry_spans_exported_total                counter  (callback)
    prefixroute_telemetry_spans_pending                       gauge    (callback) queued + held for retry
    prefixroute_telemetry_retry_buffer_bytes                  gauge    (callback)

Status classes: a 4xx is a refusal (the client's request was refused), counted apart from 5xx and
"reset" (the errors) in prefixroute_requests_total{status_class}; nothing here lumps them together.

TTFT predictions (policies with a time model fill `Decision.predicted_ttft_ms`; others leave these empty):
a request is scored when the record is `RequestRecord.is_comparable_prediction` (a prediction and a
measured TTFT, not an error nor a refusal, served by the primary the prediction was for), under that
endpoint. The error ratio is ``(actual - predicted) / predicted`` (predicted floored at 1 ms): 0 is exact,
+1 means twice as slow as predicted, -0.5 twice as fast; signed so that under-prediction (the dangerous
side: the router believed an endpoint faster than it was) has the resolution. Alerts, e.g.::

    # one request in ten at least twice as slow as predicted, over 10 minutes
    histogram_quantile(0.9, sum by (le, endpoint) (rate(prefixroute_ttft_prediction_error_ratio_bucket[10m]))) > 1
    # systematic bias: the time model's TTFT off by more than 50 % on average
    rate(prefixroute_compared_ttft_seconds_total[10m]) / rate(prefixroute_predicted_ttft_seconds_total[10m]) > 1.5
    # share of predictions within +-25 %: (bucket{le="0.25"} - bucket{le="-0.25"}) / count

The histogram has no ``_sum`` (Prometheus exposes none for a histogram with negative buckets); the two
counters give the mean: predicted rate(prefixroute_predicted_ttft_seconds_total) / rate(..._count).

Hit ratio over a window in PromQL: ``rate(prefixroute_actual_hit_tokens_total[1m]) /
rate(prefixroute_prompt_tokens_total[1m])``.

Cost: the per-request series are telemetry/series.py's (prometheus_client's exposition, an attribute add or a
C bisect per call instead of its locked, Python-looped ones), and labelled children are cached in dicts, so a
request costs one dict lookup + inc/observe per metric. Thread safety: the event loop is the one writer; the
scrape thread reads (series.py); the child caches are plain dicts (benign races: at worst a child looked up
twice).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixroute.metrics_http import start_metrics_http_server
from prefixroute.types import Decision, EndpointState
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.series import FastCounter, FastHistogram

# Decisions take microseconds to a millisecond; requests' TTFT milliseconds to tens of seconds.
DECISION_BUCKETS_S = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3)
ROUTING_BUCKETS_S = (100e-6, 250e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0)
"""The routing delay: ~0.3-1.5 ms for a routed request on loopback; tens of ms and more for a body parsed in the
worker or a decision waiting on a response-id lookup."""
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Signed relative TTFT error: -1 (actual 0) .. +inf; finer near 0, where a good time model lives.
PREDICTION_ERROR_BUCKETS = (-0.75, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 9.0)
LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RecorderCounts(Protocol):
    """What the metrics read of the span recorder (`recorder.TelemetryRecorder`): its counts, read on scrape."""

    @property
    def dropped_by_reason(self) -> Mapping[str, int]: ...

    @property
    def num_exported(self) -> int: ...

    @property
    def num_pending(self) -> int: ...

    @property
    def retry_bytes(self) -> int: ...


def _status_class(status: int) -> str:
    return "reset" if status <= 0 else f"{status // 100}xx"


class _CallbackCollector:
    def __init__(self, metrics: RouterMetrics) -> None:
        self.m = metrics

    def describe(self) -> list:
        return []  # the families depend on callbacks; describing them would call those at registration

    def collect(self):  # noqa: ANN201
        m = self.m
        if m.in_flight is not None:
            g = GaugeMetricFamily("prefixroute_endpoint_in_flight", "Requests picked and not yet finished, "
                                  "per endpoint (router's own count).", labels=["endpoint"])
            for ep, n in dict(m.in_flight()).items():
                g.add_metric([str(ep)], n)
            yield g
        if m.index_size is not None:
            size = m.index_size()
            if isinstance(size, Mapping):
                g = GaugeMetricFamily("prefixroute_prefix_index_blocks", "Blocks the prefix index holds per endpoint (the router's own index, or for endpoints matched by KV events the blocks their events say they hold).",
                                      labels=["endpoint"])
                for ep, n in size.items():
                    g.add_metric([str(ep)], n)
            else:
                g = GaugeMetricFamily("prefixroute_prefix_index_blocks", "Blocks the prefix index holds per endpoint (the router's own index, or for endpoints matched by KV events the blocks their events say they hold).",
                                      value=size)
            yield g
        if m.endpoint_states is not None:
            yield from _endpoint_families(m.endpoint_states())
        if m.time_model is not None:
            yield from _time_model_families(m.time_model())
        if m.index_info is not None:
            yield from _index_families(m.index_info())
        if m.recorder is not None:
            rec = m.recorder
            dropped = CounterMetricFamily(
                "prefixroute_telemetry_spans_dropped", "Request spans lost by the telemetry recorder, by reason: "
                "queue_full, disabled, shutdown, retry_buffer_full (receiver down too long), rejected (e.g. "
                "UNAUTHENTICATED), receiver_rejected (partial success), too_large, malformed, export_failed.",
                labels=["reason"])
            for reason, n in dict(rec.dropped_by_reason).items():
                dropped.add_metric([reason], n)
            yield dropped
            yield CounterMetricFamily("prefixroute_telemetry_spans_exported", "Request spans the OTLP exporter "
                                      "acknowledged.", value=rec.num_exported)
            yield GaugeMetricFamily("prefixroute_telemetry_spans_pending", "Request spans recorded and not yet "
                                    "exported (queue + retry buffer).", value=rec.num_pending)
            yield GaugeMetricFamily("prefixroute_telemetry_retry_buffer_bytes", "Encoded spans held for "
                                    "re-export while the OTLP backend is unavailable.", value=rec.retry_bytes)


def _endpoint_families(states: Iterable[EndpointState]) -> Iterator[GaugeMetricFamily]:
    """The endpoint pool's current figures, one sample per configured endpoint (a figure the endpoint
    does not export is absent). These are the dashboard's live columns: it reads them here, from the
    router, and never opens a URL of its own choosing."""
    healthy = GaugeMetricFamily("prefixroute_endpoint_healthy", "1 when the endpoint is routable (probes "
                                "pass, or the pool's panic mode routes it: prefixroute_endpoint_panic_routed), "
                                "else 0.", labels=["endpoint"])
    running = GaugeMetricFamily("prefixroute_endpoint_requests_running", "Requests running on the endpoint "
                                "(scraped: vllm:num_requests_running / sglang:num_running_reqs).", labels=["endpoint"])
    waiting = GaugeMetricFamily("prefixroute_endpoint_requests_waiting", "Requests waiting on the endpoint "
                                "(scraped: vllm:num_requests_waiting / sglang:num_queue_reqs).", labels=["endpoint"])
    kv = GaugeMetricFamily("prefixroute_endpoint_kv_cache_usage_ratio", "KV-cache usage of the endpoint, 0-1 "
                           "(scraped: vllm:kv_cache_usage_perc / sglang:token_usage).", labels=["endpoint"])
    age = GaugeMetricFamily("prefixroute_endpoint_scrape_age_seconds", "Age of the endpoint's scraped figures.",
                            labels=["endpoint"])
    cache = CounterMetricFamily("prefixroute_endpoint_prefix_cache_tokens", "The endpoint's own prefix-cache "
                                "counters as last scraped: prompt tokens queried, found on the GPU (gpu_hit), loaded "
                                "from its CPU tier (cpu_hit; vllm:prefix_cache_queries / _hits, "
                                "vllm:external_prefix_cache_hits): its hit ratio by tier.", labels=["endpoint", "kind"])
    now = time.monotonic()
    for st in states:
        ep = [str(st.endpoint)]
        healthy.add_metric(ep, 1.0 if st.healthy else 0.0)
        if st.num_requests_running is not None:
            running.add_metric(ep, st.num_requests_running)
        if st.num_requests_waiting is not None:
            waiting.add_metric(ep, st.num_requests_waiting)
        if st.kv_cache_usage_ratio is not None:
            kv.add_metric(ep, st.kv_cache_usage_ratio)
        if st.scraped_at_s is not None:
            age.add_metric(ep, max(0.0, now - st.scraped_at_s))
        if st.prefix_cache_tokens is not None:
            for kind, v in zip(("queried", "gpu_hit", "cpu_hit"), st.prefix_cache_tokens):
                cache.add_metric([*ep, kind], v)
    yield from (healthy, running, waiting, kv, age, cache)


def _time_model_families(figures: Mapping[str, tuple[float, float, float, int]]) -> Iterator[Any]:
    """The prefix policy's time model per endpoint (`PrefixPolicy.time_model_figures`): what its predicted
    TTFTs are made of, so an operator can see an endpoint learned as slow or a queue that does not drain."""
    rate = GaugeMetricFamily("prefixroute_endpoint_prefill_tokens_per_second", "Prefill rate the time model "
                             "learned for the endpoint (the prior until responses taught it).", labels=["endpoint"])
    base = GaugeMetricFamily("prefixroute_endpoint_base_ttft_seconds", "TTFT the time model predicts at zero "
                             "queued work on the endpoint.", labels=["endpoint"])
    queued = GaugeMetricFamily("prefixroute_endpoint_queued_prefill_tokens", "Uncached prefill tokens of requests "
                               "picked for the endpoint and not yet past their first token (router's estimate).",
                               labels=["endpoint"])
    learned = CounterMetricFamily("prefixroute_endpoint_ttft_observations", "Responses (first token + usage) the "
                                  "time model learned the endpoint's rate from.", labels=["endpoint"])
    for ep, (r, b, q, n) in figures.items():
        lab = [str(ep)]
        rate.add_metric(lab, r)
        base.add_metric(lab, b)
        queued.add_metric(lab, q)
        learned.add_metric(lab, n)
    yield from (rate, base, queued, learned)


KV_EVENT_STATS: tuple[tuple[str, str, str], ...] = (
    # (key in the subscriber's per-endpoint stats, metric name, help); counters end in _total on the wire.
    ("connected", "prefixroute_kv_events_connected", "1 while the router's KV-event subscriber for the endpoint "
     "receives (or last received within its silence limit), else 0."),
    ("num_batches", "prefixroute_kv_events_batches", "KV-event batches applied to the index."),
    ("num_events", "prefixroute_kv_events", "KV events (BlockStored/BlockRemoved/AllBlocksCleared) applied."),
    ("num_gaps", "prefixroute_kv_events_gaps", "Sequence gaps seen (messages lost between publisher and router)."),
    ("num_replays", "prefixroute_kv_events_replays", "Replay requests sent to the publisher's replay socket "
     "(subscribing, reconnects, gaps)."),
    ("num_clears", "prefixroute_kv_events_index_clears", "Times the endpoint's events index was cleared: "
     "AllBlocksCleared, a publisher restart, or a gap replay could not fill."),
    ("num_decode_errors", "prefixroute_kv_events_decode_errors", "Event messages that did not decode (dropped)."),
    ("num_unknown_events", "prefixroute_kv_events_unknown_events", "Events of a type no engine release defines "
     "(skipped; the rest of their batch applied)."),
    ("last_seq", "prefixroute_kv_events_last_sequence", "Last sequence number applied."),
    ("tokens_verified", "prefixroute_kv_events_tokens_verified", "1 once a request routed to the endpoint found its "
     "first token block among the blocks its events stored (the server tokenizes as the router does), else 0."),
    ("blocks", "prefixroute_kv_event_index_blocks", "Blocks the endpoint's KV events say it holds (the events "
     "index)."),
    ("cpu_blocks", "prefixroute_kv_event_index_cpu_blocks", "Blocks the endpoint's KV events say its host-memory "
     "(CPU) tier holds: vLLM's native KV offloading (the tier-aware events index)."),
    ("server_block_tokens", "prefixroute_kv_events_block_tokens", "Tokens per KV block of the endpoint's latest GPU "
     "store with tokens, as the server published it (vLLM 0.34's default: 64). A multiple of --kv-block-tokens is "
     "split into the router's blocks; any other size is block_size_mismatch."),
)


def _index_families(info: Mapping[str, Mapping[str, Any]]) -> Iterator[Any]:
    """Per endpoint: the index source in use (``prefixroute_index_source_info{endpoint, source} 1``), and for
    endpoints that publish KV events the subscriber's figures (`KV_EVENT_STATS`)."""
    source = GaugeMetricFamily("prefixroute_index_source_info", "Where the prefix index learns what the endpoint "
                               "holds: events (its KV events), feedback (the router's picks corrected by cached "
                               "tokens), approximate (the router's picks), none.", labels=["endpoint", "source"])
    state = GaugeMetricFamily("prefixroute_kv_events_state", "1 for the state of the endpoint's KV events: live "
                              "(matched by them), syncing, down, undecodable, block_size_mismatch, token_mismatch, "
                              "unhealthy (the endpoint fails its health probes) (all but live: matched by the "
                              "router's own index, feedback).",
                              labels=["endpoint", "state"])
    media = CounterMetricFamily("prefixroute_kv_events_other_media_blocks", "Blocks the endpoint's KV events "
                                "stored or removed on a medium other than the GPU (CPU offload, disk; the CPU "
                                "tier is indexed too: prefixroute_kv_event_index_cpu_blocks).",
                                labels=["endpoint", "medium", "event"])
    fams: dict[str, Any] = {}
    for key, name, help_ in KV_EVENT_STATS:
        cls = GaugeMetricFamily if key in ("connected", "last_seq", "blocks", "cpu_blocks", "tokens_verified",
                                           "server_block_tokens") else CounterMetricFamily
        fams[key] = cls(name, help_, labels=["endpoint"])
    for ep, d in info.items():
        source.add_metric([str(ep), str(d.get("source", ""))], 1.0)
        if d.get("events_state"):
            state.add_metric([str(ep), str(d["events_state"])], 1.0)
        for event, key in (("stored", "stored_blocks_by_medium"), ("removed", "removed_blocks_by_medium")):
            for medium, n in (d.get(key) or {}).items():  # type: ignore[union-attr]
                media.add_metric([str(ep), str(medium), event], float(n))
        for key, fam in fams.items():
            v = d.get(key)
            if v is not None:
                fam.add_metric([str(ep)], float(v))
    yield source
    yield state
    yield media
    yield from fams.values()


class RouterMetrics:
    """The router's metrics in their own registry (so tests and several routers in one process do not clash).

    `in_flight`: callable -> Mapping[endpoint, int]; `index_size`: callable -> int or Mapping[endpoint, int];
    `endpoint_states`: callable -> the endpoint pool's current snapshot (iterable of
    `routing.types.EndpointState`; the pool's `snapshot` is an O(1) read of an immutable tuple, safe from
    the metrics thread); `time_model`: callable -> {endpoint: (rate, base_s, queued tokens, observations)}
    (`PrefixPolicy.time_model_figures`, thread-safe); `index_info`: callable -> {endpoint: {"source": str, and
    for KV-event endpoints the `KV_EVENT_STATS` keys}} (thread-safe copies); `recorder`: a TelemetryRecorder whose drop/export counts are exposed. Callbacks
    run on scrape only.
    """

    def __init__(self, *, registry: CollectorRegistry | None = None,
                 in_flight: Callable[[], Mapping[str, int]] | None = None,
                 index_size: Callable[[], int | Mapping[str, int]] | None = None,
                 endpoint_states: Callable[[], Iterable[EndpointState]] | None = None,
                 recorder: RecorderCounts | None = None,
                 time_model: Callable[[], Mapping[str, tuple[float, float, float, int]]] | None = None,
                 index_info: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.in_flight, self.index_size, self.recorder = in_flight, index_size, recorder
        self.endpoint_states = endpoint_states
        self.time_model = time_model
        self.index_info = index_info
        r = self.registry
        self.decisions = FastCounter(
            "prefixroute_decisions", "Routing decisions by primary endpoint, policy, reason.",
            ["endpoint", "policy", "reason"], registry=r)
        self.decision_duration = FastHistogram(
            "prefixroute_decision_duration_seconds", "Time spent deciding.", buckets=DECISION_BUCKETS_S, registry=r)
        self.routing_delay = FastHistogram(
            "prefixroute_routing_delay_seconds", "Envoy's time from a request's last byte received to its first "
            "byte sent upstream (DS_RX_END to US_TX_BEG, Envoy's clock, from the facts record): what routing added "
            "to the request, for requests never held in the gateway queue.", buckets=ROUTING_BUCKETS_S, registry=r)
        self.requests = FastCounter(
            "prefixroute_requests", "Finished requests by served endpoint and status class.",
            ["endpoint", "status_class"], registry=r)
        self.ttft = FastHistogram(
            "prefixroute_ttft_seconds", "Gateway time to first token (arrival to first body byte).", ["endpoint"],
            buckets=TTFT_BUCKETS_S, registry=r)
        self.latency = FastHistogram(
            "prefixroute_request_duration_seconds", "Gateway request latency.", ["endpoint"],
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = FastCounter(
            "prefixroute_prompt_tokens", "Prompt tokens of requests that reported usage.", ["endpoint"], registry=r)
        self.predicted_hit_tokens = FastCounter(
            "prefixroute_predicted_hit_tokens", "Prompt tokens the router predicted cached (predicted_hit_ratio x "
            "prompt tokens).", ["endpoint"], registry=r)
        self.actual_hit_tokens = FastCounter(
            "prefixroute_actual_hit_tokens", "Prompt tokens the model server reported cached (usage cached_tokens).",
            ["endpoint"], registry=r)
        self.prediction_error = FastHistogram(
            "prefixroute_ttft_prediction_error_ratio", "TTFT prediction error of the primary, (actual - predicted) "
            "/ predicted (predicted floored at 1 ms), for successful requests the primary served.", ["endpoint"],
            buckets=PREDICTION_ERROR_BUCKETS, registry=r)
        self.predicted_ttft = FastCounter(
            "prefixroute_predicted_ttft_seconds", "Predicted TTFT summed over the requests scored in "
            "prefixroute_ttft_prediction_error_ratio.", ["endpoint"], registry=r)
        self.compared_ttft = FastCounter(
            "prefixroute_compared_ttft_seconds", "Measured TTFT summed over the requests scored in "
            "prefixroute_ttft_prediction_error_ratio.", ["endpoint"], registry=r)
        r.register(_CallbackCollector(self))
        self._decision_children: dict[tuple[str, str, str], Any] = {}
        self._endpoint_children: dict[str, tuple[Any, ...]] = {}
        self._request_children: dict[tuple[str, str], Any] = {}
        self._prediction_children: dict[str, tuple[Any, Any, Any]] = {}

    def observe_decision(self, decision: Decision, decision_us: float) -> None:
        """Count one decision (call when the decision is made, so requests that never finish count too)."""
        key = (decision.endpoints[0] if decision.endpoints else "none", decision.policy, decision.reason)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self.decisions.labels(*key)
        child.inc()
        self.decision_duration.observe(decision_us / 1e6)

    def observe_response(self, rec: RequestRecord) -> None:
        """Account one finished request: status, TTFT, latency, prompt / predicted / actual hit tokens, and
        the TTFT prediction's error when the record has a comparable one."""
        ep = rec.endpoint or "none"
        children = self._endpoint_children.get(ep)
        if children is None:
            children = self._endpoint_children[ep] = (
                self.ttft.labels(ep), self.latency.labels(ep), self.prompt_tokens.labels(ep),
                self.predicted_hit_tokens.labels(ep), self.actual_hit_tokens.labels(ep))
        ttft, latency, prompt, predicted, actual = children
        key = (ep, _status_class(rec.status))
        req = self._request_children.get(key)
        if req is None:
            req = self._request_children[key] = self.requests.labels(*key)
        req.inc()
        if rec.ttft_ms is not None:
            ttft.observe(rec.ttft_ms / 1000.0)
        if rec.latency_ms is not None:
            latency.observe(rec.latency_ms / 1000.0)
        if rec.routing_ms is not None and rec.gateway_outcome is None:  # a held request's wait is the queue's
            self.routing_delay.observe(rec.routing_ms / 1000.0)
        if rec.prompt_tokens and rec.cached_tokens is not None:
            prompt.inc(rec.prompt_tokens)
            predicted.inc(rec.predicted_hit_ratio * rec.prompt_tokens)
            actual.inc(rec.cached_tokens)
        if rec.is_comparable_prediction:
            self._observe_prediction(ep, rec.predicted_ttft_ms, rec.ttft_ms)

    def _observe_prediction(self, ep: str, predicted_ms: float, actual_ms: float) -> None:
        children = self._prediction_children.get(ep)
        if children is None:
            children = self._prediction_children[ep] = (
                self.prediction_error.labels(ep), self.predicted_ttft.labels(ep), self.compared_ttft.labels(ep))
        error, predicted, compared = children
        error.observe((actual_ms - predicted_ms) / max(predicted_ms, 1.0))
        if predicted_ms > 0:  # a counter never decreases: a negative prediction (a model bug) is not summed
            predicted.inc(predicted_ms / 1000.0)
        if actual_ms > 0:
            compared.inc(actual_ms / 1000.0)


def start_metrics_server(metrics: RouterMetrics, port: int, host: str = "127.0.0.1") -> Any:
    """Serve /metrics for `metrics.registry` on a daemon thread, within the bounds of metrics_http.py (connections,
    sizes, time, renderings); returns the server (``server.server_address[1]`` is the bound port when `port` is 0;
    ``server.shutdown()`` stops it)."""
    return start_metrics_http_server(make_wsgi_app(metrics.registry), port, host)
