"""A model id holding a slash, retrieved with the OpenAI SDK (`client.models.retrieve(...)`: the SDK sends the `/`
as `%2F`), through real Envoy + ext_proc in front of real simulated servers: the client gets exactly the answer the
endpoint gives when called directly, never Envoy's own refusal.

vLLM 0.33 serves only the list (`GET /v1/models`, vllm/entrypoints/openai/models/api_router.py) and answers any
`GET /v1/models/{id}` with FastAPI's 404 `{"detail": "Not Found"}` (checked with its own router and exception
handlers); the simulated server answers 404 too, in OpenAI's error format. Either way the gateway passes on what
the endpoint says.
"""

from __future__ import annotations

import openai
import pytest

from prefixroute.extproc.gateway import GatewayProcesses

from helpers.fleet import MODEL, Fleet

pytestmark = pytest.mark.integration


def _retrieve(base_url: str, model: str) -> tuple[int, object, bytes]:
    """(status, parsed answer or the SDK's exception, raw path sent) of `client.models.retrieve(model)`."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=10)
    try:
        raw = client.models.with_raw_response.retrieve(model)
        return raw.status_code, raw.parse(), raw.http_request.url.raw_path
    except openai.APIStatusError as exc:
        return exc.status_code, exc.body, exc.request.url.raw_path


def test_sdk_retrieve_of_a_model_id_with_a_slash_gets_the_endpoints_answer(
        fleet_and_gateway: tuple[Fleet, GatewayProcesses]) -> None:
    fleet, gw = fleet_and_gateway
    via_gateway = _retrieve(f"{gw.url}/v1", MODEL)
    direct = _retrieve(f"http://{fleet.endpoints[0]}/v1", MODEL)
    assert via_gateway[2] == direct[2] == b"/v1/models/meta-llama%2FLlama-3.1-8B-Instruct"  # what the SDK sends
    # The same status and body as the endpoint's own (not Envoy's 400 "path_normalization_failed").
    assert via_gateway[:2] == direct[:2], (via_gateway, direct)
    assert via_gateway[0] == 404
    # The endpoint saw the decoded path, as it would have without the gateway.
    assert "/v1/models/meta-llama/Llama-3.1-8B-Instruct" in str(via_gateway[1])


def test_the_listed_model_is_found_through_the_sdk(gateway: GatewayProcesses) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=10)
    assert MODEL in [m.id for m in client.models.list()]
