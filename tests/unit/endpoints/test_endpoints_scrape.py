"""Pure parsing for the endpoint pool: Prometheus text, /v1/models, endpoint specs (endpoints/scrape.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from prefixroute.extproc.endpoints.scrape import (ScrapedMetrics, parse_endpoint, parse_endpoint_list, parse_metrics,
                                          parse_models, read_endpoints_file)


def vllm_exposition(running=3, waiting=2, kv=0.25, blocks=1000, block_size=16, engines=("0",)) -> bytes:
    """Real Prometheus text from prometheus_client, shaped like vLLM's (labels, histograms, HELP/TYPE lines)."""
    reg = CollectorRegistry()
    r = Gauge("vllm:num_requests_running", "running", ["model_name", "engine"], registry=reg)
    w = Gauge("vllm:num_requests_waiting", "waiting", ["model_name", "engine"], registry=reg)
    k = Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name", "engine"], registry=reg)
    c = Gauge("vllm:cache_config_info", "cache config", ["block_size", "num_gpu_blocks", "engine"], registry=reg)
    h = Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name"], registry=reg,
                  buckets=[0.001 * 2**i for i in range(20)])
    for e in engines:
        r.labels("m", e).set(running)
        w.labels("m", e).set(waiting)
        k.labels("m", e).set(kv)
        c.labels(str(block_size), str(blocks), e).set(1)
    for i in range(50):
        h.labels("m").observe(0.01 * i)
    # a look-alike name that must not be mistaken for the gauge
    Gauge("vllm:num_requests_running_total_fake", "decoy", registry=reg).set(99)
    return generate_latest(reg)


@pytest.mark.parametrize("data,expected", [
    (vllm_exposition(), ScrapedMetrics(3, 2, 0.25, 1000, 16)),
    (vllm_exposition(engines=("0", "1")), ScrapedMetrics(6, 4, 0.25, 2000, 16)),  # data parallel: counts add
    (b"sglang:num_running_reqs 5\nsglang:num_queue_reqs 7\nsglang:token_usage 0.5\n", ScrapedMetrics(5, 7, 0.5)),
    (b'sglang:num_running_reqs{model_name="m"} 5.0\nsglang:num_queue_reqs{model_name="m"} 0.0\n',
     ScrapedMetrics(5, 0, None)),
    (b"vllm:gpu_cache_usage_perc 0.75\n", ScrapedMetrics(kv_cache_usage_ratio=0.75)),  # older vLLM name
    (b"vllm:num_requests_waiting NaN\n", ScrapedMetrics()),
    (b"vllm:kv_cache_usage_perc 1.7\n", ScrapedMetrics(kv_cache_usage_ratio=1.0)),
    (b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n", ScrapedMetrics()),
    (b"garbage\n\x00\xff{{{ 1 2 3\nvllm:num_requests_running{ broken\n", ScrapedMetrics()),
    (b'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n', ScrapedMetrics()),
    (b"", ScrapedMetrics()),
])
def test_parse_metrics(data, expected):
    assert parse_metrics(data) == expected


@pytest.mark.parametrize("body,expected", [
    (b'{"object":"list","data":[{"id":"m","object":"model"},{"id":"lora-a","parent":"m"}]}',
     frozenset({"m", "lora-a"})),
    (b'{"data":[]}', frozenset()),
    (b'{"data":[{"id":5},"x",{"id":"ok"}]}', frozenset({"ok"})),
])
def test_parse_models(body, expected):
    assert parse_models(body) == expected


@pytest.mark.parametrize("body", [b"nope", b"[]", b'{"data": 3}'])
def test_parse_models_rejects_bad_bodies(body):
    with pytest.raises(ValueError):
        parse_models(body)


@pytest.mark.parametrize("spec,expected", [
    ("127.0.0.1:8000", "127.0.0.1:8000"), (" localhost:80 ", "localhost:80"), ("[::1]:9000", "[::1]:9000"),
    ("gpu-3.cluster.local:08000", "gpu-3.cluster.local:8000"),
])
def test_parse_endpoint(spec, expected):
    assert parse_endpoint(spec) == expected


@pytest.mark.parametrize("spec,fragment", [
    ("127.0.0.1", "not host:port"), ("http://a:80", "scheme"), ("a:0", "port"), ("a:70000", "port"),
    ("a:x", "port"), (":80", "not host:port"), ("a b:80", "not a valid host"), ("a:80/v1", "scheme or path"),
])
def test_parse_endpoint_errors(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_endpoint(spec)


def test_duplicates_are_an_error():
    with pytest.raises(ValueError, match="twice"):
        parse_endpoint_list(["a:1", "b:1", "a:01"])


@pytest.mark.parametrize("text", [
    "a:1\nb:2\n", "# fleet\na:1  # first\n\nb:2", '["a:1", "b:2"]', "- a:1\n- 'b:2'\n", "[a:1, b:2]",
])
def test_endpoints_file_formats(text):
    assert parse_endpoint_list(read_endpoints_file(text)) == ("a:1", "b:2")


def test_endpoints_file_rejects_non_strings():
    with pytest.raises(ValueError):
        read_endpoints_file("[1, 2]")


# --- restart detection (issue 11, finding 10) -----------------------------------------------------------------
from prometheus_client import Counter, ProcessCollector  # noqa: E402

from prefixroute.extproc.endpoints.scrape import restart_reason  # noqa: E402


def process_exposition(start_time: float | None, prompt_tokens: float | None, successes=(), engines=("0",)) -> bytes:
    """prometheus_client text with vLLM's counters and the process collector's start time (vLLM exposes both)."""
    reg = CollectorRegistry()
    if prompt_tokens is not None:
        c = Counter("vllm:prompt_tokens", "prompt tokens", ["model_name", "engine"], registry=reg)
        for e in engines:
            c.labels("m", e).inc(prompt_tokens)
    if successes:
        s = Counter("vllm:request_success", "finished", ["model_name", "finished_reason"], registry=reg)
        for reason, n in successes:
            s.labels("m", reason).inc(n)
    if start_time is not None:
        g = Gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                  registry=reg)
        g.set(start_time)
    return vllm_exposition() + generate_latest(reg)


def test_the_process_collector_start_time_and_counters_are_read():
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)  # the real collector vLLM's server registers (Linux /proc)
    m = parse_metrics(generate_latest(reg) + process_exposition(None, 123.0, successes=[("stop", 2), ("length", 3)]))
    assert m.process_start_time_s is not None and m.process_start_time_s > 1e9
    assert m.counter_totals[0] == 123.0 and m.counter_totals[2] == 5.0  # summed over label sets
    assert parse_metrics(vllm_exposition()).counter_totals == () and parse_metrics(b"").process_start_time_s is None


T0 = 1_700_000_000.0


@pytest.mark.parametrize("sequence,restarts", [
    ([(T0, 10), (T0, 50), (T0, 50), (T0, 900)], []),  # one process: counters only grow
    ([(T0, 10), (T0, 50), (T0 + 30, 60)], [2]),  # start time changed although the counter grew
    ([(T0, 10), (T0 + 0.2, 50)], []),  # within the tolerance: the same process printed differently
    ([(None, 500), (None, 900), (None, 4), (None, 30)], [2]),  # no start time: the counter went backwards
    ([(T0, 500), (None, 3)], [1]),  # start time gone (another exporter): the counter still tells
    ([(T0, 500), (T0 + 5, None), (T0 + 5, 2)], [1]),  # counters gone: the start time tells; then steady
    ([(None, None), (None, None)], []),  # no signal at all: never a restart
    ([(T0, 10), (T0 + 60, 0), (T0 + 120, 0), (T0 + 120, 5)], [1, 2]),  # two restarts, each seen once
])
def test_restart_reason_over_scrape_sequences(sequence, restarts):
    scrapes = [parse_metrics(process_exposition(t, n)) for t, n in sequence]
    seen = [i for i in range(1, len(scrapes)) if restart_reason(scrapes[i - 1], scrapes[i]) is not None]
    assert seen == restarts


def test_restart_reason_names_the_signal():
    a = parse_metrics(process_exposition(T0, 100.0, engines=("0", "1")))
    assert "process_start_time_seconds" in restart_reason(a, parse_metrics(process_exposition(T0 + 9, 100.0)))
    # one engine of two restarted: the sum went backwards
    assert "vllm:prompt_tokens_total" in restart_reason(a, parse_metrics(process_exposition(T0, 150.0)))


def test_the_host_kv_tier_is_read_from_the_offload_config():
    from prefixroute.model_servers import metrics
    from prefixroute.model_servers.profiles import EngineSpec
    from prefixroute.model_servers.server_settings import ServerSettings
    tiered = EngineSpec.from_settings(ServerSettings(kv_offloading_size=4.0))
    page = parse_metrics(metrics.render(tiered.new_engine(), model_name="m", process=False).encode())
    assert page.num_cpu_blocks == tiered.config.num_cpu_blocks == 2048
    assert page.num_gpu_blocks == tiered.config.num_gpu_blocks
    plain = EngineSpec.from_settings(ServerSettings()).new_engine()
    assert parse_metrics(metrics.render(plain, model_name="m", process=False).encode()).num_cpu_blocks is None
    # vLLM 0.33/0.34's form (CPUOffloadingInfo): chunks x blocks per chunk, summed over engines; a tiering
    # connector's secondary tier (cpu_* labels empty), "None", a missing label and the old medium/num_blocks form
    # (which no release wrote) say nothing
    text = (b'vllm:kv_offload_config_info{cpu_blocks_per_chunk="1",cpu_kv_cache_size_bytes="209715200",'
            b'cpu_kv_cache_size_tokens="1600",cpu_num_chunks="100",engine="0",model_name="m"} 1.0\n'
            b'vllm:kv_offload_config_info{cpu_blocks_per_chunk="4",cpu_kv_cache_size_bytes="1",'
            b'cpu_kv_cache_size_tokens="None",cpu_num_chunks="50",engine="1",model_name="m"} 1.0\n'
            b'vllm:kv_offload_config_info{cpu_blocks_per_chunk="",cpu_kv_cache_size_bytes="",'
            b'cpu_kv_cache_size_tokens="",cpu_num_chunks="",engine="0",model_name="m",tier="fs"} 1.0\n'
            b'vllm:kv_offload_config_info{cpu_blocks_per_chunk="None",cpu_num_chunks="7",engine="2"} 1.0\n'
            b'vllm:kv_offload_config_info{cpu_num_chunks="7",engine="3"} 1.0\n'
            b'vllm:kv_offload_config_info{engine="4",medium="CPU",num_blocks="100"} 1.0\n')
    assert parse_metrics(text).num_cpu_blocks == 100 + 50 * 4
    assert parse_metrics(b'vllm:kv_offload_config_info{engine="0",model_name="m"} 1.0\n').num_cpu_blocks is None
