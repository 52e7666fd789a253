"""Simulated vLLM-like GPU model servers with costs calibrated on an H200.

Layers (pure logic first, I/O last; the HTTP server and the virtual-time fleet share everything below them):

- `cost_model`: step time from batch sums (new tokens, attention work, KV reads, sequences), fitted to the
  packaged calibration (``calibration/*.json``); `fit_report()` prints the error at every measured point.
- `profiles`: ``llama-3.1-8b-h200`` (default) and ``llama-3.1-70b-h200-tp4``: cost model, KV blocks, names;
  ``EngineSpec.from_settings`` (one server's engine and API, which the HTTP server and the fleet build from).
- `tokenizer`: ``encode(text) -> np.ndarray`` (4 bytes per token, Llama 3 special ids) and
  ``render_chat(messages, tools=None, add_generation_prompt=True) -> str`` (Llama-3-style template).
- `kv_cache`: ``BlockHash``, ``root_hash(extra_keys)``, ``hash_block(parent, ids)`` (pure chained hash),
  ``hash_blocks(ids, block_size, root)`` (vectorised), ``KVCache`` (ref counts, LRU of free blocks).
- `engine`: ``EngineCore`` (vLLM v1 scheduler: running/waiting, token budget, chunked prefill,
  preemption) driven by ``plan_step()`` / ``finish_step(plan, now_s)``; never reads a clock.
- `runtime`: ``AsyncEngine``, the real-time runner (asyncio sleeps for each step's modelled time).
- `virtual`: ``VirtualFleet``/``SimRequest``/``SimResult``, the discrete-event runner for N engines (requests
  from body bytes, parsed as the HTTP server parses them).
- `protocol`, `metrics`, `server`: OpenAI request parsing, SSE encoding, Prometheus text, HTTP server.
- `cli` (``prefixroute model-server``) and `bench` (``prefixroute model-server-bench``).
"""
