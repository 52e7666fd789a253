"""Endpoint specs with a KV-event address (``host:port@tcp://host:port``), the port-offset form, and the
replay address derived from the PUB port."""

from __future__ import annotations

import pytest

from prefixroute.extproc.endpoints.pool import endpoints_from_settings, event_addresses_from_settings
from prefixroute.extproc.endpoints.scrape import event_addresses, parse_endpoint_list, read_endpoints_file
from prefixroute.extproc.endpoints.settings import PoolSettings


@pytest.mark.parametrize("specs,offset,replay,expected", [
    (["127.0.0.1:8001@tcp://127.0.0.1:5557"], 0, 1, {"127.0.0.1:8001": ("tcp://127.0.0.1:5557",
                                                                        "tcp://127.0.0.1:5558")}),
    (["a:8000@tcp://a:5557", "b:8000"], 0, 1, {"a:8000": ("tcp://a:5557", "tcp://a:5558")}),
    (["a:8000", "b:8000@tcp://ev:7000"], 1000, 0, {"a:8000": ("tcp://a:9000", None), "b:8000": ("tcp://ev:7000", None)}),
    (["[::1]:8000@tcp://[::1]:5557"], 0, 1, {"[::1]:8000": ("tcp://[::1]:5557", "tcp://[::1]:5558")}),
    (["a:8000"], 0, 1, {}),
])
def test_event_addresses(specs, offset, replay, expected):
    assert event_addresses(specs, offset, replay) == expected
    # The event address never changes the endpoint id (Envoy's cluster, the pool and decisions use host:port).
    assert parse_endpoint_list(specs) == tuple(s.partition("@")[0] for s in specs)


@pytest.mark.parametrize("bad", ["a:8000@", "a:8000@5557", "a:8000@http://a:5557", "a:8000@tcp://a:0",
                                 "a:8000@tcp://a:99999", "a:8000@tcp://a:5557/x", "a:8000@tcp://a b:1"])
def test_bad_event_addresses_are_refused_with_a_clear_message(bad):
    with pytest.raises(ValueError, match="KV-event address"):
        parse_endpoint_list([bad])


def test_replay_port_past_65535_is_an_error():
    with pytest.raises(ValueError, match="not a valid port"):
        event_addresses(["a:8000@tcp://a:65535"], 0, 1)


def test_settings_and_files(tmp_path):
    f = tmp_path / "endpoints.yaml"
    f.write_text("- 10.0.0.1:8000@tcp://10.0.0.1:5557  # with events\n- 10.0.0.2:8000\n")
    assert read_endpoints_file(f.read_text()) == ["10.0.0.1:8000@tcp://10.0.0.1:5557", "10.0.0.2:8000"]
    s = PoolSettings(endpoints=("10.0.0.3:8000@tcp://10.0.0.3:6000",), endpoints_file=str(f))
    assert endpoints_from_settings(s) == ("10.0.0.3:8000", "10.0.0.1:8000", "10.0.0.2:8000")
    assert event_addresses_from_settings(s) == {"10.0.0.3:8000": ("tcp://10.0.0.3:6000", "tcp://10.0.0.3:6001"),
                                                "10.0.0.1:8000": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")}


def test_adapters_are_the_models_with_a_parent():
    from prefixroute.extproc.endpoints.scrape import parse_adapters, parse_models

    body = (b'{"object":"list","data":[{"id":"base","parent":null},{"id":"sql-lora","parent":"base"},'
            b'{"id":"other"},{"nope":1}]}')
    assert parse_models(body) == {"base", "sql-lora", "other"}
    assert parse_adapters(body) == {"sql-lora"}
    with pytest.raises(ValueError):
        parse_adapters(b"[]")
