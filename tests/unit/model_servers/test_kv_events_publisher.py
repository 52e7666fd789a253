"""The simulated servers' KV-event publisher: vLLM's config keys and its bind-or-connect rule (over real ZMQ:
tests/integration/model_servers/test_kv_events_publisher_zmq.py)."""

from __future__ import annotations

import json

import pytest

from prefixroute.model_servers.kv_events_publisher import KVEventsConfig, binds, config_json, parse_config, vllm_binds
from prefixroute.model_servers.server import ServerSettings


# -- config ------------------------------------------------------------------------------------------
def test_config_defaults_are_vllms():
    cfg = parse_config('{"enable_kv_cache_events": true}')
    assert cfg == KVEventsConfig(enable_kv_cache_events=True)
    assert (cfg.publisher_name, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm,
            cfg.max_queue_size, cfg.topic) == ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert cfg.enabled
    assert parse_config("") is None and parse_config("  ") is None
    assert not parse_config('{"enable_kv_cache_events": false}').enabled
    assert not parse_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled


@pytest.mark.parametrize(("text", "needle"), [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key(s) 'endpont'"),
    ('{"enable_kv_cache_events": "yes"}', "'enable_kv_cache_events' must be bool"),
    ('{"buffer_steps": true}', "'buffer_steps' must be int"),
    ('{"buffer_steps": 0}', "'buffer_steps' must be >= 1"),
    ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
    ("[1]", "must be a JSON object"),
    ("{nope", "not valid JSON"),
])
def test_config_errors_name_the_problem(text, needle):
    with pytest.raises(ValueError) as exc:
        parse_config(text)
    assert needle in str(exc.value)
    with pytest.raises(ValueError):  # the server refuses to start with it
        ServerSettings(kv_events_config=text)


def test_bind_or_connect_like_vllm():
    assert binds("tcp://*:5557") and binds("tcp://127.0.0.1:*") and binds("ipc:///tmp/x") and binds("tcp://[::]:1")
    assert not binds("tcp://router.local:5557") and not binds("tcp://10.0.0.7:5557")
    assert binds("tcp://[::ffff:127.0.0.1]:5557") and vllm_binds("tcp://[::ffff:127.0.0.1]:5557")
    # The simulator's one deviation: an IPv4 loopback address is bound (vLLM connects to it).
    assert binds("tcp://127.0.0.1:5557") and binds("tcp://localhost:5557")
    assert not vllm_binds("tcp://127.0.0.1:5557") and not vllm_binds("tcp://localhost:5557")


def test_default_addresses_bind_in_real_vllm():
    """The addresses the stack, the bench and the docs give the servers must bind in real vLLM too, whose rule
    is "'*' or '::' in the endpoint" (vLLM 0.32's ZmqEventPublisher._is_bind_endpoint; checked against the
    release itself in tests/engines_real/): a plain tcp://127.0.0.1:P makes vLLM connect, so a router
    connecting there receives nothing."""
    cfg = json.loads(config_json(5557))
    for key in ("endpoint", "replay_endpoint"):
        assert "*" in cfg[key] or "::" in cfg[key], cfg[key]
    assert cfg["endpoint"] == "tcp://[::ffff:127.0.0.1]:5557" and cfg["replay_endpoint"].endswith(":5558")


def test_ipv6_loopback_is_refused_with_the_form_that_binds():
    with pytest.raises(ValueError) as exc:
        parse_config('{"enable_kv_cache_events": true, "endpoint": "tcp://[::1]:5557"}')
    assert "tcp://[::ffff:127.0.0.1]:PORT" in str(exc.value)
