"""The router's KV-event subscriber against released engines' own publishers, over real ZMQ (vLLM's and
SGLang's ``ZmqEventPublisher`` and event classes, run from their wheels by tests/helpers/engine_driver.py).

Each release publishes its scenario before anyone subscribes (a warm server whose publisher is then quiet):
the subscriber must rebuild the server's GPU block set from the replay socket alone, then follow the same
scenario published live. SGLang 0.5.23 runs it at 16-token pages and at its default page of 1 token (merged
into 16-token router blocks by the index). A release whose wheel is not here (not in $PREFIXROUTE_ENGINE_WHEELS,
.cache/engine-wheels, pip's find-links or pip's cache) is skipped, saying so: CI does not download 350 MB
wheels; `tests/data/kv_events/generate.py --download` fetches them.
"""

from __future__ import annotations

import asyncio

import pytest

from helpers import engines
from helpers.waiting import until_async
from prefixroute.extproc.kv_events import KVEventIndex, KVEventsManager
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
from prefixroute.procs import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EP = "127.0.0.1:8000"
TOPIC = "kv@pod-0@model"


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """Release name -> folder of its extracted modules (None: no wheel here)."""
    out = {}
    for r in engines.RELEASES:
        wheel = engines.find_wheel(r)
        out[r.name] = engines.extract(wheel, tmp_path_factory.mktemp(r.name)) if wheel else None
    return out


def _assert_matches_expected(index: KVEventIndex, expected: dict, release: str) -> None:
    assert index.server_hashes(EP) == set(expected["gpu_blocks"]), release
    for name, p in expected["prompts"].items():
        hashes = hash_token_blocks(p["tokens"], 16, token_seed_for(p["lora_name"], p["cache_salt"]))
        assert index.match(hashes).get(EP, 0) == p["blocks"], f"{release}: prompt {name}"


PAGE_CASES = [(r.name, 0) for r in engines.RELEASES] + [("sglang-0.5.23", 1)]
"""(release, its tokens per page; 0: the scenario's 16-token blocks). SGLang at its default page of 1 token: the
index merges its pages into 16-token router blocks (extproc/kv_events/merge.py)."""


@pytest.mark.parametrize("name, page_size", PAGE_CASES)
async def test_a_release_publisher_late_join_then_live(name, page_size, extracted, tmp_path):
    src = extracted[name]
    if src is None:
        pytest.skip(f"{engines.BY_NAME[name].requirement} wheel not found here (PREFIXROUTE_ENGINE_WHEELS, "
                    f".cache/engine-wheels, pip's cache); tests/data/kv_events/generate.py --download fetches it")
    release = engines.BY_NAME[name]
    pub_port, replay_port = free_ports(2)
    # Loopback where the release can bind it (SGLang 0.5.2x's bind=True), else its wildcard form (tcp://*:P).
    proc = engines.EngineProcess(release, src, "serve", "--endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay",
                                 f"tcp://127.0.0.1:{replay_port}", "--topic", TOPIC,
                                 *(["--page-size", str(page_size)] if page_size else []),
                                 log_path=tmp_path / "driver.log").start()
    index = KVEventIndex(16)
    manager = KVEventsManager(index, topic=TOPIC, replay_timeout_s=2.0, heartbeat_s=0.5)
    try:
        expected = proc.info["expected"]
        n = expected["num_batches"]
        assert proc.send("publish")["published"] == n  # nobody listens: only the replay buffer keeps them
        manager.sync({EP: (f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")})
        stats = lambda: manager.stats()[EP]  # noqa: E731
        await until_async(lambda: stats().state == "live" and stats().last_seq == n - 1, 10, message="late join")
        _assert_matches_expected(index, expected, name)
        assert stats().num_decode_errors == 0 and stats().num_batches == n
        if page_size:  # its pages, merged: none refused as a block-size mismatch, none orphaned
            assert index.block_size_seen(EP) == page_size and index.block_size_mismatch(EP) is None
            c = index.counters(EP)
            assert (c.num_orphan_blocks, c.num_block_size_mismatch_blocks) == (0, 0), c
        # The same scenario live (it clears the cache half-way, so it ends in the same state).
        # A fixed wait on purpose: the SUB connection is up (live), and ZMQ says nothing when the subscription has
        # reached the release's PUB socket (the slow joiner)
        await asyncio.sleep(0.3)
        proc.send("publish")
        await until_async(lambda: stats().last_seq == 2 * n - 1, 10, message="live batches")
        _assert_matches_expected(index, expected, name)
        s = stats()
        assert (s.num_decode_errors, s.num_gaps, s.num_unknown_events, s.num_batches) == (0, 0, 0, 2 * n), s
        assert s.form == ("mixed" if release.name not in ("vllm-0.9.0", "vllm-0.11.0", "vllm-0.17.0", "vllm-0.23.0",
                                                          "sglang-0.5.10") else "array")
    finally:
        await manager.close()
        proc.close()
