"""Responses API affinity end to end (issue 14): the OpenAI Python SDK -> real Envoy -> `prefixroute extproc` ->
4 real simulated servers (each with its own in-memory response store), on loopback.

What a follow-up (``previous_response_id``) or ``GET /v1/responses/{id}`` must get: the endpoint that produced
that response, always (it alone holds it), or a clear OpenAI error naming the id (404 when nobody holds it, 503
with Retry-After while its holder is down), never a silent reroute to another endpoint, whether the router
learned the id from the observing stream, by a lookup after a restart, or with telemetry off.

Which endpoint served: the simulated server's ``x-prefixroute-server-id`` response header (``s<i>``: server i
of the fleet). Whether an endpoint generated: its ``vllm:prompt_tokens`` counter.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from helpers.fleet import MODEL, Fleet, start_fleet, start_gateway
from helpers.stack import metric_value
from helpers.waiting import until
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port

pytestmark = pytest.mark.integration

SERVER_ID = "x-prefixroute-server-id"
TOOLS = [{"type": "function", "name": "search_runbook", "description": "Search the team runbook.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}]


def instructions(k: int) -> str:
    """Conversation `k`'s own long instructions (distinct from the first word: turn 1s spread over the fleet)."""
    return f"Agent {k}: you triage incident {k} for team {k}; cite the runbook, answer tersely. " * 40


def client(gw: GatewayProcesses) -> openai.OpenAI:
    # No SDK retries: every answer the gateway gives is what the test sees.
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30.0)


@dataclass
class Turn:
    server: str
    response: object  # openai.types.responses.Response
    cached_tokens: int


def create(c: openai.OpenAI, *, stream: bool, **kw: object) -> Turn:
    """One ``responses.create`` through the raw-response API (its headers name the server), streamed or not; a
    stream is read to its ``response.completed`` event."""
    raw = c.responses.with_raw_response.create(model=MODEL, max_output_tokens=8, stream=stream, **kw)
    parsed = raw.parse()
    if stream:
        events = list(parsed)
        assert events[0].type == "response.created"
        assert events[-1].type == "response.completed", [e.type for e in events]
        parsed = events[-1].response
    return Turn(raw.headers[SERVER_ID], parsed, parsed.usage.input_tokens_details.cached_tokens)


@dataclass
class Conversation:
    """A 4-turn agent loop: a question that must call the tool, the tool's output (must call again), the second
    output (answer in text), then a user follow-up. Every turn after the first sends only its new input and
    ``previous_response_id``."""

    k: int
    stream: bool
    turns: list[Turn] = field(default_factory=list)

    @property
    def home(self) -> str:
        return self.turns[0].server

    @property
    def last_id(self) -> str:
        return self.turns[-1].response.id  # type: ignore[attr-defined]

    def step(self, c: openai.OpenAI, **override: object) -> Turn:
        n = len(self.turns)
        kw: dict[str, object] = {"instructions": instructions(self.k), "tools": TOOLS}
        if n == 0:
            kw |= {"input": f"Incident {self.k}: the queue is stuck. What now?", "tool_choice": "required"}
        else:
            kw["previous_response_id"] = self.last_id
            prev = self.turns[-1].response.output[0]  # type: ignore[attr-defined]
            if prev.type == "function_call":
                kw["input"] = [{"type": "function_call_output", "call_id": prev.call_id,
                                "output": f"runbook result {n} for incident {self.k}"}]
                kw["tool_choice"] = "required" if n == 1 else "auto"
            else:
                kw["input"] = f"Thanks. And step {n}?"
        kw |= override
        turn = create(c, stream=self.stream, **kw)
        self.turns.append(turn)
        return turn


def router_metrics(gw: GatewayProcesses) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


def lookups(gw: GatewayProcesses) -> dict[str, float]:
    text = router_metrics(gw)
    out = {o: metric_value(text, "prefixroute_response_lookups_total", outcome=o)
           for o in ("found", "not_found", "failed", "refused")}
    out["requests"] = metric_value(text, "prefixroute_response_lookup_requests_total")
    out["hits"] = metric_value(text, "prefixroute_response_id_hits_total")
    return out


def prompt_tokens(fleet: Fleet) -> dict[str, float]:
    """Each endpoint's ``vllm:prompt_tokens`` (prefill it did: a lookup GET adds nothing, a generation does)."""
    out = {}
    for ep in fleet.endpoints:
        with urllib.request.urlopen(f"http://{ep}/metrics", timeout=5) as r:
            out[ep] = metric_value(r.read().decode(), "vllm:prompt_tokens_total")
    return out


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, GatewayProcesses, Path]]:
    log_dir = tmp_path_factory.mktemp("responses-gateway")
    with ExitStack() as stack:
        fleet = start_fleet(stack, 4, log_dir)
        gw = start_gateway(stack, fleet.endpoints, log_dir)
        yield fleet, gw, log_dir


@pytest.fixture(scope="module")
def conversations(rig: tuple[Fleet, GatewayProcesses, Path]) -> list[Conversation]:
    """12 conversations of 4 turns through the SDK, half streamed, interleaved turn by turn (each follow-up
    right after its conversation's previous turn, others in between: ids of every endpoint in flight)."""
    _, gw, _ = rig
    c = client(gw)
    convs = [Conversation(k, stream=k % 2 == 0) for k in range(12)]
    t0 = time.monotonic()
    for _ in range(4):
        for conv in convs:
            conv.step(c)
    print(f"48 turns in {time.monotonic() - t0:.2f} s; lookups {lookups(gw)}")
    return convs


def test_sdk_follow_ups_are_served_by_the_endpoint_holding_the_previous_response(
        rig: tuple[Fleet, GatewayProcesses, Path], conversations: list[Conversation]) -> None:
    _, gw, _ = rig
    homes = {conv.home for conv in conversations}
    assert len(homes) >= 2, homes  # else "same endpoint" would prove nothing
    follow_ups = [(conv, t) for conv in conversations for t in conv.turns[1:]]
    assert len(follow_ups) == 36
    on_holder = sum(t.server == conv.home for conv, t in follow_ups)
    print(f"follow-ups served by the holder: {on_holder}/{len(follow_ups)}; homes {sorted(homes)}")
    assert on_holder == len(follow_ups)
    assert all(t.cached_tokens > 0 for _, t in follow_ups), [(c.k, t.cached_tokens) for c, t in follow_ups]
    for conv in conversations:  # the agent loop really ran: two tool calls, then text
        kinds = [t.response.output[0].type for t in conv.turns]  # type: ignore[attr-defined]
        assert kinds == ["function_call", "function_call", "message", "message"], (conv.k, kinds)
    m = lookups(gw)
    assert m["not_found"] == m["failed"] == m["refused"] == 0, m
    # Every follow-up found its id: in the directory (learned from the observing stream) or by a lookup (the
    # follow-up came before the observing stream was read).
    assert m["hits"] + m["found"] >= len(follow_ups), m

    # GET /v1/responses/{id} through the gateway: the holder answers with the stored response.
    c = client(gw)
    for conv in conversations:
        raw = c.responses.with_raw_response.retrieve(conv.last_id)
        got = raw.parse()
        assert raw.headers[SERVER_ID] == conv.home
        assert got.id == conv.last_id and got.status == "completed"
        assert got.output_text == conv.turns[-1].response.output_text  # type: ignore[attr-defined]


def test_a_follow_up_pins_even_when_its_prompt_has_affinity_elsewhere(
        rig: tuple[Fleet, GatewayProcesses, Path], conversations: list[Conversation]) -> None:
    """A follow-up whose instructions are another conversation's (hot on that one's endpoint): prefix affinity
    alone would send it there, where its previous response does not exist."""
    _, gw, _ = rig
    c = client(gw)
    pairs = [(a, b) for a in conversations for b in conversations if a.home != b.home][:6]
    assert pairs
    for a, b in pairs:
        t = a.step(c, instructions=instructions(b.k), input="Switching to the other team's runbook.",
                   tools=TOOLS, tool_choice="auto")
        assert t.server == a.home, (a.k, b.k, t.server)


def test_router_restart_mid_conversation_finds_ids_by_lookup(
        rig: tuple[Fleet, GatewayProcesses, Path], conversations: list[Conversation]) -> None:
    _, gw, _ = rig
    gw.stop_extproc()
    gw.start_extproc()  # a fresh process: its directory is empty
    before = lookups(gw)
    assert before["found"] == before["hits"] == 0
    c = client(gw)
    picked = conversations[:4]
    t0 = time.monotonic()
    turns = [conv.step(c) for conv in picked]
    took_s = time.monotonic() - t0
    assert [t.server for t in turns] == [conv.home for conv in picked]
    assert all(t.cached_tokens > 0 for t in turns)
    after = lookups(gw)
    print(f"after a router restart: {len(picked)} follow-ups in {took_s:.3f} s, lookups {after}")
    assert after["found"] == len(picked) and after["not_found"] == after["failed"] == 0
    assert after["hits"] == 0  # the routes the lookups were made for are no directory hits
    assert after["requests"] == len(picked) * 4  # one fan-out each, to the 4 healthy endpoints
    # The ids the lookups found are remembered, and the new turns' ids learned: no more fan-outs.
    for conv in picked:
        looked_up = conv.turns[-2].response.id  # type: ignore[attr-defined]
        assert c.responses.with_raw_response.retrieve(looked_up).headers[SERVER_ID] == conv.home
        assert conv.step(c).server == conv.home
    final = lookups(gw)
    assert final["requests"] == after["requests"], (after, final)
    assert final["hits"] == 2 * len(picked)
    # Each new turn's id came in Envoy's early report (streamed: with its first token; JSON: alone), before its
    # record: a follow-up sent at once never waits on the record's flush (facts_fields.py, RESPONSE_ID_METHOD).
    text = router_metrics(gw)
    assert metric_value(text, "prefixroute_facts_early_response_id_total", outcome="learned") == 2 * len(picked)
    assert {conv.stream for conv in picked} == {True, False}


def test_unknown_id_is_a_404_naming_it_and_nothing_generates(rig: tuple[Fleet, GatewayProcesses, Path]) -> None:
    fleet, gw, _ = rig
    c = client(gw)
    rid = "resp_" + "7" * 32  # well formed, never issued
    tokens = prompt_tokens(fleet)
    before = lookups(gw)
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.create(model=MODEL, input="continue", previous_response_id=rid, instructions=instructions(0))
    err = info.value.body
    assert rid in err["message"] and err["param"] == "response_id" and err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.retrieve(rid)
    assert rid in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):  # a streamed follow-up gets the same answer before any event
        list(c.responses.create(model=MODEL, input="x", previous_response_id=rid, stream=True))
    after = lookups(gw)
    assert after["not_found"] - before["not_found"] == 1  # one fan-out; the retries hit the negative cache
    assert prompt_tokens(fleet) == tokens  # no endpoint generated for it

    for bad in ("msg_0123", "RESP_abc"):
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(model=MODEL, input="x", previous_response_id=bad)
        assert bad in info.value.body["message"] and info.value.body["param"] == "response_id"
        with pytest.raises(openai.BadRequestError):
            c.responses.retrieve(bad)
    assert prompt_tokens(fleet) == tokens
    assert lookups(gw)["requests"] == after["requests"]  # a malformed id asks nobody


def test_holder_killed_then_restarted_gives_503_then_404_never_a_reroute(tmp_path: Path) -> None:
    with ExitStack() as stack:
        fleet = start_fleet(stack, 4, tmp_path, "k")
        gw = start_gateway(stack, fleet.endpoints, tmp_path)
        c = client(gw)
        conv = Conversation(0, stream=False)
        conv.step(c)
        conv.step(c)
        assert conv.turns[1].server == conv.home
        home_ep = fleet.endpoints[int(conv.home.removeprefix("k"))]
        others = [ep for ep in fleet.endpoints if ep != home_ep]
        server = fleet.servers[home_ep]
        tokens = prompt_tokens(fleet)
        rid = conv.last_id

        server.kill()
        seen: list[tuple[int, str]] = []
        envoy_503s: list[dict[str, str]] = []

        def follow_up(stream: bool = False) -> openai.APIStatusError | None:
            try:
                create(c, stream=stream, previous_response_id=rid, input="still there?",
                       instructions=instructions(0), tools=TOOLS)
            except openai.APIStatusError as exc:
                seen.append((exc.status_code, exc.body.get("message", "") if isinstance(exc.body, dict) else ""))
                if exc.status_code == 503 and "endpoint holding" not in seen[-1][1]:  # Envoy's own 503 (below)
                    envoy_503s.append(dict(exc.response.headers))
                return exc
            seen.append((200, ""))
            return None

        t_kill = time.monotonic()

        def named_503() -> openai.APIStatusError | None:
            exc = follow_up()
            return exc if exc is not None and exc.status_code == 503 and \
                "endpoint holding this response" in exc.body["message"] else None

        exc = until(named_503, 10.0, interval_s=0.1, message=lambda: f"the router's named 503 (seen: {seen})")
        assert rid not in exc.body["message"]  # the router's 503 names no id: its text reaches records
        t_named = time.monotonic() - t_kill
        assert exc.response.headers.get("retry-after") == "1"
        assert exc.body["param"] == "previous_response_id"
        assert isinstance(follow_up(stream=True), openai.InternalServerError)  # streamed: the same 503
        # Before the pool marked it down (its probes: ~1.5 s), Envoy could not connect and had no other endpoint to
        # try: its own 503 with Retry-After, having tried the holder alone; never an answer from another endpoint.
        assert all(s == 503 for s, _ in seen), seen
        assert all(h.get("retry-after") == "1" and h.get("x-gateway-destination-endpoint-served") == home_ep
                   for h in envoy_503s), envoy_503s
        # ... and that 503 itself made the pool probe the holder at once: the router's named 503 follows within
        # a fraction of a second, not after the scheduled probes (~1.5 s, 13-15 of Envoy's 503s before the fix).
        assert len(envoy_503s) <= 2 and t_named < 1.0, (len(envoy_503s), t_named)
        new_tokens = prompt_tokens_of(others)
        assert {ep: new_tokens[ep] for ep in others} == {ep: tokens[ep] for ep in others}

        server.spawn()  # same port, same id: an empty store
        server.wait_ready(20.0)
        t_up = time.monotonic()

        def named_404() -> openai.APIStatusError | None:
            exc = follow_up()
            return exc if exc is not None and exc.status_code == 404 else None

        exc = until(named_404, 10.0, interval_s=0.1, message=lambda: f"vLLM's 404 (seen: {seen})")
        assert isinstance(exc, openai.NotFoundError), seen
        assert rid in exc.body["message"] and exc.body["param"] == "response_id"
        t_404 = time.monotonic() - t_up
        assert isinstance(follow_up(stream=True), openai.NotFoundError)  # and stays so
        assert all(s in (503, 404) for s, _ in seen), seen  # never served, let alone elsewhere
        new_tokens = prompt_tokens_of(others)
        assert {ep: new_tokens[ep] for ep in others} == {ep: tokens[ep] for ep in others}
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(rid)
        print(f"holder killed: named 503 after {t_named:.2f} s ({len(envoy_503s)} of Envoy's 503 before); "
              f"restarted: 404 after {t_404:.2f} s; answers {[s for s, _ in seen]}")


def prompt_tokens_of(endpoints: list[str]) -> dict[str, float]:
    return prompt_tokens(Fleet(servers=dict.fromkeys(endpoints)))  # type: ignore[arg-type]


def test_without_telemetry_follow_ups_find_their_ids_from_the_facts(rig: tuple[Fleet, GatewayProcesses, Path],
                                                                   tmp_path: Path) -> None:
    """Telemetry off exports no span, but each response's facts still reach the router: the directory learns every
    Responses id from them, and no follow-up needs a lookup."""
    fleet, _, _ = rig
    gw = GatewayProcesses(GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, telemetry=False),
                          RoutingSettings(), PoolSettings(endpoints=tuple(fleet.endpoints)), log_dir=tmp_path)
    with gw:
        text = gw.config_path.read_text()  # type: ignore[union-attr]
        assert "prefixroute.facts" in text and "prefixroute.observe_responses" not in text
        c = client(gw)
        convs = [Conversation(100 + k, stream=k % 2 == 0) for k in range(4)]
        for _ in range(3):
            for conv in convs:
                conv.step(c)
        follow_ups = [(conv, t) for conv in convs for t in conv.turns[1:]]
        assert all(t.server == conv.home for conv, t in follow_ups)
        assert all(t.cached_tokens > 0 for _, t in follow_ups)
        m = lookups(gw)
        print(f"telemetry off: {len(follow_ups)} follow-ups, lookups {m}")
        assert m["hits"] == len(follow_ups) and m["found"] == m["not_found"] == m["failed"] == 0


def test_demo_traffic_agents_run_over_the_responses_api_through_the_gateway(
        rig: tuple[Fleet, GatewayProcesses, Path]) -> None:
    # `prefixroute traffic --workload agents` (what a user runs next to `prefixroute up` to watch agent
    # conversations on the dashboard): every turn served, the follow-ups pinned by the router's directory.
    import subprocess
    import sys

    fleet, gw, _ = rig
    before = metric_value(router_metrics(gw), "prefixroute_response_id_hits_total")
    out = subprocess.run([sys.executable, "-m", "prefixroute", "traffic", "--gateway", gw.url, "--workload", "agents",
                          "--requests-per-round", "24", "--rate-rps", "50", "--rounds", "1"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("traffic round 0:"))
    served, total = line.split(": ", 1)[1].split(" ok", 1)[0].split("/")
    assert int(total) >= 18 and served == total, line  # 4 agents x the bench's turns, every one served
    # Each agent's follow-ups (all but its first turn) found their response in the directory (a lookup or two
    # may race the observing stream under load).
    hits = metric_value(router_metrics(gw), "prefixroute_response_id_hits_total") - before
    assert hits >= int(total) - 4 - 2, (hits, line)
