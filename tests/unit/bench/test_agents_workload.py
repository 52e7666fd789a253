"""The agents workload (issue 14): structure of the conversations, the Responses and chat forms, the bound, the
per-router API, the Responses stream parsing of the bench client and the agents summary and report."""

from __future__ import annotations

import time

import pytest

from prefixroute import responses_prompt
from prefixroute.bench import client, report, results, runner, upper_bound, workloads as w
from prefixroute.bench.agents_workload import agents
from prefixroute.bench.routers import parse_router
from prefixroute.bench.workload_spec import CHARS_PER_TOKEN, RequestSpec, Workload
from prefixroute.model_servers.tokenizer import render_chat

SMALL = dict(num_agents=6, num_turns=4, num_apps=2, instructions_tokens=256, task_tokens=32,
             min_tool_output_tokens=40, max_tool_output_tokens=80, output_tokens=8, max_active_agents=3, seed=1)


def _by_agent(wl: Workload) -> dict[str, list[RequestSpec]]:
    out: dict[str, list[RequestSpec]] = {}
    for r in wl.requests:
        out.setdefault(r.session_id, []).append(r)
    return out


def _prompt(r: RequestSpec) -> str:
    return render_chat([dict(m) for m in r.messages], tools=[dict(t) for t in r.tools], add_generation_prompt=False)


def test_agents_is_a_named_workload():
    assert "agents" in w.WORKLOAD_NAMES
    wl = w.make_workload("agents", num_requests=0, seed=0, output_tokens=8, prefix_tokens=0, num_groups=0,
                         question_tokens=0, num_sessions=0, num_turns=3, document_tokens=0, num_documents=0,
                         num_agents=5, agent_instructions_tokens=128, agent_num_apps=2)
    assert wl.name == "agents" and len(wl.requests) == 15
    assert agents(**SMALL).requests == agents(**SMALL).requests


def test_turns_chain_and_each_prompt_extends_the_previous():
    wl = agents(**SMALL)
    by_agent = _by_agent(wl)
    assert len(by_agent) == 6
    for turns in by_agent.values():
        assert [r.turn for r in turns] == [0, 1, 2, 3]
        assert turns[0].after_index is None
        for prev, cur in zip(turns, turns[1:]):
            assert cur.after_index == prev.index and prev.index < cur.index
            # The rendered prompt of a turn (without the generation prompt) is a strict prefix of the next one:
            # the previous function call is not part of the chain, so nothing generated sits in between.
            assert _prompt(cur).startswith(_prompt(prev)) and len(_prompt(cur)) > len(_prompt(prev))
            assert cur.messages[:len(prev.messages)] == prev.messages


def test_turn_kinds_tool_choice_and_items():
    wl = agents(**SMALL)
    for r in wl.requests:
        form = r.responses
        assert form is not None and form["instructions"] == r.messages[0]["content"]
        assert r.messages[0]["role"] == "system"
        items = form["input"]
        assert len(items) == 1
        if r.turn == 0:
            assert items[0]["type"] == "message" and items[0]["role"] == "user"
            assert [m["role"] for m in r.messages] == ["system", "user"]
        else:
            assert items[0]["type"] == "function_call_output"
            assert r.messages[-1]["role"] == "tool" and r.messages[-1]["content"] == items[0]["output"]
            assert 40 * CHARS_PER_TOKEN <= len(items[0]["output"]) <= 80 * CHARS_PER_TOKEN
        last = r.turn == SMALL["num_turns"] - 1
        assert form["tool_choice"] == r.tool_choice == ("auto" if last else "required")
        # The chat form's tools are the Responses tools in chat shape (what the template renders).
        assert list(r.tools) == responses_prompt.chat_tools(form["tools"])
        assert 2 <= len(form["tools"]) <= 3


def test_messages_are_what_the_server_builds_from_the_chain():
    # Replays what a server does with the Responses form: input_messages over the stored chain (previous
    # messages + the previous response's function-call output, which it skips).
    wl = agents(**SMALL)
    stored: dict[str, list] = {}
    for r in wl.requests:
        body = responses_prompt.parse_body(r.responses_body("m", "resp_prev" if r.turn else None, "call_x"))
        prev_out = [{"type": "function_call", "call_id": "call_x", "name": "f", "arguments": "{}"}] if r.turn else None
        msgs = responses_prompt.input_messages(body, stored.get(r.session_id), prev_out)
        stored[r.session_id] = msgs
        for mine, server in zip(r.messages, msgs, strict=True):
            assert mine["role"] == server["role"] and mine["content"] == server["content"]


def test_instructions_are_shared_by_several_agents_and_distinct_per_app():
    wl = agents(**{**SMALL, "num_agents": 12})
    firsts = [r for r in wl.requests if r.turn == 0]
    by_app: dict[str, set[str]] = {}
    for r in firsts:
        by_app.setdefault(r.group_id, set()).add(r.responses["instructions"])
    assert len(by_app) == 2 and all(len(v) == 1 for v in by_app.values())
    assert len({next(iter(v)) for v in by_app.values()}) == 2
    sizes = {g: sum(1 for r in firsts if r.group_id == g) for g in by_app}
    assert all(n >= 2 for n in sizes.values())
    # Tasks are the agents' own.
    assert len({r.responses["input"][0]["content"] for r in firsts}) == 12


def test_responses_body_resolves_previous_id_and_call_id_without_changing_the_spec():
    r = next(r for r in agents(**SMALL).requests if r.turn == 2)
    b = r.responses_body("model-x", "resp_abc", "call_real")
    assert b["previous_response_id"] == "resp_abc" and b["input"][0]["call_id"] == "call_real"
    assert b["stream"] is True and b["store"] is True and b["max_output_tokens"] == 8
    assert b["tool_choice"] == "required" and b["model"] == "model-x"
    assert r.responses["input"][0]["call_id"] != "call_real"  # the workload is not mutated
    responses_prompt.parse_body(b)  # a valid Responses body
    first = r.responses_body("m")
    assert "previous_response_id" not in first
    with pytest.raises(ValueError):
        RequestSpec(index=0, max_tokens=1, prompt="x").responses_body("m")


def test_chat_body_carries_tools_and_tool_choice():
    r = agents(**SMALL).requests[0]
    b = r.body("m")
    assert b["tools"] == [dict(t) for t in r.tools] and b["tool_choice"] == "required"
    assert "tools" not in w.shared_prompts(num_requests=1).requests[0].body("m")


def test_upper_bound_counts_the_tools_the_template_renders():
    # The servers render tools into the system text: the bound's token count must include them (it did not:
    # prompt_token_ids rendered messages only).
    r = agents(**SMALL).requests[0]
    with_tools = len(upper_bound.prompt_token_ids(r))
    from dataclasses import replace
    without = len(upper_bound.prompt_token_ids(replace(r, tools=None)))
    assert with_tools > without + 20


def test_router_api_suffix():
    assert parse_router("prefixroute:prefix").workload_api == "responses"
    assert parse_router("sglang-router").workload_api == "chat"
    s = parse_router("prefixroute:prefix/chat")
    assert (s.name, s.policy, s.workload_api) == ("prefixroute:prefix/chat", "prefix", "chat")
    s = parse_router("sglang-router:random/responses")
    assert (s.name, s.kind, s.policy, s.workload_api) == ("sglang-router:random/responses", "sglang-router",
                                                           "random", "responses")
    assert parse_router("prefixroute:prefix@events/chat").index_source == "events"
    with pytest.raises(ValueError):
        parse_router("prefixroute:prefix/grpc")
    assert "/" not in runner._log_name(parse_router("vllm-router:random/responses"))


# ------------------------------------------------------------------------------ Responses stream parsing

STREAM = b"""event: response.created
data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","output":[]}}

event: response.in_progress
data: {"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_1"}}

event: response.output_item.added
data: {"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"id":"fc_1","type":"function_call","call_id":"call_9","name":"search_0","arguments":""}}

event: response.function_call_arguments.delta
data: {"type":"response.function_call_arguments.delta","sequence_number":3,"item_id":"fc_1","output_index":0,"delta":"{\\"q"}

event: response.function_call_arguments.delta
data: {"type":"response.function_call_arguments.delta","sequence_number":4,"item_id":"fc_1","output_index":0,"delta":"\\": 1}"}

event: response.function_call_arguments.done
data: {"type":"response.function_call_arguments.done","sequence_number":5,"item_id":"fc_1","output_index":0,"arguments":"{}"}

event: response.completed
data: {"type":"response.completed","sequence_number":6,"response":{"id":"resp_1","status":"completed","output":[{"type":"function_call","call_id":"call_9"}],"usage":{"input_tokens":900,"input_tokens_details":{"cached_tokens":768},"output_tokens":2,"total_tokens":902}}}

"""


def test_parse_sse_events_names_and_data():
    evs = client.parse_sse_events(STREAM.splitlines(keepends=True))
    assert [n for n, _ in evs] == ["response.created", "response.in_progress", "response.output_item.added",
                                   "response.function_call_arguments.delta",
                                   "response.function_call_arguments.delta",
                                   "response.function_call_arguments.done", "response.completed"]
    # Without event: lines the data's type names the event.
    bare = [ln for ln in STREAM.splitlines(keepends=True) if not ln.startswith(b"event:")]
    assert [n for n, _ in client.parse_sse_events(bare)] == [n for n, _ in evs]


def test_responses_events_fill_the_result():
    res = client.RequestResult(index=0)
    t0 = time.perf_counter()
    last = None
    for name, data in client.parse_sse_events(STREAM.splitlines()):
        if name == "response.created":
            assert res.ttft_ms is None
        last = client.apply_responses_event(res, name, data, t0, last)
        if name == "response.in_progress":
            assert res.response_id == "resp_1" and res.ttft_ms is None
    assert res.ttft_ms is not None and res.ttft_ms >= 0 and len(res.itl_ms) == 1
    assert (res.response_id, res.call_id) == ("resp_1", "call_9")
    assert (res.prompt_tokens, res.cached_tokens, res.completion_tokens) == (900, 768, 2)
    assert res.error is None


def test_text_delta_is_the_first_token_and_errors_are_recorded():
    res = client.RequestResult(index=0)
    t0 = time.perf_counter()
    client.apply_responses_event(res, "response.output_text.delta", {"delta": ""}, t0, None)
    assert res.ttft_ms is None  # an empty delta is no token
    client.apply_responses_event(res, "response.output_text.delta", {"delta": "hi"}, t0, None)
    assert res.ttft_ms is not None
    bad = client.RequestResult(index=1)
    client.apply_responses_event(bad, "response.failed", {"response": {"error": {"message": "boom"}}}, t0, None)
    assert bad.error and "boom" in bad.error


# ------------------------------------------------------------------------------------ summary and report


def _res(i, turn, *, ok=True, follow=None, not_found=False, sent=True, ttft=10.0, cached=50, prompt=100):
    r = client.RequestResult(index=i, turn=turn, follow_up=turn > 0 if follow is None else follow, sent=sent,
                             status=200 if ok else (404 if not_found else 0), ttft_ms=ttft if ok else None,
                             prompt_tokens=prompt, cached_tokens=cached, not_found=not_found,
                             error=None if ok else ("not found: x" if not_found else client.CHAIN_BROKEN))
    return r


def test_agent_summary_counts_follow_ups():
    rs = [_res(0, 0), _res(1, 1), _res(2, 2, ok=False, not_found=True), _res(3, 3, ok=False, sent=False),
          _res(4, 0), _res(5, 1, ttft=30.0)]
    a = results.agent_summary(rs, "responses")
    assert (a["follow_ups_sent"], a["follow_ups_served"], a["not_found"], a["follow_ups_not_sent"]) == (3, 2, 1, 1)
    assert a["follow_up_success_ratio"] == pytest.approx(2 / 3, abs=1e-5)
    assert a["first_turns_served"] == 2
    assert a["ttft_ms_by_turn"]["1"]["p50"] == pytest.approx(20.0)
    assert a["ttft_ms_by_turn"]["2"]["p50"] is None and a["requests_by_turn"]["2"] == 0
    assert a["hit_ratio_by_turn"]["0"] == pytest.approx(0.5)


def _run(router, policy, api, rs, n_endpoints=4):
    summ = results.summarize_run(router, rs, [f"e{k}" for k in range(n_endpoints)],
                                 extra={"policy": policy, "agents": results.agent_summary(rs, api)})
    return summ


def test_report_agents_section_and_targets():
    ours = [_res(i, t, ttft=5.0, cached=95) for i, t in enumerate([0, 1, 2, 0, 1, 2])]
    rand_chat = [_res(i, t, ttft=100.0, cached=40) for i, t in enumerate([0, 1, 2, 0, 1, 2])]
    rand_resp = [_res(0, 0), _res(1, 1, ok=False, not_found=True), _res(2, 2, ok=False, sent=False),
                 _res(3, 0), _res(4, 1), _res(5, 2, ok=False, not_found=True),
                 _res(6, 0), _res(7, 1, ok=False, not_found=True), _res(8, 2, ok=False, sent=False)]
    doc = results.results_document({"name": "agents"}, 0.96, [
        _run("prefixroute:prefix", "prefix", "responses", ours),
        _run("prefixroute:random/chat", "random", "chat", rand_chat),
        _run("sglang-router:random/responses", "random", "responses", rand_resp)])
    chat_base, resp_base = report.agent_baselines(doc["runs"])
    assert chat_base["router"] == "prefixroute:random/chat"
    assert resp_base["router"] == "sglang-router:random/responses"
    checks = {t: (m, ok) for t, m, ok in report.agent_checks(doc)}
    assert all(ok for _, ok in checks.values()), checks
    assert any("not found" in m for m, _ in checks.values())
    md = report.render_markdown(doc)
    assert "Design targets for prefixroute:prefix (agents)" in md and "| sglang-router:random/responses | responses | 1 / 4 |" in md
    assert "0.05x" in md  # turn P50 against the chat random run
    # A follow-up lost by ours fails the first target.
    lost = ours[:5] + [_res(5, 2, ok=False, not_found=True)]
    doc["runs"][0] = _run("prefixroute:prefix", "prefix", "responses", lost)
    first = report.agent_checks(doc)[0]
    assert first[2] is False and "1 not found" in first[1]
