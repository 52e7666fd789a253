"""Forged ext_proc streams (issue 11, finding 2): real Envoy + real `prefixroute extproc` + 4 real simulated
servers, and an attacker that reaches the ext_proc port with a raw gRPC client.

The attacker opens, in a loop while victims send requests through Envoy:
- observing streams (``observability_mode``) with made-up traceparents reporting a served endpoint;
- routing streams of its own: it gets a real pick (and the router's traceparent) back, then reports a
  "served" endpoint that is outside its pick, or the pick's last fallback (what Envoy's retry would report),
  on the routing stream itself or on an observing stream carrying the stolen traceparent.
Before the fix each report marked endpoints down (victims got 503 or moved off their prefix's endpoint);
now none of them marks a live endpoint down, and every victim is served where its prefix lives.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import itertools
import os
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import orjson
import pytest

from prefixroute.extproc import wire
from prefixroute.extproc.headers import DESTINATION_HEADER, SERVED_HEADER, TRACEPARENT_HEADER, fallback_header

from helpers.fleet import MODEL, start_fleet, start_gateway
from helpers.procs import free_port

pytestmark = pytest.mark.integration

SERVER_ID = "x-prefixroute-server-id"
SYSTEM_PROMPT = ("You are a meticulous assistant for the prefixroute project. " * 60).strip()


def request(gw: object, body: dict) -> tuple[int, dict[str, str], bytes]:
    host, port = gw.url.removeprefix("http://").split(":")  # type: ignore[attr-defined]
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=orjson.dumps(body),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def chat(system: str, user: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}


def _headers(pairs: dict[str, str]) -> object:
    return wire.HeaderMap(headers=[wire.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def _set_headers(resp: object) -> dict[str, str]:
    common = resp.request_body.response  # type: ignore[attr-defined]
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


class Attacker:
    """Forged streams against the ext_proc port until stopped (a thread with its own event loop). It holds the
    gateway's bearer token: the worst case, someone who got past the port's authentication (without the token
    every stream is refused: test_gateway_hardening_extproc_auth.py), so the trust rule itself is tested."""

    def __init__(self, port: int, endpoints: list[str], token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.port = port
        self.endpoints = endpoints
        self.stop = threading.Event()
        self.num_reports = 0
        self.num_refused = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _observe(self, process: object, traceparent: str, served: str) -> None:
        call = process()  # type: ignore[operator]
        await call.write(wire.ProcessingRequest(observability_mode=True, request_headers=wire.HttpHeaders(
            headers=_headers({":method": "POST", ":path": "/v1/chat/completions", TRACEPARENT_HEADER: traceparent}))))
        await call.write(wire.ProcessingRequest(observability_mode=True, response_headers=wire.HttpHeaders(
            headers=_headers({":status": "200", SERVED_HEADER: served}), end_of_stream=True)))
        await call.done_writing()
        await call.code()  # the service ends the RPC once the response is complete
        self.num_reports += 1

    async def _route_and_report(self, process: object, i: int) -> None:
        call = process()  # type: ignore[operator]
        await call.write(wire.ProcessingRequest(request_headers=wire.HttpHeaders(headers=_headers(
            {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}))))
        await call.read()
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"attack {i} " * 40}]})
        await call.write(wire.ProcessingRequest(request_body=wire.HttpBody(body=body, end_of_stream=True)))
        resp = await call.read()
        if resp.HasField("immediate_response"):  # the router refused (every endpoint down: the attack worked)
            self.num_refused += 1
            await call.done_writing()
            return
        routed = _set_headers(resp)
        pick = [routed[DESTINATION_HEADER], routed[fallback_header(1)], routed[fallback_header(2)]]
        outsider = next(ep for ep in self.endpoints if ep not in pick)
        served = (outsider, pick[-1])[i % 2]
        if (i // 2) % 2 == 0:  # on the routing stream itself (as with report_served and no observing filter)
            await call.write(wire.ProcessingRequest(response_headers=wire.HttpHeaders(
                headers=_headers({":status": "200", SERVED_HEADER: served}))))
            await call.read()
            self.num_reports += 1
        else:  # on an observing stream carrying the traceparent the router gave this pick
            await self._observe(process, routed[TRACEPARENT_HEADER], served)
        await call.done_writing()
        await call.code()

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            process = functools.partial(wire.process_call(channel), metadata=self.metadata)
            for i in itertools.count():
                if self.stop.is_set():
                    return
                try:
                    await self._route_and_report(process, i)
                    for ep in self.endpoints:  # and blind observing streams with made-up keys
                        await self._observe(process, f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01", ep)
                except grpc.aio.AioRpcError as exc:
                    self.errors.append(repr(exc)[:200])
                await asyncio.sleep(0.002)  # the attack's pace


def test_forged_streams_mark_no_endpoint_down_and_victims_stay_on_their_endpoint(stack: ExitStack, log_dir: Path,
                                                                                  monkeypatch) -> None:
    # Traces on (an OTLP endpoint configured; nothing needs to listen there): the router then gives each pick
    # a traceparent, the key of the observing streams this attack forges. Without an endpoint traces are off.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    fleet = start_fleet(stack, 4, log_dir, prefix="v")
    # The victim's requests come one at a time, so the time model keeps them on the holder: its prefix moves
    # only if its endpoint is marked down (the attack's aim).
    gw = start_gateway(stack, fleet.endpoints, log_dir)
    victim_prompt = "Victim tenant. " + SYSTEM_PROMPT
    status, headers, body = request(gw, chat(victim_prompt, "warm up"))
    assert status == 200, body
    home = headers[SERVER_ID]

    attacker = Attacker(gw.extproc_port, fleet.endpoints, gw.auth_token)
    attacker.thread.start()
    results: list[tuple[int, str]] = []
    try:
        deadline = time.monotonic() + 4.0
        i = 0
        while time.monotonic() < deadline:
            status, headers, body = request(gw, chat(victim_prompt, f"q{i}"))
            results.append((status, headers.get(SERVER_ID, body[:200].decode(errors="replace"))))
            i += 1
            time.sleep(0.05)  # the victim's pace, over the 4 s the attack runs (time passes on purpose)
    finally:
        attacker.stop.set()
        attacker.thread.join(timeout=30)
    failed = [r for r in results if r[0] != 200]
    assert not failed, (len(failed), len(results), failed[:3])
    assert attacker.num_reports > 100, (attacker.num_reports, attacker.errors[:3])  # the attack really ran
    assert len(results) >= 20 and attacker.num_refused == 0
    assert {who for _, who in results} == {home}, [(k, len(list(g))) for k, g in itertools.groupby(w for _, w in results)]
    log = (log_dir / "extproc.log").read_text()
    assert "marked down" not in log and "is down" not in log, log[-2000:]
