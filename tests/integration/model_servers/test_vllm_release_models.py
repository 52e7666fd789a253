"""The simulated server's and the router's bodies validated by vLLM 0.33's own pydantic models, run from its
wheel (tests/helpers/engine_driver.py validate): Responses objects (created, stored, a function call) and error
bodies; and the committed tests/data/engines/ files are what the release's code produces today. Skipped,
saying so, without the vllm 0.33.0 wheel here (tests/data/kv_events/generate.py --download fetches it)."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
from helpers import engines
from helpers.model_server import start_server

from prefixroute.openai_errors import error_body

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RELEASE = engines.BY_NAME["vllm-0.33.0"]
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    wheel = engines.find_wheel(RELEASE)
    if wheel is None:
        pytest.skip(f"{RELEASE.requirement} wheel not found here (PREFIXROUTE_ENGINE_WHEELS, .cache/engine-wheels, "
                    f"pip's cache); tests/data/kv_events/generate.py --download fetches it")
    return engines.extract(wheel, tmp_path_factory.mktemp("vllm-0.33.0"))


def _validate(src, items: list[tuple[str, dict]]) -> list[dict]:
    lines = "".join(json.dumps({"model": m, "body": b}) + "\n" for m, b in items)
    out = subprocess.run(engines.driver_argv(RELEASE, src, "validate"), input=lines, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_simulated_responses_and_error_bodies_validate_against_vllm_033_models(src):
    s = start_server("--time-scale", "0.05")
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            created = c.post("/v1/responses", json={"model": "meta-llama/Llama-3.1-8B-Instruct", "input": "hi",
                                                    "max_output_tokens": 4}).json()
            stored = c.get(f"/v1/responses/{created['id']}").json()
            call = c.post("/v1/responses", json={"model": "meta-llama/Llama-3.1-8B-Instruct", "input": "read it",
                                                 "tools": TOOLS, "tool_choice": "required",
                                                 "max_output_tokens": 4}).json()
            follow = c.post("/v1/responses", json={"model": "meta-llama/Llama-3.1-8B-Instruct", "input": "more",
                                                   "previous_response_id": created["id"]}).json()
            missing = c.post("/v1/responses", json={"model": "no-such-model", "input": "x"})
            bad = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    finally:
        s.stop()
    assert (missing.status_code, bad.status_code) == (404, 400)
    items = [("ResponsesResponse", created), ("ResponsesResponse", stored), ("ResponsesResponse", call),
             ("ResponsesResponse", follow), ("ErrorResponse", missing.json()), ("ErrorResponse", bad.json()),
             ("ErrorResponse", json.loads(error_body(503, "no healthy endpoint")))]
    results = _validate(src, items)
    assert [r["ok"] for r in results] == [True] * len(items), [r for r in results if not r["ok"]]
    # The models do reject what is wrong (the check can fail): a usage without cache_write_tokens, a string code.
    wrong = [("ResponsesResponse", dict(created, usage={**created["usage"], "input_tokens_details": {
        "cached_tokens": 0}})), ("ErrorResponse", {"error": {"message": "m", "type": "T", "code": "x"}})]
    assert [r["ok"] for r in _validate(src, wrong)] == [False, False]


def test_the_committed_surface_is_what_the_release_produces(src):
    fresh = engines.surface(RELEASE, src)
    committed = json.loads((engines.SURFACE_DIR / RELEASE.name / "surface.json").read_text())
    for key in ("metrics_text", "schemas", "files", "recorded"):
        assert fresh[key] == committed[key], key
