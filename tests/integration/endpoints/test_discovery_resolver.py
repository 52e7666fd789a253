"""DnsDiscovery against a real DNS server on loopback (dnslib, UDP) through dnspython's asyncio resolver:
records added and removed are followed, an outage or an empty answer keeps the last known set."""

from __future__ import annotations

import asyncio

import pytest

from helpers.dns_server import LocalDns
from helpers.waiting import until_async
from prefixroute.extproc.endpoints.discovery import DnsDiscovery, make_resolver

pytestmark = pytest.mark.integration


NAME = "model-server.prefixroute.test"


@pytest.fixture
def dns():
    with LocalDns() as server:
        yield server


def _discovery(dns: LocalDns, seen: list[list[str]], *names: str, static=()) -> DnsDiscovery:
    return DnsDiscovery(names or (f"{NAME}:8000",), seen.append, static=static, interval_s=0.05,
                        resolver=make_resolver([dns.address], timeout_s=0.3))


async def test_follows_records_added_and_removed(dns):
    seen: list[list[str]] = []
    d = _discovery(dns, seen)
    dns.set(NAME, "10.0.0.2", "10.0.0.1")
    assert await d.refresh()
    assert seen == [["10.0.0.1:8000", "10.0.0.2:8000"]]  # sorted: the DNS server's order does not matter
    dns.set(NAME, "10.0.0.1", "10.0.0.2", "10.0.0.3")  # a pod came
    assert await d.refresh()
    dns.set(NAME, "10.0.0.3", "10.0.0.1")  # another went
    assert await d.refresh()
    assert not await d.refresh()  # no change: no call
    assert seen[1:] == [["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"], ["10.0.0.1:8000", "10.0.0.3:8000"]]


async def test_a_and_aaaa_records_both_count(dns):
    seen: list[list[str]] = []
    d = _discovery(dns, seen)
    dns.set(NAME, "10.0.0.1", "fd00::7")
    await d.refresh()
    assert seen == [["10.0.0.1:8000", "[fd00::7]:8000"]]


@pytest.mark.parametrize("mode", ["drop", "servfail"])
async def test_an_outage_keeps_the_last_known_set(dns, mode):
    seen: list[list[str]] = []
    d = _discovery(dns, seen)
    dns.set(NAME, "10.0.0.1", "10.0.0.2")
    await d.refresh()
    dns.mode = mode
    assert not await d.refresh()
    assert d.endpoints == ["10.0.0.1:8000", "10.0.0.2:8000"] and d.num_failures == 1
    dns.mode = "answer"
    dns.set(NAME, "10.0.0.2")
    assert await d.refresh()  # back: followed again
    assert seen[-1] == ["10.0.0.2:8000"]


@pytest.mark.parametrize("empty", ["nxdomain", "no-records"])
async def test_an_empty_answer_keeps_the_last_known_set_then_the_next_answer_wins(dns, empty):
    seen: list[list[str]] = []
    d = _discovery(dns, seen)
    dns.set(NAME, "10.0.0.1", "10.0.0.2")
    await d.refresh()
    if empty == "nxdomain":
        dns.records.clear()
    else:
        dns.set(NAME)  # the name exists with no address: every pod of the headless Service not ready
    assert not await d.refresh()
    assert d.endpoints == ["10.0.0.1:8000", "10.0.0.2:8000"] and d.num_empty == 1
    dns.set(NAME, "10.0.0.8", "10.0.0.9")  # scaled back up on new pods: they replace the old ones
    assert await d.refresh()
    assert seen[-1] == ["10.0.0.8:8000", "10.0.0.9:8000"]


async def test_before_any_answer_a_name_gives_nothing_and_static_endpoints_stay_first(dns):
    seen: list[list[str]] = []
    other = "prefill.prefixroute.test"
    d = _discovery(dns, seen, f"{NAME}:8000", f"{other}:9000", static=["127.0.0.1:7000"])
    await d.refresh()
    assert seen == [["127.0.0.1:7000"]]
    dns.set(other, "10.0.1.1")
    dns.set(NAME, "10.0.0.1", "10.0.1.1")  # one address under two names and ports: two endpoints
    await d.refresh()
    assert seen[-1] == ["127.0.0.1:7000", "10.0.0.1:8000", "10.0.1.1:8000", "10.0.1.1:9000"]


async def test_rounds_run_in_the_background_until_closed(dns):
    seen: list[list[str]] = []
    d = _discovery(dns, seen)
    dns.set(NAME, "10.0.0.1")
    await d.refresh()
    d.start()
    dns.set(NAME, "10.0.0.1", "10.0.0.5")
    await until_async(lambda: len(seen) == 2, 2, interval_s=0.02, message=lambda: seen)
    assert seen[-1] == ["10.0.0.1:8000", "10.0.0.5:8000"]
    await d.close()
    queries = dns.num_queries
    await asyncio.sleep(0.2)  # lets time pass on purpose: no query may come meanwhile
    assert dns.num_queries == queries  # stopped
