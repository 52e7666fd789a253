"""prefixroute as a drop-in GIE endpoint picker, through real Envoy with GIE's own reference configuration
(extproc/gie_reference.yaml, from GIE's repository at the commit it names; adapted only in addresses, ports and,
for FailOpen, failure_mode_allow) beside our own configuration, in front of the same picker and servers.

One module-scoped fleet: 3 simulated servers (sized for a 1 MB prompt), one picker (`prefixroute extproc`, protocol
auto: each stream says which protocol it speaks; TLS, as GIE's configuration reaches its picker; traces off), and
three Envoys on it: GIE's reference failing closed (GIE's default), the same failing open, and ours (rendered by
envoy_config, no observing filter). A second picker, with GIE's comma fallback list, sits behind an "override-host"
Envoy (tests/helpers/gie.py: Envoy's override_host load balancing over the pool, served endpoint reported in
metadata, a subset hint). Requests compare answer for answer: status, body bytes (ids and timestamps aside),
streamed events.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.fleet import MODEL, Fleet, start_fleet
from helpers.gie import Envoy, new_ports, override_host, start_envoy
from helpers.tls import make_pki
from helpers.waiting import until
from prefixroute.extproc import gie_reference
from prefixroute.extproc.envoy_config import EnvoySettings, render
from prefixroute.procs import ManagedProcess, ProcessGroup, free_ports, http_get, prefixroute_argv, tcp_open

pytestmark = pytest.mark.timeout(240)
SERVER_ARGS = ("--max-model-len", "400000", "--num-gpu-blocks", "40000")  # a 1 MB prompt is ~262k tokens


@dataclass
class Gie:
    fleet: Fleet
    picker: ManagedProcess
    picker_metrics_port: int
    fail_close: Envoy
    fail_open: Envoy
    ours: Envoy
    override: Envoy
    override_picker: ManagedProcess
    override_metrics_port: int


def _picker(group: ProcessGroup, name: str, endpoints: list[str], pki, *extra: str) -> tuple[ManagedProcess, int, int]:  # noqa: ANN001
    port, metrics, health = free_ports(3)
    proc = group.add(ManagedProcess(name, prefixroute_argv(
        "extproc", "--port", str(port), "--listen-address", "127.0.0.1", "--metrics-port", str(metrics),
        "--health-port", str(health), "--endpoints", ",".join(endpoints), "--tls-cert-file", str(pki.server_cert),
        "--tls-key-file", str(pki.server_key), "--no-traces", *extra),
        log_path=group.log_dir / f"{name}.log", ready=lambda: tcp_open(port), ports=(port, metrics, health)),
        wait=False)
    return proc, port, metrics


@pytest.fixture(scope="module")
def gie(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gie]:
    log_dir = tmp_path_factory.mktemp("gie")
    pki = make_pki(log_dir / "pki")
    with ExitStack() as stack:
        fleet = start_fleet(stack, 3, log_dir, "g", *SERVER_ARGS, admin=True)
        group = stack.enter_context(ProcessGroup(log_dir, ready_timeout_s=30.0))
        eps = fleet.endpoints
        picker, port, metrics = _picker(group, "picker", eps, pki)
        override_picker, port2, metrics2 = _picker(group, "picker-list", eps, pki, "--gie-fallback-list")
        group.wait_ready()
        reference = gie_reference.load()
        envoys = {}
        for name, fail_open in (("fail-close", False), ("fail-open", True)):
            ports = new_ports()
            envoys[name] = start_envoy(group, name, gie_reference.adapt(reference, ports, f"127.0.0.1:{port}",
                                                                        fail_open=fail_open), ports, log_dir)
        ports = new_ports()
        envoys["override"] = start_envoy(group, "override", override_host(
            gie_reference.adapt(reference, ports, f"127.0.0.1:{port2}"), eps, subset=eps[:2]), ports, log_dir)
        ports = new_ports()
        ours = EnvoySettings(gateway_port=ports.gateway, listen_address="127.0.0.1", admin_port=ports.admin,
                             extproc_address=f"127.0.0.1:{port}", extproc_tls_ca_file=str(pki.ca_cert),
                             endpoints=tuple(eps), response_facts_lua=False)
        import yaml

        envoys["ours"] = start_envoy(group, "ours", yaml.safe_load(render(ours)), ports, log_dir)
        group.wait_ready()
        yield Gie(fleet, picker, metrics, envoys["fail-close"], envoys["fail-open"], envoys["ours"],
                  envoys["override"], override_picker, metrics2)


# --- requests ----------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def server(self) -> str:
        return self.headers.get("x-prefixroute-server-id", "")

    def events(self) -> list[bytes]:
        return [e for e in self.body.split(b"\n\n") if e.strip()]

    def usage(self) -> dict:
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            for e in reversed(self.events()):
                if e.startswith(b"data: {") and b'"usage"' in e:
                    return json.loads(e[6:])["usage"]
            return {}
        return json.loads(self.body).get("usage") or {}


def post(envoy: Envoy, path: str, payload: dict, timeout_s: float = 60.0) -> Answer:
    req = urllib.request.Request(envoy.url + path, data=json.dumps(payload).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return Answer(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())
    except OSError as exc:
        return Answer(0, {}, repr(exc).encode())


def chat(text: str, *, stream: bool = False, max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _normalised(answer: Answer) -> list:
    """The answer without what differs between two identical requests: ids, timestamps, cache hits."""
    def clean(obj: dict) -> dict:
        obj = {k: v for k, v in obj.items() if k not in ("id", "created")}
        if isinstance(obj.get("data"), list):  # a model list: each model's `created` is the second it was asked
            obj["data"] = [{k: v for k, v in d.items() if k != "created"} if isinstance(d, dict) else d
                           for d in obj["data"]]
        if isinstance(obj.get("usage"), dict):
            obj["usage"] = {k: v for k, v in obj["usage"].items() if k != "prompt_tokens_details"}
        return obj

    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        return [clean(json.loads(e[6:])) if e.startswith(b"data: {") else e for e in answer.events()]
    return [clean(json.loads(answer.body))]


def _text(n: int, seed: str) -> str:
    words = " ".join(f"{seed}{i}" for i in range(n // 5 + 10))
    return words[:n]


def _served_count(metrics_port: int, endpoint: str) -> float:
    """prefixroute_requests_total of `endpoint` (the endpoint that served, as the picker learned it)."""
    text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")[1].decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("prefixroute_requests_total{") and f'endpoint="{endpoint}"' in line)


# --- tests --------------------------------------------------------------------------------------------------------
def test_envoys_health_check_finds_the_picker_healthy(gie: Gie) -> None:
    """GIE's reference configuration health-checks the picker (grpc.health.v1, service
    envoy.service.ext_proc.v3.ExternalProcessor, over TLS): without it Envoy reaches the picker only in panic."""
    for envoy in (gie.fail_close, gie.fail_open):
        until(lambda: envoy.extproc_health() == ["healthy"], 15, interval_s=0.2, message=envoy.clusters)


@pytest.mark.parametrize(("size", "stream"), [(200, False), (200, True), (48 * 1024, False), (48 * 1024, True),
                                              (1024 * 1024, False)])
def test_answers_through_gies_reference_match_our_own_configuration(gie: Gie, size: int, stream: bool) -> None:
    """Plain, streamed, 48 KB (several body chunks through Envoy's 32 KiB buffers) and 1 MB prompts: the same
    status, body and events through GIE's reference configuration as through ours."""
    received = set(gie.fleet.received_traceparents())
    payload = chat(_text(size, f"s{size}{stream}x"), stream=stream)
    ours = post(gie.ours, "/v1/chat/completions", payload)
    theirs = post(gie.fail_close, "/v1/chat/completions", payload)
    assert (ours.status, theirs.status) == (200, 200), (ours.body[:300], theirs.body[:300])
    assert _normalised(theirs) == _normalised(ours)
    assert len(theirs.events()) == len(ours.events())
    assert theirs.usage()["prompt_tokens"] == ours.usage()["prompt_tokens"] > size // 8
    # Nothing of ours went upstream: traces are off, so no traceparent reached a server (its admin listener lists
    # what it received).
    assert set(gie.fleet.received_traceparents()) == received


def _raw(envoy: Envoy, method: str, path: str, body: bytes | None) -> Answer:
    req = urllib.request.Request(envoy.url + path, data=body, method=method,
                                 headers={"content-type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return Answer(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("GET", "/v1/models", None, 200),  # no body: decided at the request headers
    ("POST", "/v1/chat/completions", b'{"model": "m", "messages": [', 400),  # the router's refusals
    ("POST", "/v1/chat/completions", b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
     404),
    ("POST", "/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "one two", "max_tokens": 2}', 200),
])
def test_bodyless_requests_and_refusals_match_our_own_configuration(gie: Gie, method: str, path: str,
                                                                    body: bytes | None, status: int) -> None:
    ours, theirs = _raw(gie.ours, method, path, body), _raw(gie.fail_close, method, path, body)
    assert ours.status == theirs.status == status, (ours, theirs)
    assert theirs.headers.get("content-type", "").startswith("application/json")
    if status >= 400:  # the router's own OpenAI-format error, through GIE's Envoy as through ours
        assert json.loads(theirs.body) == json.loads(ours.body) and set(json.loads(theirs.body)["error"]) == {
            "message", "type", "param", "code"}
    else:
        assert _normalised(theirs) == _normalised(ours)


def test_affinity_on_repeats_equals_our_own_configuration(gie: Gie) -> None:
    """Each of 6 long prefixes sent 3 times: every repeat lands where its prefix is cached, through GIE's reference
    configuration as through ours (distinct prefixes per configuration, so neither rides on the other's picks)."""
    hit: dict[str, list[float]] = {}
    for name, envoy in (("ours", gie.ours), ("gie", gie.fail_close)):
        ratios = []
        for k in range(6):
            prefix = _text(8000, f"aff{name}{k}p")
            answers = [post(envoy, "/v1/chat/completions", chat(prefix + f" question {r}")) for r in range(3)]
            assert [a.status for a in answers] == [200, 200, 200]
            assert len({a.server for a in answers}) == 1, [a.server for a in answers]
            ratios += [a.usage()["prompt_tokens_details"]["cached_tokens"] / a.usage()["prompt_tokens"]
                       for a in answers[1:]]
        hit[name] = ratios
    assert min(hit["gie"]) > 0.9 and sum(hit["gie"]) >= sum(hit["ours"]) - 1e-9, hit


def test_responses_follow_ups_reach_the_endpoint_holding_the_response(gie: Gie) -> None:
    """The picker learns a response id from the response body its own stream passes back (no observing filter in
    GIE's configuration) and pins the follow-up to the server that stored it."""
    for stream in (False, True):
        first = post(gie.fail_close, "/v1/responses", {"model": MODEL, "input": _text(3000, f"resp{stream}"),
                                                       "max_output_tokens": 4, "store": True, "stream": stream})
        assert first.status == 200, first.body[:300]
        match = re.search(rb'"id"\s*:\s*"(resp[^"]+)"', first.body)
        assert match is not None
        for _ in range(3):
            follow = post(gie.fail_close, "/v1/responses", {"model": MODEL, "input": "and then?", "max_output_tokens": 4,
                                                            "previous_response_id": match.group(1).decode()})
            assert follow.status == 200, follow.body[:300]
            assert follow.server == first.server


def test_a_gateway_walking_gies_fallback_list_fails_over_and_reports_the_served_endpoint(gie: Gie) -> None:
    """The override-host gateway: the picker (with --gie-fallback-list) names 'primary,fallback,...' in envoy.lb
    metadata, only inside the gateway's subset (servers 0 and 1); with server 0 down, Envoy's retries take the next
    address, and the served endpoint comes back in metadata_context."""
    eps = gie.fleet.endpoints
    subset_ids = {"g0", "g1"}
    base = sum(_served_count(gie.override_metrics_port, ep) for ep in eps)
    answers = [post(gie.override, "/v1/chat/completions", chat(_text(2000, f"sub{k}x"))) for k in range(8)]
    assert all(a.status == 200 for a in answers) and {a.server for a in answers} <= subset_ids
    # The picker files a request under its served endpoint when the response's end reaches it, which can be
    # after the client has its answer: let this batch settle before the baseline, or a late one counts below.
    until(lambda: sum(_served_count(gie.override_metrics_port, ep) for ep in eps) - base >= 8, 5, interval_s=0.1,
          message="the first 8 requests filed")
    before = {ep: _served_count(gie.override_metrics_port, ep) for ep in eps}
    down = gie.fleet.servers[eps[0]]
    down.kill()
    try:
        # Prefixes cached on server 0: each now served by its fallback, inside the subset.
        answers = [post(gie.override, "/v1/chat/completions", chat(_text(2000, f"sub{k}x"))) for k in range(8)]
        assert [a.status for a in answers] == [200] * 8
        assert {a.server for a in answers} == {"g1"}
        # The picker filed every one under the endpoint the gateway reported in metadata, not the primary it
        # named (some of them server 0's).
        until(lambda: _served_count(gie.override_metrics_port, eps[1]) - before[eps[1]] >= 8, 5, interval_s=0.1,
              message="8 requests filed under the served endpoint")
        assert _served_count(gie.override_metrics_port, eps[1]) - before[eps[1]] == 8
        assert _served_count(gie.override_metrics_port, eps[0]) == before[eps[0]]
    finally:
        gie.fleet.servers[eps[0]].spawn()
        gie.fleet.servers[eps[0]].wait_ready(20)


def test_picker_down_fails_as_gies_failure_mode_says_and_a_restarted_picker_serves_again(gie: Gie) -> None:
    """FailClose (GIE's default): Envoy answers 500 itself. FailOpen: the request goes on without a destination,
    which GIE's reference ORIGINAL_DST cluster cannot route (503), or, when Envoy had already streamed the body to
    the dead picker before the stream failed, Envoy fails it closed all the same (500: Envoy 1.40 ignores
    failure_mode_allow once a FULL_DUPLEX_STREAMED body has gone out; which one is a race inside Envoy). Served
    either way: never (gateways with a pool to fall back on route it; our own configuration fails open to round
    robin). A restarted picker replica: both route again, and Envoy's health check finds it healthy again."""
    payload = chat("picker down " + _text(500, "pd"))
    assert post(gie.fail_close, "/v1/chat/completions", payload).status == 200
    gie.picker.stop()
    try:
        closed = post(gie.fail_close, "/v1/chat/completions", payload)
        opened = post(gie.fail_open, "/v1/chat/completions", payload)
        assert closed.status == 500 and opened.status in (500, 503), (closed, opened)
        assert not opened.server  # no model server answered
        ours = post(gie.ours, "/v1/chat/completions", payload)
        assert ours.status == 200  # our configuration: fail-open round robin
    finally:
        gie.picker.spawn()
        gie.picker.wait_ready(30)
    for envoy in (gie.fail_close, gie.fail_open):
        until(lambda: post(envoy, "/v1/chat/completions", payload).status == 200, 20, interval_s=0.2,
              message="a 200 through the restarted picker")
        assert envoy.extproc_health() == ["healthy"]
    status, text = http_get(f"http://127.0.0.1:{gie.picker_metrics_port}/metrics")
    assert status == 200 and b'endpoint="none"' not in text


def test_overhead_bench_measures_gie_mode_beside_ours() -> None:
    """`prefixroute overhead-bench --gie`: GIE's reference Envoy in front of a picker in GIE mode, in the same rounds
    as our own gateway; its rows and the GIE/ours ratio line are printed (figures: docs/benchmarks.md, GIE mode)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "prefixroute", "overhead-bench", "--gie", "--mode", "latency",
                        "--prompt-kb", "4", "--num-requests", "30", "--num-rounds", "1", "--num-connections", "4",
                        "--rate-duration-s", "0.3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {line.split()[2]: line.split()[3:] for line in r.stdout.splitlines() if line.strip().startswith("4 KB")}
    assert {"baseline", "routed", "gie", "added", "gie/routed"} <= set(rows)
    assert float(rows["gie"][2]) > 0  # requests per second through GIE's configuration, all 200
    assert "non-200" not in r.stdout
