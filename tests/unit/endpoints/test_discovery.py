"""Endpoint discovery from DNS: its names and nameservers are validated, and its settings (discovery against a
real DNS server: tests/integration/endpoints/test_discovery_resolver.py)."""

from __future__ import annotations

import pytest

from prefixroute.extproc.endpoints.discovery import discovery_from_settings, parse_dns_name, parse_nameserver
from prefixroute.extproc.endpoints.pool import endpoints_from_settings
from prefixroute.extproc.endpoints.settings import PoolSettings


def test_names_and_nameservers_are_validated():
    assert parse_dns_name("model-server:8000") == ("model-server", 8000)
    assert parse_nameserver("10.96.0.10") == ("10.96.0.10", 53)
    assert parse_nameserver("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_nameserver("[::1]:5353") == ("::1", 5353)
    for bad in ("model-server", "10.0.0.1:8000", "[::1]:8000", "http://x:1"):
        with pytest.raises(ValueError):
            parse_dns_name(bad)
    for bad in ("dns.local", "127.0.0.1:0", "[::1]x"):
        with pytest.raises(ValueError):
            parse_nameserver(bad)


def test_settings_allow_discovery_alone_but_not_nothing():
    s = PoolSettings(endpoints_dns=("model-server:8000",), endpoints_dns_nameservers=("127.0.0.1:5353",))
    assert endpoints_from_settings(s) == ()  # discovered later
    assert discovery_from_settings(s, lambda _: None) is not None
    with pytest.raises(ValueError, match="--endpoints-dns"):
        endpoints_from_settings(PoolSettings())
    with pytest.raises(ValueError):
        PoolSettings(endpoints_dns_timeout_s=0)
