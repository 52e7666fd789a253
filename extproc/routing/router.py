"""`RouterCore`: request -> Decision, plus the prefix index it maintains. Knows nothing of gRPC or HTTP.

Used by the ext_proc servicer (live) and by simulations. Single event loop, not thread-safe.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.prefix_index import PrefixIndex
from prefixroute.extproc.routing.request import InferenceRequest, clip
from prefixroute.extproc.routing.scheduling import filters, pickers
from prefixroute.extproc.routing.scheduling.scheduler import Scheduler
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.types import Decision, EndpointId, EndpointState

DEFAULT_RETRY_AFTER_S = 1
"""Retry-After for 503: health probes run about every second, so a retry after 1 s sees fresh state."""


class RouterCore:
    """Applies the model check, schedules, and records each pick in the prefix index.

    Errors raised by `route` (`OpenAIError`):
    - 404 ``The model `X` does not exist.`` (vLLM's wording, X clipped to `request.MAX_ECHO_CHARS`) when every endpoint has a known model list and
      none lists the model (unhealthy ones included: a model served only by down endpoints is 503, not 404);
    - 503 with ``retry_after_s`` when the pool is empty or no endpoint serving the model is healthy.
    """

    def __init__(self, settings: RoutingSettings, *, rng: random.Random | None = None,
                 index: PrefixIndex | None = None, retry_after_s: int = DEFAULT_RETRY_AFTER_S,
                 track_prefill: bool = False) -> None:
        """`track_prefill`: the caller will call `on_release` for every routed request (finished, failed or
        cancelled), so the prefix policy may count the prefill tokens outstanding per endpoint. Off by
        default: without releases the counts would only grow."""
        self.settings = settings
        self.index = index if index is not None else PrefixIndex(settings.default_index_capacity_blocks)
        self.scheduler = Scheduler(settings, rng, track_prefill=track_prefill)
        self.rng = self.scheduler.rng
        self.retry_after_s = retry_after_s
        self._known: set[EndpointId] = set()
        self._capacity_from: dict[EndpointId, tuple[int | None, int | None]] = {}
        self._restart_epoch: dict[EndpointId, int] = {}
        self.num_caches_cleared = 0

    def route(self, request: InferenceRequest, endpoints: Sequence[EndpointState],
              in_flight: Mapping[EndpointId, int], now_s: float | None = None) -> Decision:
        """The decision for `request` given a pool snapshot and the in-flight counts; records the pick.

        Kind "other" (``/v1/models``, ...): the least-loaded healthy endpoints (any model), index untouched.
        The caller owns in-flight accounting (acquire the primary it actually uses). `now_s`: a monotonic clock
        in seconds (the gateway's, or a simulation's virtual time), for the time model's draining queues.
        """
        if not endpoints:
            raise OpenAIError(503, "no endpoint is configured", retry_after_s=self.retry_after_s)
        k = 1 + self.settings.num_fallbacks
        if request.kind == "other":
            healthy = self.scheduler.eligible_cache.view(endpoints, None).endpoints  # healthy, any model
            if not healthy:
                raise OpenAIError(503, "no healthy endpoint", retry_after_s=self.retry_after_s)
            order = pickers.least_load_order(healthy, in_flight, self.rng, k)
            return Decision(endpoints=tuple(order), reason="load", policy=self.scheduler.policy.name)
        decision = self.scheduler.schedule(request, endpoints, in_flight, self.index, now_s)
        if not decision.endpoints:
            if not filters.filter_model(endpoints, request.model):
                raise OpenAIError(404, f"The model `{clip(request.model)}` does not exist.", param="model",
                                  type_="NotFoundError")
            what = f"serving model `{clip(request.model)}`" if request.model else ""
            raise OpenAIError(503, f"no healthy endpoint {what}".strip(), retry_after_s=self.retry_after_s)
        if request.block_hashes:
            self.index.record(request.block_hashes, decision.endpoints[0])
        return decision

    def on_release(self, request: InferenceRequest, decision: Decision) -> None:
        """`request`, routed by `decision` (what `route` returned), finished, failed or was cancelled: call
        once per routed request, when its response ends (where the gateway releases its in-flight count).
        A no-op unless constructed with ``track_prefill=True`` or for a policy without prefill tracking."""
        self.scheduler.policy.on_release(request, decision)

    def on_first_token(self, request: InferenceRequest, decision: Decision, ttft_s: float,
                       prompt_tokens: int | None = None, cached_tokens: int | None = None) -> None:
        """`request`'s first token came `ttft_s` after it arrived; usage figures when already known (a
        simulation), else later by `on_usage`. At most once, before or after its `on_release` (see
        `Policy.on_first_token`)."""
        self.scheduler.policy.on_first_token(request, decision, ttft_s, prompt_tokens, cached_tokens)

    def on_usage(self, request: InferenceRequest, decision: Decision, prompt_tokens: int | None,
                 cached_tokens: int | None) -> None:
        """`request`'s response ended with these usage figures (None: none reported), after its
        `on_first_token`, before or after its `on_release` (see `Policy.on_usage`)."""
        self.scheduler.policy.on_usage(request, decision, prompt_tokens, cached_tokens)

    def record_failover(self, request: InferenceRequest, served_by: EndpointId) -> None:
        """The request was served by a fallback (Envoy's ``x-gateway-destination-endpoint-served``): record it
        there too, so the next request of this prefix can find the cache where it really is."""
        if request.block_hashes:
            self.index.record(request.block_hashes, served_by)

    # --- pool changes -----------------------------------------------------------------------------------
    def capacity_blocks(self, state: EndpointState) -> int:
        """Index capacity for `state` in router blocks: scraped num_gpu_blocks x block_size tokens / tokens per
        router block, else ``default_index_capacity_blocks``."""
        if state.num_gpu_blocks and state.block_size:
            return max(1, math.floor(state.num_gpu_blocks * state.block_size / self.settings.tokens_per_block))
        return self.settings.default_index_capacity_blocks

    def set_capacity(self, endpoint: EndpointId, num_blocks: int) -> None:
        self.index.set_capacity(endpoint, num_blocks)

    def on_endpoint_removed(self, endpoint: EndpointId) -> None:
        """An endpoint left the pool: its index entries (and outstanding prefill estimate) go with it."""
        self.index.remove_endpoint(endpoint)
        self.scheduler.policy.on_endpoint_removed(endpoint)
        self._known.discard(endpoint)
        self._capacity_from.pop(endpoint, None)
        self._restart_epoch.pop(endpoint, None)

    def on_cache_cleared(self, endpoint: EndpointId) -> None:
        """`endpoint`'s KV cache is known empty: forget its prefix-index entries (its capacity stays), so the next
        request of a prefix it held is not predicted a hit there. Called by `sync_endpoints` when the pool's
        ``restart_epoch`` for it changes; the seam for KV events' AllBlocksCleared (a later source of the same
        fact)."""
        self.index.clear_endpoint(endpoint)
        self.scheduler.policy.on_cache_cleared(endpoint)
        self.num_caches_cleared += 1

    def sync_endpoints(self, snapshot: Sequence[EndpointState]) -> None:
        """Bring the index in line with a pool snapshot: drop endpoints no longer present, size each endpoint's
        LRU from its scraped KV capacity, and clear an endpoint whose ``restart_epoch`` changed since the last
        snapshot (`on_cache_cleared`; the first sight of an endpoint only records its epoch). Cheap when nothing
        changed; fit as the pool's ``on_change`` hook."""
        present = {s.endpoint for s in snapshot}
        for ep in self._known - present:
            self.on_endpoint_removed(ep)
        epochs = self._restart_epoch
        for s in snapshot:
            src = (s.num_gpu_blocks, s.block_size)
            if self._capacity_from.get(s.endpoint) != src:
                self._capacity_from[s.endpoint] = src
                self.index.set_capacity(s.endpoint, self.capacity_blocks(s))
            seen = epochs.get(s.endpoint)
            if seen != s.restart_epoch:
                epochs[s.endpoint] = s.restart_epoch
                if seen is not None:
                    self.on_cache_cleared(s.endpoint)
        self._known = present
