"""The rest of the engines' surface, checked against what the releases' own code produces
(tests/data/engines/<release>/surface.json, made by tests/data/kv_events/generate.py from the wheels):

- /metrics: vLLM 0.33's and 0.34's ``PrometheusStatLogger`` and offloading connector metrics
  (``OffloadPromMetrics``: ``vllm:kv_offload_config_info``), SGLang 0.5.23's ``SchedulerMetricsCollector``
  recorded known figures; the router's scraper reads them back (load, KV usage, block size and capacity, the
  CPU tier's size).
- Error bodies: the router's and the simulated servers' OpenAI-format errors validate against vLLM 0.33's and
  0.34's own ``ErrorResponse`` model (its JSON schema).
- Responses objects: the simulated server's response objects validate against vLLM 0.33's and 0.34's own
  ``ResponsesResponse`` model (its JSON schema, built on the openai types package).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from prefixroute.extproc.endpoints import scrape
from prefixroute.model_servers import response_store
from prefixroute.openai_errors import ERROR_TYPES, OpenAIError, error_body

DATA = Path(__file__).resolve().parents[2] / "data" / "engines"
VLLM = ["vllm-0.33.0", "vllm-0.34.0"]


def _surface(name: str) -> dict:
    return json.loads((DATA / name / "surface.json").read_text())


@pytest.mark.parametrize("release", [*VLLM, "sglang-0.5.23"])
def test_the_scraper_reads_what_the_release_metrics_code_exposes(release):
    s = _surface(release)
    r = s["recorded"]
    m = scrape.parse_metrics(s["metrics_text"].encode())
    assert (m.num_requests_running, m.num_requests_waiting) == (r["running"], r["waiting"])
    assert m.kv_cache_usage_ratio == pytest.approx(r["kv_usage"])
    assert (m.block_size, m.num_gpu_blocks) == (r["block_size"], r["num_gpu_blocks"])
    assert m.num_cpu_blocks == r.get("num_cpu_blocks")  # vLLM: two engines' CPU tiers (chunks x blocks per chunk)


@pytest.mark.parametrize("release", VLLM)
def test_the_offload_config_info_is_the_cpu_offloading_info_form(release):
    """vLLM 0.33 and 0.34 write the CPU tier as CPUOffloadingInfo's four labels (a size in tokens unknown:
    "None"); the simulated server writes the same line, labels and help."""
    from prefixroute.model_servers import metrics

    text = _surface(release)["metrics_text"]
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:kv_offload_config_info{")]
    assert lines == [
        'vllm:kv_offload_config_info{cpu_blocks_per_chunk="1",cpu_kv_cache_size_bytes="4294967296",'
        'cpu_kv_cache_size_tokens="32768",cpu_num_chunks="2048",engine="0",model_name="m"} 1.0',
        'vllm:kv_offload_config_info{cpu_blocks_per_chunk="4",cpu_kv_cache_size_bytes="4194304000",'
        'cpu_kv_cache_size_tokens="None",cpu_num_chunks="500",engine="1",model_name="m"} 1.0']
    assert f"# HELP vllm:kv_offload_config_info {metrics.OFFLOAD_INFO_HELP}" in text.splitlines()
    # The simulator's labels for the release's engine-0 tier (4096 tokens, 2 MiB blocks): the release's line.
    ours = metrics.offload_config_labels(2048, 2 << 20, 16, 4096)
    assert f'vllm:kv_offload_config_info{{{ours},engine="0",model_name="m"}} 1.0' == lines[0]
    ours = metrics.offload_config_labels(500, 2 << 20, 16, 0)
    assert 'cpu_kv_cache_size_tokens="None"' in ours


def test_sglang_per_priority_samples_are_not_added_to_the_total():
    text = _surface("sglang-0.5.23")["metrics_text"]
    lines = [ln for ln in text.splitlines() if ln.startswith("sglang:num_running_reqs{")]
    assert len(lines) == 3 and sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) == 6.0  # total 3 + 2 + 1
    assert scrape.parse_metrics(text.encode()).num_requests_running == 3


def test_every_name_the_scraper_reads_first_is_the_vllm_release_name():
    text = _surface("vllm-0.34.0")["metrics_text"]
    families = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")}
    for names in (scrape.RUNNING_NAMES, scrape.WAITING_NAMES, scrape.KV_USAGE_NAMES):
        assert names[0].decode() in families
    assert scrape.CACHE_CONFIG_NAME.decode() in families and scrape.OFFLOAD_CONFIG_NAME.decode() in families
    counters = {n.decode() for n in scrape.COUNTER_NAMES if n.startswith(b"vllm:")}
    assert counters <= families, counters - families
    sglang = {ln.split()[2] for ln in _surface("sglang-0.5.23")["metrics_text"].splitlines()
              if ln.startswith("# TYPE ")}
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:page_size",
            "sglang:num_pages"} <= sglang


@pytest.mark.parametrize("release", VLLM)
@pytest.mark.parametrize("status", sorted(ERROR_TYPES))
def test_error_bodies_validate_against_vllm_error_response(status, release):
    schema = _surface(release)["schemas"]["ErrorResponse"]
    jsonschema.validate(json.loads(error_body(status, "message", param="model")), schema)
    jsonschema.validate(json.loads(OpenAIError(status, "m").body()), schema)


@pytest.mark.parametrize("release", VLLM)
def test_a_wrong_error_body_fails_the_vllm_schema(release):
    schema = _surface(release)["schemas"]["ErrorResponse"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"error": {"message": "m", "type": "BadRequestError", "code": "400"}}, schema)
    with pytest.raises(jsonschema.ValidationError):  # SGLang's flat form is not vLLM's
        jsonschema.validate({"object": "error", "message": "m", "type": "BadRequestError", "code": 400}, schema)


def _meta(**kw) -> response_store.ResponseMeta:
    base = dict(response_id="resp_" + "0" * 32, created_at=1_764_000_000, model="m", max_output_tokens=16,
                store=True, data={"model": "m", "input": "hi"}, tools=[], instructions=None,
                previous_response_id=None, function=None, item_id="msg_" + "1" * 32, call_id="")
    base.update(kw)
    return response_store.ResponseMeta(**base)


@pytest.mark.parametrize("release", VLLM)
def test_simulated_responses_objects_validate_against_vllm_responses_response(release):
    schema = _surface(release)["schemas"]["ResponsesResponse"]
    m = _meta()
    done = response_store.response_object(m, status="completed", output=response_store.output_items(m, "hello"),
                                     usage_=response_store.usage(40, 2, 16, 16))
    jsonschema.validate(done, schema)
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {
        "q": {"type": "string"}}, "required": ["q"]}, "strict": False}
    fm = _meta(tools=[tool], function=tool, item_id="fc_" + "2" * 32, call_id="call_" + "3" * 24,
               data={"model": "m", "input": "hi", "tools": [tool], "tool_choice": "required"})
    jsonschema.validate(response_store.response_object(fm, status="completed", output=response_store.output_items(fm, "x"),
                                                  usage_=response_store.usage(40, 2, 0)), schema)
    jsonschema.validate(response_store.response_object(m, status="in_progress", output=[], usage_=None), schema)
    # What vLLM 0.33 requires is checked: a usage without cache_write_tokens (our old one) does not validate.
    old = dict(done, usage={**done["usage"], "input_tokens_details": {"cached_tokens": 16}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(old, schema)


@pytest.mark.parametrize("release", VLLM)
@pytest.mark.parametrize("offloading", [None, 4.0], ids=["gpu", "cpu-tier"])
def test_the_simulated_server_metrics_are_vllm_033_families(release, offloading):
    """Every vllm: family the simulated server exposes is one vLLM 0.33 (0.34) exposes, of the same type, its
    labels a subset of the release's (cache_config_info: the release's CacheConfig fields); with a CPU tier,
    the offloading connector's families too."""
    from prometheus_client.parser import text_string_to_metric_families

    from prefixroute.model_servers import metrics
    from prefixroute.model_servers.profiles import EngineSpec
    from prefixroute.model_servers.server import ServerSettings

    def families(text: str) -> dict[str, tuple[str, set[str]]]:
        return {f.name: (f.type, {k for s in f.samples for k in s.labels})
                for f in text_string_to_metric_families(text)}

    sim = families(metrics.render(EngineSpec.from_settings(ServerSettings(kv_offloading_size=offloading)).new_engine(),
                                  model_name="m", process=False, max_model_len=4096))
    rel = families(_surface(release)["metrics_text"])
    ours = {n: v for n, v in sim.items() if n.startswith("vllm:")}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
            "vllm:prefix_cache_queries"} <= ours.keys()
    if offloading:
        assert {"vllm:kv_offload_config_info", "vllm:kv_offload_load_bytes", "vllm:external_prefix_cache_hits"} \
            <= ours.keys()
    for name, (kind, labels) in ours.items():
        assert name in rel, name
        assert rel[name][0] == kind, (name, kind, rel[name][0])
        assert labels <= rel[name][1], (name, labels - rel[name][1])
    assert not [n for n, (kind, _) in sim.items() if kind == "unknown"], "a family line that names no family"
