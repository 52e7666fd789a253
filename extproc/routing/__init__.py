"""Pure routing logic: request parsing, block hashing, the prefix index and the scheduler.

Nothing here does I/O, so the same code runs in the live router (extproc) and in simulations (bench).

Public API (stable names):
- `request.parse_request(method, path, headers, body, settings) -> InferenceRequest` (raises only OpenAIError)
- `hashing.hash_blocks(text, seed, block_chars, max_blocks)`, `hashing.seed_for(model, tenant)`
- `prefix_index.PrefixIndex`: match / record / set_capacity / remove_endpoint / num_entries
- `scheduling.Scheduler(settings, rng=None).schedule(request, endpoints, in_flight, index) -> Decision`
- `router.RouterCore(settings)`: route / record_failover / apply_pick / apply_failover (this replica's picks and
  other replicas' through one path) / sync_endpoints / on_endpoint_removed / set_capacity; ``core.learner``: the
  prefix policy's `ttft_learner.TtftLearner` (None for the baselines)
- `settings.RoutingSettings`, `settings.POLICIES`; value types in `types`.
- `python -m prefixroute.bench.decision`: decision-time micro-benchmark.
"""
