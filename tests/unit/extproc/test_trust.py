"""What a client cannot set or claim (extproc/tenants.py, service.py, response_directory.py, envoy_facts.py): its own
tenant, priority or flow (only the operator's table and the headers a trusted ingress sets count), someone else's
response id (a report never rebinds an id, a pick has one id), and what a record says of a stream the client cut.
Each case here failed on the code before (named in its comments)."""

from __future__ import annotations

import hashlib
import json

import orjson
import pytest

from helpers.facts_records import export, record
from helpers.peers import StaticPool
from prefixroute.extproc.envoy_facts import CLIENT_CUT_ERROR, FactsReceiver, facts_of
from prefixroute.extproc.facts_fields import OBSERVED_FACTS
from prefixroute.extproc.headers import OBSERVED_METADATA
from prefixroute.extproc.response_directory import ResponsesCollector
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.service import PoolRouter
from prefixroute.extproc.tenants import (DEFAULT_FLOW, Client, TenantSettings, TenantTable, Tenants, bearer_key,
                                         key_digest)
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.types import EndpointId

KEY_A, KEY_B = "sk-acme-0123456789", "sk-batch-9876543210"
TABLE = {"api_keys": {key_digest(KEY_A): {"tenant": "acme", "priority": 10},
                      key_digest(KEY_B): {"tenant": "batch-co"}},
         "tenants": {"batch-co": {"priority": -1}, "ingress-named": {"priority": 3}}}
ADDRESS = {"x-gateway-inference-fairness-id": "address:10.1.2.3"}  # what prefixroute's Envoy sets


def _tenants(**kw) -> Tenants:  # noqa: ANN003
    return Tenants(TenantSettings(**kw), table=TenantTable.from_mapping(TABLE))


# --- who sent it ------------------------------------------------------------------------------------------------
def test_the_tables_keys_are_sha256_digests_as_sha256sum_prints_them() -> None:
    assert key_digest(KEY_A) == hashlib.sha256(KEY_A.encode()).hexdigest()
    assert bearer_key("Bearer  sk-x ") == "sk-x" and bearer_key("bearer sk-x") == "sk-x"
    assert bearer_key("Basic dXNlcg==") is None and bearer_key("Bearer ") is None and bearer_key(None) is None


@pytest.mark.parametrize("data", [
    {"api_keys": {KEY_A: {"tenant": "acme"}}},  # a raw key: refused, the file must never hold one
    {"api_keys": {key_digest(KEY_A): {"priority": 3}}},  # no tenant
    {"api_keys": {key_digest(KEY_A): {"tenant": "a", "priority": "high"}}},
    {"tenants": {"a": {"priority": True}}},
    {"keys": {}},  # a misspelt section would grant nothing, silently
    [],
])
def test_a_table_that_would_grant_nothing_or_hold_a_raw_key_does_not_start(data) -> None:
    with pytest.raises(ValueError):
        TenantTable.from_mapping(data)


def test_a_tenants_file_is_loaded(tmp_path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(TABLE))
    t = Tenants(TenantSettings(tenants_file=str(path)))
    assert t.resolve({"authorization": f"Bearer {KEY_A}"}) == Client("acme", 10, "tenant:acme")
    with pytest.raises(OSError):
        Tenants(TenantSettings(tenants_file=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError):
        TenantSettings(trusted_headers=("fairness", "prioritee"))


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, Client(None, None, DEFAULT_FLOW)),
    (ADDRESS, Client(None, None, "address:10.1.2.3")),
    ({**ADDRESS, "authorization": f"Bearer {KEY_A}"}, Client("acme", 10, "tenant:acme")),
    ({**ADDRESS, "authorization": f"Bearer {KEY_B}"}, Client("batch-co", -1, "tenant:batch-co")),  # the tenant's
    # An unknown key names nobody (anyone can invent keys): the client stays its address's flow.
    ({**ADDRESS, "authorization": "Bearer sk-invented-1"}, Client(None, None, "address:10.1.2.3")),
    # A client's own scheduling headers set nothing (main: priority 1000, its own flow, its own tenant).
    ({**ADDRESS, "x-prefixroute-priority": "1000", "x-prefixroute-tenant": "acme",
      "x-gateway-inference-objective": "critical"}, Client(None, None, "address:10.1.2.3")),
])
def test_only_the_table_and_the_gateways_address_count_by_default(headers, expected) -> None:
    assert _tenants().resolve(headers) == expected


def test_behind_a_trusted_ingress_its_headers_count() -> None:
    t = _tenants(trusted_headers=("tenant", "priority", "fairness"))
    assert t.resolve({"x-prefixroute-tenant": "ingress-named"}) == Client("ingress-named", 3, "tenant:ingress-named")
    assert t.resolve({"x-prefixroute-tenant": "ingress-named", "x-prefixroute-priority": "7"}).priority == 7
    assert t.resolve({"x-gateway-inference-fairness-id": "team-x"}).flow == "team-x"
    assert _tenants(trusted_headers=()).resolve(ADDRESS).flow == DEFAULT_FLOW  # nothing trusted: one flow


def test_a_client_rotating_ids_keys_or_tenant_names_stays_one_flow() -> None:
    t = _tenants()
    flows = {t.resolve({**ADDRESS, "authorization": f"Bearer sk-{i}", "x-prefixroute-tenant": f"t{i}"}).flow
             for i in range(1000)}
    assert flows == {"address:10.1.2.3"}


def test_the_parser_sees_the_trusted_tenant_only() -> None:
    t = _tenants()
    plain = {"content-type": "application/json"}
    assert t.parse_headers(plain) is plain  # nothing to change: no copy
    assert "x-prefixroute-tenant" not in t.parse_headers({**plain, "x-prefixroute-tenant": "acme"})
    assert t.parse_headers({"authorization": f"Bearer {KEY_A}"})["x-prefixroute-tenant"] == "acme"


EPS = (EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000"))


def _router(tenants: Tenants | None = None) -> PoolRouter:
    return PoolRouter(RouterCore(RoutingSettings(num_fallbacks=1)), StaticPool(EPS), tenants=tenants)


CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "the same long prompt " * 100}]})


def test_a_clients_tenant_header_does_not_choose_its_cache_namespace() -> None:
    router = _router()
    own = router.route("POST", "/v1/chat/completions", {}, CHAT)
    forged = router.route("POST", "/v1/chat/completions", {"x-prefixroute-tenant": "victim-co"}, CHAT)
    assert forged.request.tenant is None  # main: "victim-co", its hashes salted as that tenant's
    assert forged.request.block_hashes == own.request.block_hashes
    keyed = _router(_tenants()).route("POST", "/v1/chat/completions", {"authorization": f"Bearer {KEY_A}"}, CHAT)
    assert keyed.request.tenant == "acme" and keyed.request.block_hashes != own.request.block_hashes


# --- response ids -----------------------------------------------------------------------------------------------
def test_a_report_cannot_move_someone_elses_response_id() -> None:
    router = _router()
    victim = router.route("POST", "/v1/responses", {}, orjson.dumps({"model": "m", "input": "victim"}))
    assert router.learn_response(victim, "resp_victim", victim.endpoints[0])
    held = router.responses.endpoint_of("resp_victim")
    other = next(ep for ep in EPS if ep != held)
    attacker = router.route("POST", "/v1/responses", {}, orjson.dumps({"model": "m", "input": "x" * 3000}))
    # Its own pick, served elsewhere, claiming the victim's id (a forged record; main overwrote the entry, and the
    # victim's next turn went to an endpoint without the response: 404 for an hour).
    assert not router.learn_response(attacker, "resp_victim", other)
    assert router.responses.endpoint_of("resp_victim") == held
    # A pick has one response id: a second, different claim for it is refused too.
    assert router.learn_response(attacker, "resp_attacker", attacker.endpoints[0])
    assert not router.learn_response(attacker, "resp_other", attacker.endpoints[0])
    assert router.responses.holder("resp_other") is None and router.responses.num_refused == 2
    text = "".join(str(s) for fam in ResponsesCollector(router.responses, router.lookup).collect()
                   for s in fam.samples if fam.name == "prefixroute_response_id_claims_refused")
    assert "value=2" in text


async def test_a_facts_record_naming_another_requests_id_is_refused_end_to_end() -> None:
    """FactsReceiver.apply -> PoolRouter.learn_response -> ResponseDirectory: the record of the attacker's own
    request (its span id known to it, as an echoed traceparent made it) names the victim's id."""
    router = _router()
    out = []
    t = RequestTracker(lambda d, us: None, out.append, router.endpoint_of, on_first_token=router.first_token,
                       on_usage=router.usage, on_response_id=router.learn_response, propagate=False)
    rx = FactsReceiver(t, router.served)

    def request(text: str):  # noqa: ANN202
        st, tp = t.begin({":path": "/v1/responses"}, lambda: [(OBSERVED_METADATA, OBSERVED_FACTS)])
        pick = router.route("POST", "/v1/responses", {}, orjson.dumps({"model": "m", "input": text}))
        t.decided(st, pick)
        t.routing_closed(st)
        return pick, tp

    victim, vtp = request("victim")
    rx.export(export(record(vtp, upstream=victim.endpoints[0], response_id="resp_victim",
                            ctype="application/json")))
    held = router.responses.endpoint_of("resp_victim")
    attacker, atp = request("attacker " * 400)
    other = next(a for a in attacker.endpoints if router.endpoint_of(a) != held)
    rx.export(export(record(atp, upstream=other, response_id="resp_victim", ctype="application/json")))
    assert router.responses.endpoint_of("resp_victim") == held and router.responses.num_refused == 1


# --- a stream the client cut ------------------------------------------------------------------------------------
async def test_a_stream_the_client_cut_is_recorded_as_cut() -> None:
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    assert facts_of(record(tp, flags="DC")).client_cut and facts_of(record(tp, flags="UF,DC")).client_cut
    assert not facts_of(record(tp, flags="-")).client_cut and not facts_of(record(tp)).client_cut
    # The response's own end had passed Envoy's facts filter ([DONE]): the client had its whole answer.
    assert not facts_of(record(tp, flags="DC", complete="1")).client_cut
    assert facts_of(record(tp, flags="DC", complete="-")).client_cut
    router = _router()
    out = []
    t = RequestTracker(lambda d, us: None, out.append, router.endpoint_of, on_first_token=router.first_token,
                       on_usage=router.usage, on_response_id=router.learn_response, propagate=False)
    rx = FactsReceiver(t, router.served)
    st, tp = t.begin({":path": "/v1/responses"}, lambda: [(OBSERVED_METADATA, OBSERVED_FACTS)])
    pick = router.route("POST", "/v1/responses", {}, orjson.dumps({"model": "m", "input": "hi", "stream": True}))
    t.decided(st, pick)
    t.routing_closed(st)
    rx.export(export(record(tp, upstream=pick.endpoints[0], flags="DC", usage="-")))
    # main: status 200 and no error, counted a success
    assert out[0].status == 200 and out[0].error == CLIENT_CUT_ERROR and out[0].is_error
