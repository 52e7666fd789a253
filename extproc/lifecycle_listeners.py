"""The router service's own lifecycle listeners (extproc/lifecycle.py), registered by `PoolRouter` in this order:

- `PoolListener`: the pool's in-flight count (the primary's, moved to the fallback that served; released once);
- `ResponsesListener`: the Responses API directory (a response id -> the endpoint holding it, and its prompt
  size, which a pinned follow-up is predicted to find cached);
- `IndexListener`: the prefix index and sessions (a failover recorded where the prefix really is; the
  predicted-vs-actual hit statistics and, in feedback mode, the endpoint's index capacity from each usage);
- `TimeModelListener`: the policy's time model (its pending queue empties at the first token or the release;
  its rate learns from the first token and the usage);
- `PeersListener`: the other replicas (extproc/peers: a pick, its first token, its end, a failover, a
  response id, what the time model learned).
- `TierPredictionListener` (only with a tier-aware KV-events index): the router's hit prediction by tier
  (GPU, CPU) against the usage the server reported, as counters for /metrics.

Telemetry is not among them: it observes requests through the tracker (tracking.py), and nothing the router
learns goes through it. Each listener keeps only what it owns; the per-request state is the `Pick`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prefixroute.extproc.endpoints import Pool
from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
from prefixroute.extproc.lifecycle import LifecycleListener, Pick
from prefixroute.extproc.peers import codec
from prefixroute.extproc.response_directory import ResponseDirectory, response_key
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.sessions import session_id
from prefixroute.extproc.routing.ttft_learner import TtftLearner
from prefixroute.types import EndpointId


class PeerPublisher(Protocol):
    """What `PeersListener` sends the other replicas through (`peers.bus.PeerBus`): `publish` never awaits, never
    blocks and never raises."""

    def publish(self, message: codec.Message) -> None: ...


class PoolListener(LifecycleListener):
    """The in-flight count of each pick: acquired at the decision (by `PoolRouter.route`, before any
    listener), moved to the fallback that served, released at the end."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def on_failed_over(self, pick: Pick, served: EndpointId) -> None:
        if not pick.released:
            self.pool.release(pick.counted)
            self.pool.acquire(served)
            pick.counted = served

    def on_released(self, pick: Pick) -> None:
        self.pool.release(pick.counted)


class ResponsesListener(LifecycleListener):
    """The Responses API directory (extproc/response_directory.py) learns each response's id and prompt size."""

    def __init__(self, responses: ResponseDirectory, set_known_prefix: Callable[[InferenceRequest], None]) -> None:
        self.responses = responses
        self._set_known_prefix = set_known_prefix

    def on_response_id(self, pick: Pick) -> None:
        self.responses.learn(pick.response_id, pick.response_endpoint)  # type: ignore[arg-type]

    def on_usage(self, pick: Pick) -> None:
        if pick.response_id is not None and pick.prompt_tokens:
            self.responses.set_prompt_tokens(pick.response_id, pick.prompt_tokens)
        request = pick.request
        if request.known_prefix_tokens is None and request.response_ref is not None:
            # The previous response's usage often arrives just after the client, which saw its end, sent this
            # follow-up: take it now, for the prediction the statistics compare with this usage.
            self._set_known_prefix(request)


class IndexListener(LifecycleListener):
    """The prefix index and the sessions: where a failed-over prefix really is, and what each usage says of
    the index's predictions (`RouterCore.observe_usage`)."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core

    def on_failed_over(self, pick: Pick, served: EndpointId) -> None:
        self.core.record_failover(pick.request, served)

    def on_usage(self, pick: Pick) -> None:
        self.core.observe_usage(pick.request, pick.decision, pick.prompt_tokens, pick.cached_tokens, pick.counted)


class TimeModelListener(LifecycleListener):
    """The prefix policy's time model (`ttft_learner.TtftLearner`; registered only for a policy that has one):
    the pick leaves the pending queue at its first token or release; the rate learns from (TTFT, usage)."""

    def __init__(self, learner: TtftLearner, clock: Callable[[], float] | None = None) -> None:
        self.learner = learner
        self.clock = clock  # the router's monotonic clock (the picks'): a release's time, for the decode load

    def on_first_token(self, pick: Pick) -> None:
        self.learner.on_first_token(pick.request, pick.decision, pick.ttft_s)  # type: ignore[arg-type]

    def on_ttft_sample(self, pick: Pick) -> None:
        self.learner.on_usage(pick.request, pick.decision, pick.prompt_tokens, pick.cached_tokens)

    def on_released(self, pick: Pick) -> None:
        self.learner.on_release(pick.request, pick.decision, self.clock() if self.clock is not None else None)


class PeersListener(LifecycleListener):
    """Tells the other replicas (extproc/peers; `publisher` None: this replica routes alone, nothing is sent).
    Publishing never awaits."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.publisher: PeerPublisher | None = None
        self._seq = 0

    def on_decided(self, pick: Pick) -> None:
        peers = self.publisher
        request = pick.request
        if peers is None or request.kind == "other":
            return
        learner = self.core.learner
        pending = learner.pending_tokens_of(request) if learner is not None else None
        hashes = request.block_hashes
        if pending is None and not hashes:
            return  # nothing another replica would do with it
        self._seq += 1
        pick.peer_seq = pick.peer_seq_any = self._seq
        pick.peer_pending = pending is not None
        peers.publish(codec.Pick(self._seq, pick.endpoint_ids[0], hashes, pending, self.session_of(request)))

    def session_of(self, request: InferenceRequest) -> bytes | None:
        """What the other replicas know a request's session by: its digest, never the client's key."""
        if request.session_key is None or self.core.sessions is None:
            return None
        return session_id(request.tenant, request.session_key)

    def on_failed_over(self, pick: Pick, served: EndpointId) -> None:
        if self.publisher is not None and pick.peer_seq is not None:
            r = pick.request
            self.publisher.publish(codec.Failover(pick.peer_seq, served, r.block_hashes, self.session_of(r)))

    def on_first_token(self, pick: Pick) -> None:
        if pick.peer_pending and self.publisher is not None:
            pick.peer_pending = False
            self.publisher.publish(codec.Done(pick.peer_seq))  # type: ignore[arg-type]
        self._publish_observations()

    def on_usage(self, pick: Pick) -> None:
        peers = self.publisher
        if peers is not None and pick.response_id is not None and pick.prompt_tokens and \
                pick.response_endpoint is not None and pick.peer_seq_any is not None:
            peers.publish(codec.Response(pick.peer_seq_any, response_key(pick.response_id), pick.response_endpoint,
                                         pick.prompt_tokens))

    def on_ttft_sample(self, pick: Pick) -> None:
        self._publish_observations()

    def on_response_id(self, pick: Pick) -> None:
        if self.publisher is not None and pick.peer_seq_any is not None:
            self.publisher.publish(codec.Response(pick.peer_seq_any, response_key(pick.response_id),  # type: ignore[arg-type]
                                                  pick.response_endpoint, None))  # type: ignore[arg-type]

    def on_released(self, pick: Pick) -> None:
        seq = pick.peer_seq
        if seq is not None and self.publisher is not None:
            pick.peer_seq = None
            pick.peer_pending = False
            self.publisher.publish(codec.Release(seq))

    def _publish_observations(self) -> None:
        """What the time model just learned from a response goes to the other replicas (codec.Observed)."""
        peers = self.publisher
        learner = self.core.learner
        if peers is not None and learner is not None:
            for o in learner.take_observations():
                peers.publish(codec.Observed(*o))


class TierPredictionListener(LifecycleListener):
    """What the router predicted each tier would serve, in tokens, beside the prompt tokens of the same requests
    (the predicted hit ratio by tier, to hold against the servers' own counters by tier,
    ``vllm:prefix_cache_hits`` and ``vllm:external_prefix_cache_hits``).

    At the decision: the (GPU, CPU) leading blocks the tier-aware events index found at the primary in this
    request's match (`TieredKVEventIndex.last_tiers`; `route` matches and the lifecycle's ``decided`` follows
    in the same call, so the last match is this request's), when the primary is matched by its events. At the
    usage: counted in the server's accounting (whole blocks of ``kv_block_tokens``, at most n - 1 of n prompt
    tokens, the CPU blocks after the GPU ones) for requests served by their primary; a failed-over request's
    prediction was for another endpoint and is left out, with its prompt tokens. `tokens`: endpoint -> [prompt
    tokens, predicted GPU tokens, predicted CPU tokens], plain floats the metrics thread reads."""

    def __init__(self, core: RouterCore, index: TieredKVEventIndex) -> None:
        self.core = core
        self.index = index
        self.block_tokens = core.settings.kv_block_tokens
        self.tokens: dict[EndpointId, list[float]] = {}

    def on_decided(self, pick: Pick) -> None:
        ep = pick.endpoint_ids[0]
        if ep in self.core.sourced.event_endpoints:
            pick.predicted_tiers = self.index.last_tiers(ep)

    def on_usage(self, pick: Pick) -> None:
        tiers, n = pick.predicted_tiers, pick.prompt_tokens
        if tiers is None or not n or pick.counted != pick.endpoint_ids[0]:
            return
        bt = self.block_tokens
        cap = (n - 1) // bt if n > 0 else 0
        gpu = min(tiers[0], cap)
        cpu = min(tiers[1], cap - gpu)
        row = self.tokens.get(pick.counted)
        if row is None:
            row = self.tokens[pick.counted] = [0.0, 0.0, 0.0]
        row[0] += n
        row[1] += gpu * bt
        row[2] += cpu * bt


class TierPredictionCollector:
    """prometheus_client collector of a `TierPredictionListener` (register it on the router's registry)."""

    def __init__(self, listener: TierPredictionListener) -> None:
        self.listener = listener

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201
        from prometheus_client.core import CounterMetricFamily

        prompt = CounterMetricFamily("prefixroute_tier_predicted_prompt_tokens", "Prompt tokens of the requests "
                                     "whose hit the router predicted by KV tier (matched by the endpoint's KV "
                                     "events, served by the primary, usage reported).", labels=["endpoint"])
        hit = CounterMetricFamily("prefixroute_predicted_tier_hit_tokens", "Of those prompt tokens, how many the "
                                  "router predicted the endpoint would serve from each KV tier (gpu; cpu: its "
                                  "host-memory offload tier), in the server's accounting.",
                                  labels=["endpoint", "tier"])
        for ep, (n, gpu, cpu) in list(self.listener.tokens.items()):
            prompt.add_metric([str(ep)], n)
            hit.add_metric([str(ep), "gpu"], gpu)
            hit.add_metric([str(ep), "cpu"], cpu)
        yield prompt
        yield hit
