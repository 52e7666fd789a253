"""Prometheus text exposition of one engine with vLLM's metric names (rendered on scrape; pure).

Every sample carries ``model_name`` (the served model name) and ``engine="0"`` labels, like vLLM v1.
Counters are exposed as prometheus_client (so vLLM 0.33, tests/data/engines/) writes them: samples and the
``# HELP``/``# TYPE <name>_total counter`` lines with the ``_total`` suffix, so
``prometheus_client.parser.text_string_to_metric_families`` reads them as counters named without ``_total``.

The page ends with prometheus_client's standard process collector (``process_start_time_seconds``,
``process_resident_memory_bytes``, ``process_cpu_seconds_total`` ..., unlabelled), which real vLLM exposes
through the same library: a changed ``process_start_time_seconds`` tells a scraper the endpoint restarted
(its counters started again at 0 and its KV cache is empty).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from prefixroute.model_servers.engine import TTFT_BUCKETS_S, EngineCore

if TYPE_CHECKING:  # types only: the page reads their counters
    from prefixroute.model_servers.kv_events_publisher import ZmqEventPublisher
    from prefixroute.model_servers.response_store import ResponseStore
    from prefixroute.model_servers.runtime import AsyncEngine

_PROCESS = CollectorRegistry(auto_describe=False)
ProcessCollector(registry=_PROCESS)  # reads /proc/self on each scrape (~0.25 ms)


def _fmt(v: float) -> str:
    return repr(float(v))


class _Page:
    """The samples of one page, in order; every sample labelled like vLLM's (`labels`)."""

    __slots__ = ("labels", "out")

    def __init__(self, model_name: str) -> None:
        self.labels = f'engine="0",model_name="{model_name}"'
        self.out: list[str] = []

    def gauge(self, name: str, help_: str, value: float) -> None:
        self.out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name}{{{self.labels}}} {_fmt(value)}")

    def counter(self, name: str, help_: str, value: float, extra: str = "") -> None:
        self.out.append(f"# HELP {name}_total {help_}\n# TYPE {name}_total counter\n"
                        f"{name}_total{{{self.labels}{extra}}} {_fmt(value)}")


def render(core: EngineCore, *, model_name: str, server_id: str = "", num_http_requests_failed: int = 0,
           runner: AsyncEngine | None = None, slow_client_aborts: Mapping[str, int] | None = None,
           process: bool = True, kv_publisher: ZmqEventPublisher | None = None,
           responses_store: ResponseStore | None = None, max_model_len: int = 0, tp_degree: int = 1) -> str:
    """The /metrics page. `runner` adds real-time step-lag counters; `slow_client_aborts` (reason -> count) the
    backpressure aborts; `process` the process collector's gauges; `kv_publisher` the KV-event counters;
    `responses_store` the Responses API store's gauges and eviction counter. `max_model_len` (0: not known)
    and `tp_degree` size the CPU tier's ``vllm:kv_offload_config_info`` in tokens and bytes."""
    page = _Page(model_name)
    _engine_samples(page, core, slow_client_aborts, num_http_requests_failed)
    if core.tier is not None:
        _offload_samples(page, core)
    if kv_publisher is not None:
        _publisher_samples(page, kv_publisher)
    if responses_store is not None:
        _store_samples(page, responses_store)
    if runner is not None:
        _runner_samples(page, runner)
    _config_and_ttft(page, core, max_model_len, tp_degree)
    text = "\n".join(page.out) + "\n"
    if process:
        text += generate_latest(_PROCESS).decode()
    return text


def _engine_samples(page: _Page, core: EngineCore, slow_client_aborts: Mapping[str, int] | None,
                    num_http_requests_failed: int) -> None:
    """vLLM's scheduler, cache and request counters, then the server's own (aborts, failures, evictions)."""
    gauge, counter, lbl, out, st = page.gauge, page.counter, page.labels, page.out, core.stats
    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", core.num_running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", core.num_waiting)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.cache.usage_ratio)
    counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            st.prefix_cache_queries)
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            st.prefix_cache_hits)
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.num_preemptions)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
    counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
    out.append("# HELP vllm:request_success_total Count of successfully processed requests.\n"
               "# TYPE vllm:request_success_total counter\n"
               f'vllm:request_success_total{{{lbl},finished_reason="length"}} {_fmt(st.num_finished)}')
    counter("prefixroute:requests_aborted", "Requests dropped before finishing (client disconnect, or a client "
            "that did not read: see prefixroute:slow_client_aborts).", st.num_aborted)
    if slow_client_aborts is not None:
        name = "prefixroute:slow_client_aborts"
        out.append(f"# HELP {name}_total Connections reset because their client did not read (buffer_full: "
                   f"over max_stream_buffer_bytes buffered; stalled: write-paused for stall_timeout_s).\n"
                   f"# TYPE {name}_total counter\n" + "\n".join(
                       f'{name}_total{{{lbl},reason="{reason}"}} {_fmt(n)}'
                       for reason, n in slow_client_aborts.items()))
    counter("prefixroute:requests_failed", "Requests answered with an error (including injected faults).",
            num_http_requests_failed)
    counter("prefixroute:kv_block_evictions", "Cached KV blocks evicted to make room.", core.cache.num_evictions)
    counter("prefixroute:engine_busy_seconds", "Sum of modelled step durations.", st.busy_s)
    gauge("prefixroute:kv_cached_blocks", "KV blocks holding a prefix-cache hash (what a consumer of the KV "
          "events holds, once it has applied every published batch).", len(core.cache.cached))


def _offload_samples(page: _Page, core: EngineCore) -> None:
    """The CPU tier (vLLM 0.33's connector prefix-cache counters and offloading transfer counters, and the
    tier's occupancy under our own prefix)."""
    gauge, counter, st, tier = page.gauge, page.counter, core.stats, core.tier
    assert tier is not None
    counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
            "cache sharing, in terms of number of queried tokens.", st.external_prefix_cache_queries)
    counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
            "sharing, in terms of number of cached tokens.", st.external_prefix_cache_hits)
    counter("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.",
            tier.num_loaded_blocks * tier.bytes_per_block)
    counter("vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds.",
            st.kv_offload_load_s)
    counter("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.",
            tier.num_stored_blocks * tier.bytes_per_block)
    counter("vllm:kv_offload_store_time", "Total store time from GPU to offload storage, in seconds (stores "
            "overlap compute: modelled at the host-link rate).", tier.num_stored_blocks * tier.load_s_per_block)
    gauge("prefixroute:kv_offload_cpu_usage_perc", "CPU-tier usage (blocks held / capacity), 0-1.", tier.usage_ratio)
    gauge("prefixroute:kv_offload_cpu_blocks", "Blocks held in the CPU tier (what a consumer of the medium CPU "
          "KV events holds).", len(tier))


def _publisher_samples(page: _Page, pub: ZmqEventPublisher) -> None:
    """What the KV-event publisher sent and dropped."""
    counter = page.counter
    counter("prefixroute:kv_events_batches_published", "KV event batches (one per engine step that changed "
            "the cache) sent on the PUB socket.", pub.num_batches_published)
    counter("prefixroute:kv_events_published", "KV events (BlockStored, BlockRemoved, AllBlocksCleared) in "
            "the published batches.", pub.num_events_published)
    counter("prefixroute:kv_events_batches_dropped", "KV event batches dropped because the publisher queue "
            "was full (max_queue_size); subscribers see a sequence gap.", pub.num_batches_dropped)
    counter("prefixroute:kv_events_replay_requests", "Replay requests answered on the replay socket.",
            pub.num_replay_requests)


def _store_samples(page: _Page, rs: ResponseStore) -> None:
    """What the Responses API store holds and evicted."""
    gauge, counter = page.gauge, page.counter
    gauge("prefixroute:responses_stored", "Responses held in the in-process Responses API store (what "
          "previous_response_id and GET /v1/responses/{id} can find).", len(rs))
    gauge("prefixroute:responses_store_bytes", "JSON bytes held in the Responses API store "
          "(responses_store_max_bytes caps it).", rs.num_bytes)
    counter("prefixroute:responses_store_evictions", "Stored responses evicted (least recently used first) "
            "to stay under responses_store_max_entries / responses_store_max_bytes; their ids answer 404.",
            rs.num_evictions)


def _runner_samples(page: _Page, runner: AsyncEngine) -> None:
    """How late the real-time runner's steps ended."""
    gauge, counter = page.gauge, page.counter
    counter("prefixroute:engine_steps", "Engine steps run in real time.", runner.num_steps)
    counter("prefixroute:engine_step_lag_seconds", "Sum of how late steps ended versus their modelled end "
            "(the process keeping up shows as ~0).", runner.lag_sum_s)
    counter("prefixroute:engine_late_steps", "Steps that ended more than 5 ms late.", runner.num_late_steps)
    gauge("prefixroute:engine_step_lag_max_seconds", "Largest step lag so far.", runner.lag_max_s)


OFFLOAD_INFO_HELP = (
    "Static configuration of the KV offload managers of this engine instance. The configured offloading spec "
    "declares the label names, and each manager fills the values, so a series appears from the first scheduler "
    "step of its engine. A manager reports one series for each configuration it holds, and a label of its own "
    "tells the series apart. Each engine reports its own configuration, not the instance total.")
"""vLLM 0.33/0.34's help of ``vllm:kv_offload_config_info`` (offloading/metrics.py ``_INFO_METRIC_HELP``)."""
OFFLOAD_BLOCKS_PER_CHUNK = 1
"""GPU blocks per offloaded chunk: vLLM's default (offloading/config.py: ``blocks_per_chunk = 1`` unless
``kv_connector_extra_config`` sets ``blocks_per_chunk`` or ``block_size``); this tier stores single blocks."""
HOST_PAGE_BYTES = 4096
"""vLLM pads each chunk to ``SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT`` (``mmap.PAGESIZE``)."""


def offload_config_labels(num_cpu_blocks: int, kv_bytes_per_block: int, block_size: int,
                          max_model_len: int) -> str:
    """The labels vLLM's ``CPUOffloadingInfo.from_config`` gives a tier of `num_cpu_blocks` chunks of
    `OFFLOAD_BLOCKS_PER_CHUNK` block(s) of `kv_bytes_per_block` bytes (all TP ranks together), one KV-cache
    group, in prometheus_client's order (sorted; the page's own labels follow): ``cpu_kv_cache_size_tokens`` is
    ``"None"`` when `max_model_len` is not known (<= 0), as vLLM writes it."""
    chunk_bytes = -(-kv_bytes_per_block * OFFLOAD_BLOCKS_PER_CHUNK // HOST_PAGE_BYTES) * HOST_PAGE_BYTES
    tokens: int | None = None
    if max_model_len > 0:
        chunks_per_request = -(-max_model_len // (block_size * OFFLOAD_BLOCKS_PER_CHUNK))
        tokens = num_cpu_blocks * max_model_len // chunks_per_request
    return (f'cpu_blocks_per_chunk="{OFFLOAD_BLOCKS_PER_CHUNK}",'
            f'cpu_kv_cache_size_bytes="{num_cpu_blocks * chunk_bytes}",'
            f'cpu_kv_cache_size_tokens="{tokens}",cpu_num_chunks="{num_cpu_blocks}"')


def _config_and_ttft(page: _Page, core: EngineCore, max_model_len: int, tp_degree: int) -> None:
    """The cache configuration (info gauges: vLLM's GPU cache, and its offloading connector's CPU tier, exactly
    as vLLM 0.33/0.34 write them, tests/data/engines/) and the TTFT histogram."""
    lbl, out, st = page.labels, page.out, core.stats
    cfg = core.config
    out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
               "# TYPE vllm:cache_config_info gauge\n"
               f'vllm:cache_config_info{{block_size="{cfg.block_size}",enable_prefix_caching="True",'
               f'engine="0",num_gpu_blocks="{cfg.num_gpu_blocks}"}} 1.0')
    if cfg.num_cpu_blocks:
        info = offload_config_labels(cfg.num_cpu_blocks, cfg.cpu_bytes_per_block * tp_degree, cfg.block_size,
                                     max_model_len)
        out.append(f"# HELP vllm:kv_offload_config_info {OFFLOAD_INFO_HELP}\n"
                   "# TYPE vllm:kv_offload_config_info gauge\n"
                   f"vllm:kv_offload_config_info{{{info},{lbl}}} 1.0")
    name = "vllm:time_to_first_token_seconds"
    lines = [f"# HELP {name} Histogram of time to first token in seconds.", f"# TYPE {name} histogram"]
    cum = 0
    for b, c in zip(TTFT_BUCKETS_S, st.ttft_bucket_counts):
        cum += c
        lines.append(f'{name}_bucket{{{lbl},le="{b}"}} {_fmt(cum)}')
    lines.append(f'{name}_bucket{{{lbl},le="+Inf"}} {_fmt(st.ttft_count)}')
    lines.append(f"{name}_count{{{lbl}}} {_fmt(st.ttft_count)}")
    lines.append(f"{name}_sum{{{lbl}}} {_fmt(st.ttft_sum_s)}")
    out.append("\n".join(lines))
