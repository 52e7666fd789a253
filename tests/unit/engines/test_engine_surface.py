"""The rest of the engines' surface, checked against what the releases' own code produces
(tests/data/engines/<release>/surface.json, made by tests/data/kv_events/generate.py from the wheels):

- /metrics: vLLM 0.33's ``PrometheusStatLogger`` and SGLang 0.5.23's ``SchedulerMetricsCollector`` recorded
  known figures; the router's scraper reads them back (load, KV usage, block size and capacity).
- Error bodies: the router's and the simulated servers' OpenAI-format errors validate against vLLM 0.33's own
  ``ErrorResponse`` model (its JSON schema).
- Responses objects: the simulated server's response objects validate against vLLM 0.33's own
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


def _surface(name: str) -> dict:
    return json.loads((DATA / name / "surface.json").read_text())


@pytest.mark.parametrize("release", ["vllm-0.33.0", "sglang-0.5.23"])
def test_the_scraper_reads_what_the_release_metrics_code_exposes(release):
    s = _surface(release)
    r = s["recorded"]
    m = scrape.parse_metrics(s["metrics_text"].encode())
    assert (m.num_requests_running, m.num_requests_waiting) == (r["running"], r["waiting"])
    assert m.kv_cache_usage_ratio == pytest.approx(r["kv_usage"])
    assert (m.block_size, m.num_gpu_blocks) == (r["block_size"], r["num_gpu_blocks"])


def test_sglang_per_priority_samples_are_not_added_to_the_total():
    text = _surface("sglang-0.5.23")["metrics_text"]
    lines = [ln for ln in text.splitlines() if ln.startswith("sglang:num_running_reqs{")]
    assert len(lines) == 3 and sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) == 6.0  # total 3 + 2 + 1
    assert scrape.parse_metrics(text.encode()).num_requests_running == 3


def test_every_name_the_scraper_reads_first_is_the_vllm_release_name():
    text = _surface("vllm-0.33.0")["metrics_text"]
    families = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")}
    for names in (scrape.RUNNING_NAMES, scrape.WAITING_NAMES, scrape.KV_USAGE_NAMES):
        assert names[0].decode() in families
    assert scrape.CACHE_CONFIG_NAME.decode() in families
    counters = {n.decode() for n in scrape.COUNTER_NAMES if n.startswith(b"vllm:")}
    assert counters <= families, counters - families
    sglang = {ln.split()[2] for ln in _surface("sglang-0.5.23")["metrics_text"].splitlines()
              if ln.startswith("# TYPE ")}
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:page_size",
            "sglang:num_pages"} <= sglang


@pytest.mark.parametrize("status", sorted(ERROR_TYPES))
def test_error_bodies_validate_against_vllm_error_response(status):
    schema = _surface("vllm-0.33.0")["schemas"]["ErrorResponse"]
    jsonschema.validate(json.loads(error_body(status, "message", param="model")), schema)
    jsonschema.validate(json.loads(OpenAIError(status, "m").body()), schema)


def test_a_wrong_error_body_fails_the_vllm_schema():
    schema = _surface("vllm-0.33.0")["schemas"]["ErrorResponse"]
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


def test_simulated_responses_objects_validate_against_vllm_responses_response():
    schema = _surface("vllm-0.33.0")["schemas"]["ResponsesResponse"]
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


def test_the_simulated_server_metrics_are_vllm_033_families():
    """Every vllm: family the simulated server exposes is one vLLM 0.33 exposes, of the same type, its labels a
    subset of the release's (cache_config_info: the release's CacheConfig fields)."""
    from prometheus_client.parser import text_string_to_metric_families

    from prefixroute.model_servers import metrics
    from prefixroute.model_servers.profiles import EngineSpec
    from prefixroute.model_servers.server import ServerSettings

    def families(text: str) -> dict[str, tuple[str, set[str]]]:
        return {f.name: (f.type, {k for s in f.samples for k in s.labels})
                for f in text_string_to_metric_families(text)}

    sim = families(metrics.render(EngineSpec.from_settings(ServerSettings()).new_engine(), model_name="m",
                                  process=False))
    rel = families(_surface("vllm-0.33.0")["metrics_text"])
    ours = {n: v for n, v in sim.items() if n.startswith("vllm:")}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
            "vllm:prefix_cache_queries"} <= ours.keys()
    for name, (kind, labels) in ours.items():
        assert name in rel, name
        assert rel[name][0] == kind, (name, kind, rel[name][0])
        assert labels <= rel[name][1], (name, labels - rel[name][1])
    assert not [n for n, (kind, _) in sim.items() if kind == "unknown"], "a family line that names no family"
