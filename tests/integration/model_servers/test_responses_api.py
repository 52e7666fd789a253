"""The simulated server's Responses API over real HTTP, driven by the real `openai` SDK: create (stream and
not), follow-ups through the in-process store, retrieve, cancel, function-call loops, store: false, errors,
a restart emptying the store, and a disconnect aborting in the engine."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import orjson
import pytest
from helpers.model_server import start_server
from helpers.waiting import until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

FAST = ("--time-scale", "0.05")
SYSTEM = "You are a careful agent. " * 60  # ~300 tokens: several full KV blocks shared by every turn
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture
def server(server_factory):
    return server_factory(*FAST)


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def metrics(s) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(s.url + "/metrics").text):
        for smp in fam.samples:
            out[smp.name] = smp.value
    return out


def test_create_follow_up_covers_previous_turn_and_hits_the_cache(server) -> None:
    c = client(server)
    r1 = c.responses.create(input="first question", instructions=SYSTEM, max_output_tokens=8)
    assert r1.id.startswith("resp_") and len(r1.id) == 37 and r1.object == "response"
    assert r1.status == "completed" and r1.output[0].type == "message" and r1.output_text
    assert r1.usage.output_tokens == 8 and r1.usage.input_tokens_details.cached_tokens == 0
    assert r1.store is True and r1.max_output_tokens == 8 and r1.previous_response_id is None
    r2 = c.responses.create(input="second question", instructions=SYSTEM, previous_response_id=r1.id)
    # the follow-up's prompt is turn 1 (its input and its output) plus the new input: it covers turn 1 ...
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    # ... and reuses turn 1's KV blocks on this server
    assert r2.usage.input_tokens_details.cached_tokens >= 16 * (r1.usage.input_tokens // 16) - 16
    assert r2.usage.input_tokens_details.cached_tokens > 0 and r2.previous_response_id == r1.id
    assert r2.usage.output_tokens == 16  # default_max_tokens, like chat's max_tokens default


def test_stream_events_and_sdk_iterator(server) -> None:
    c = client(server)
    events = list(c.responses.create(input="stream please", instructions=SYSTEM, stream=True,
                                     max_output_tokens=5))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 5,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.status == "completed" and done.usage.output_tokens == 5
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    # a streamed response is stored too: a follow-up finds it and GET returns it
    r2 = c.responses.create(input="next", instructions=SYSTEM, previous_response_id=done.id, max_output_tokens=2)
    assert r2.usage.input_tokens_details.cached_tokens > 0
    got = c.responses.retrieve(done.id)
    assert got.id == done.id and got.output_text == done.output_text
    assert got.usage.input_tokens == done.usage.input_tokens


def test_stream_writes_created_before_the_first_token(server_factory) -> None:
    # time-scale 1: a 20k-token cold prefill takes far longer than the opening events may
    s = server_factory("--time-scale", "1")
    body = orjson.dumps({"input": "word " * 20000, "stream": True, "max_output_tokens": 1})
    with socket.create_connection((s.host, s.port)) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(body), body))
        sock.settimeout(5)
        t0 = time.monotonic()
        head = b""
        while b"response.in_progress" not in head:
            head += sock.recv(65536)
        first_s = time.monotonic() - t0
        assert b"text/event-stream" in head and b"output_text.delta" not in head
        rest = head
        while b"response.completed" not in rest:
            rest += sock.recv(65536)
        total_s = time.monotonic() - t0
    assert first_s < total_s / 2, (first_s, total_s)


def test_unknown_previous_id_is_vllm_404_and_bad_prefix_400(server) -> None:
    c = client(server)
    with pytest.raises(openai.NotFoundError) as ei:
        c.responses.create(input="x", previous_response_id="resp_0123456789abcdef0123456789abcdef")
    assert "Response with id 'resp_0123456789abcdef0123456789abcdef' not found." in str(ei.value)
    assert ei.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as ei:
        c.responses.create(input="x", previous_response_id="chatcmpl-1")
    assert "Expected an ID that begins with 'resp'" in str(ei.value)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_nope")


def test_function_call_loop(server) -> None:
    c = client(server)
    r1 = c.responses.create(input="open the readme", instructions=SYSTEM, tools=TOOLS, tool_choice="required",
                            max_output_tokens=12)
    (call,) = r1.output
    assert call.type == "function_call" and call.name == "read_file"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert list(orjson.loads(call.arguments)) == ["path"]  # a JSON object of the tool's first parameter
    r2 = c.responses.create(previous_response_id=r1.id, instructions=SYSTEM, tools=TOOLS,
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "# README\n" * 50}])
    assert r2.output[0].type == "message" and r2.output_text
    assert r2.usage.input_tokens > r1.usage.input_tokens and r2.usage.input_tokens_details.cached_tokens > 0
    # a named tool choice, streamed: argument deltas concatenate to the done arguments
    events = list(c.responses.create(input="again", tools=TOOLS, stream=True, max_output_tokens=4,
                                     tool_choice={"type": "function", "name": "read_file"}))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == events[-1].response.output[0].arguments and orjson.loads(deltas)


def test_store_false_is_not_stored(server) -> None:
    c = client(server)
    before = metrics(server)["prefixroute:responses_stored"]
    r = c.responses.create(input="ephemeral", store=False, max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.create(input="follow", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    assert metrics(server)["prefixroute:responses_stored"] == before


def test_store_bounded_with_evictions(server_factory) -> None:
    s = server_factory(*FAST, "--responses-store-max-entries", "2")
    c = client(s)
    ids = [c.responses.create(input=f"q{i}", max_output_tokens=1).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[0])
    assert c.responses.retrieve(ids[2]).id == ids[2]
    m = metrics(s)
    assert m["prefixroute:responses_stored"] == 2 and m["prefixroute:responses_store_evictions_total"] == 1


def test_store_off_by_setting(server_factory) -> None:
    s = server_factory(*FAST, "--no-responses-store")
    c = client(s)
    r = c.responses.create(input="x", max_output_tokens=1)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.create(input="y", previous_response_id=r.id)


def test_restart_forgets_ids(server_factory) -> None:
    s = server_factory(*FAST)
    rid = client(s).responses.create(input="x", max_output_tokens=1).id
    s.stop()
    s2 = server_factory(*FAST)
    with pytest.raises(openai.NotFoundError):
        client(s2).responses.create(input="y", previous_response_id=rid)


def test_routes_methods_and_errors(server) -> None:
    c = client(server)
    rid = c.responses.create(input="x", max_output_tokens=1).id
    r = httpx.post(f"{server.url}/v1/responses/{rid}/cancel")
    assert r.status_code == 400 and r.json()["error"]["message"] == "Cannot cancel a synchronous response."
    assert httpx.post(f"{server.url}/v1/responses/resp_nope/cancel").status_code == 404
    assert httpx.delete(f"{server.url}/v1/responses/{rid}").status_code == 405
    assert httpx.get(f"{server.url}/v1/responses").status_code == 405
    assert httpx.get(f"{server.url}/v1/responses/{rid}/input_items").status_code == 404
    assert httpx.get(f"{server.url}/v1/responsesX").status_code == 404
    bad = httpx.post(f"{server.url}/v1/responses", json={"input": [{"type": "item_reference", "id": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].type"
    assert "item_reference" in bad.json()["error"]["message"]
    for body, status, param in [({"input": "x", "model": "nope"}, 404, "model"),
                                ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
                                ({"input": "x", "temperature": 9}, 400, "temperature"),
                                ({}, 400, "input")]:
        r = httpx.post(f"{server.url}/v1/responses", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text


def test_cache_salt_isolates_and_prompt_cache_key_does_not(server) -> None:
    c = client(server)
    c.responses.create(input="salted", instructions=SYSTEM, max_output_tokens=1)
    same = c.responses.create(input="salted", instructions=SYSTEM, max_output_tokens=1, prompt_cache_key="k1")
    assert same.usage.input_tokens_details.cached_tokens > 0  # the key is a routing hint, not a salt (vLLM)
    salted = c.responses.create(input="salted", instructions=SYSTEM, max_output_tokens=1,
                                extra_body={"cache_salt": "tenant-a"})
    assert salted.usage.input_tokens_details.cached_tokens == 0


def test_disconnect_aborts_in_engine(server_factory) -> None:
    s = server_factory("--time-scale", "1")

    async def run() -> None:
        body = orjson.dumps({"input": "x", "stream": True, "max_output_tokens": 5000})
        reader, writer = await asyncio.open_connection(s.host, s.port)
        writer.write(b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()
        await reader.readuntil(b"response.output_text.delta")
        writer.close()

    asyncio.run(run())
    def aborted() -> dict | None:
        m = metrics(s)
        return m if m["prefixroute:requests_aborted_total"] == 1 and m["vllm:num_requests_running"] == 0 else None

    m = until(aborted, 5, message=lambda: metrics(s))
    assert m["prefixroute:responses_stored"] == 0  # an aborted response is never stored
