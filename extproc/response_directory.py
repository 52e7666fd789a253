"""Which endpoint holds which Responses API response: `ResponseDirectory` (pure) and `ResponseLookup` (async).

A Responses follow-up (``previous_response_id``) and ``GET /v1/responses/{id}...`` can only be served by the
endpoint that produced that response: it alone holds it, in its in-memory store (vLLM with
``VLLM_ENABLE_RESPONSES_API_STORE=1``). The router therefore pins such a request to that endpoint and never
reroutes it (service.py):

- `ResponseDirectory` remembers id -> endpoint, learned from the response id the observing stream sees in a
  Responses response (tracking.py: the ``response.created`` event of a stream, the JSON body otherwise), or
  Envoy's facts record (envoy_facts.py). A response id names one response, produced once: a report never rebinds
  an id the directory holds at another endpoint (`learn` refuses it, `num_refused`), so a forged or replayed claim
  cannot move someone's conversation; only a lookup, where the endpoint itself answers, may. It is
  bounded (``max_response_ids``, least recently used out) and each id expires ``response_id_ttl_s`` after it
  was learned or last used. Every id of an endpoint that left the pool or restarted (its ``restart_epoch``
  changed: its store died with the process) is forgotten at once (`sync`).
- `ResponseLookup`: an id the directory does not know (router restarted, id expired or evicted, or the
  observing stream not yet read when the client's follow-up arrived) is looked up: ``GET
  http://<address>/v1/responses/{id}`` on every healthy endpoint at once, at most ``max_response_lookups``
  lookups in flight (beyond: 503 with Retry-After), each bounded by ``response_lookup_timeout_s``. The first
  endpoint that answers 200 wins and is remembered. Every endpoint answered 404: vLLM's own 404 naming the id
  to its client (`responses_prompt.not_found`; its record withholds the id), remembered for
  `NEGATIVE_TTL_S` so a client retrying a dead id does not make the whole fleet look it up again. Some endpoint failed or timed out and none had it: 503 with Retry-After
  (it may be on the one that did not answer). No 503 names the id: error texts reach records and dashboards,
  and a response id reads its response. Concurrent lookups of one id share one fan-out.

`NeedsLookup` is what `PoolRouter.route` raises for an unknown id: the servicer awaits
`PoolRouter.resolve` (this module's lookup), then routes again. The common path (a known id, or no id) stays
synchronous.

Without the observing filter (``--no-telemetry`` / no observing stream) ids are learned by lookup only: every
first follow-up of a response costs one fan-out, later ones hit the directory.

Memory: the directory keys every id by `response_key` (a 16-byte digest), never by the id itself, so an entry
costs the same whatever the id (memory.RESPONSE_ID_ENTRY_BYTES), and replicas share ids by digest (a response
id is a capability: whoever knows it can read the response from its endpoint, so it never travels on the bus).

Single event loop; not thread-safe (the metrics thread reads only the plain integer counters).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from prefixroute import responses_prompt
from prefixroute.types import EndpointId, EndpointState
from prefixroute.openai_errors import OpenAIError

NEGATIVE_TTL_S = 5.0
"""Seconds an id that every endpoint answered 404 for is answered 404 without asking again: long enough to
absorb a client's retries, short enough that nothing stays wrong for long should the id appear later."""
MAX_NEGATIVE_IDS = 4096
"""Most ids in the negative cache (oldest out): forged ids must not grow it without bound."""

Fetch = Callable[[str, str, Mapping[str, str]], Awaitable[int]]
"""``(address, response_id, headers) -> HTTP status`` of ``GET http://address/v1/responses/{id}``; raises on a
connection failure (the timeout is the caller's)."""


ResponseKey = bytes
"""`response_key(response_id)`: how the directory and the other replicas name a response id."""


def response_key(response_id: str) -> ResponseKey:
    """The 16-byte BLAKE2b digest of a response id (the same on every replica)."""
    return hashlib.blake2b(response_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class NeedsLookup(Exception):
    """Raised by `PoolRouter.route` for a response id its directory does not know: await
    ``router.resolve(response_id, headers)`` (raises `OpenAIError` 404/503, else the id is then known) and
    route again."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseDirectory:
    """Bounded map response id -> endpoint that produced it (module docstring). `clock`: monotonic seconds."""

    __slots__ = ("max_ids", "ttl_s", "clock", "_ids", "_by_endpoint", "_missing", "_epochs", "_found", "_tokens",
                 "num_learned", "num_hits", "num_expired", "num_evicted", "num_forgotten", "num_refused")

    def __init__(self, max_ids: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if max_ids < 1 or ttl_s <= 0:
            raise ValueError("max_ids must be >= 1 and ttl_s > 0")
        self.max_ids = max_ids
        self.ttl_s = ttl_s
        self.clock = clock
        # All keyed by `response_key` (digests), never by the ids themselves.
        self._ids: OrderedDict[ResponseKey, tuple[EndpointId, float]] = OrderedDict()  # -> (endpoint, expiry), LRU
        self._by_endpoint: dict[EndpointId, set[ResponseKey]] = {}
        self._missing: OrderedDict[ResponseKey, float] = OrderedDict()  # -> expiry of the negative answer
        self._epochs: dict[EndpointId, int] = {}
        # Ids a lookup just found: the next `endpoint_of` is the route of the request that waited for that
        # lookup, not a hit (a subset of `_ids`, dropped with them).
        self._found: set[ResponseKey] = set()
        # id -> prompt tokens of the request that produced it (its usage), when reported: a follow-up's prompt
        # starts with that prompt, so the router can predict what the holder has cached (a subset of `_ids`).
        self._tokens: dict[ResponseKey, int] = {}
        self.num_learned = 0
        self.num_hits = 0
        self.num_expired = 0
        self.num_evicted = 0
        self.num_forgotten = 0  # ids dropped because their endpoint left the pool or restarted
        self.num_refused = 0  # reports naming a known id at another endpoint (never rebound)

    def __len__(self) -> int:
        return len(self._ids)

    def learn(self, response_id: str, endpoint: EndpointId, *, by_lookup: bool = False) -> bool:
        """`endpoint` produced (or, per a lookup: `by_lookup`, holds) `response_id`: True when learned. Refreshes
        its expiry; evicts the least recently used id beyond `max_ids`. After a lookup the next `endpoint_of` of
        the id is not counted in `num_hits` (it is the route the lookup was made for). A report (not a lookup)
        naming an id held at another endpoint is refused (False, `num_refused`): module docstring."""
        return self.learn_key(response_key(response_id), endpoint, by_lookup=by_lookup)

    def holder(self, response_id: str) -> EndpointId | None:
        """The endpoint the directory holds `response_id` at (live: not expired), without touching it: no
        refresh, no hit counted. None when unknown."""
        entry = self._ids.get(response_key(response_id))
        return entry[0] if entry is not None and entry[1] > self.clock() else None

    def learn_key(self, response_id: ResponseKey, endpoint: EndpointId, *, by_lookup: bool = False) -> bool:
        """`learn` by `response_key`."""
        now = self.clock()
        if not by_lookup:
            held = self._ids.get(response_id)
            if held is not None and held[0] != endpoint and held[1] > now:
                self.num_refused += 1
                return False
        self._missing.pop(response_id, None)
        if by_lookup:
            self._found.add(response_id)
        else:
            self._found.discard(response_id)
        old = self._ids.pop(response_id, None)
        if old is not None and old[0] != endpoint:
            self._drop_from_endpoint(response_id, old[0])
        self._ids[response_id] = (endpoint, now + self.ttl_s)
        self._by_endpoint.setdefault(endpoint, set()).add(response_id)
        self.num_learned += 1
        self._expire(now)
        while len(self._ids) > self.max_ids:
            rid, (ep, _) = self._ids.popitem(last=False)
            self._found.discard(rid)
            self._tokens.pop(rid, None)
            self._drop_from_endpoint(rid, ep)
            self.num_evicted += 1
        return True

    def apply_peer(self, key: ResponseKey, endpoint: EndpointId, prompt_tokens: int | None) -> bool:
        """Another replica learned that `endpoint` holds the response `key` names (and its request's prompt
        tokens, when given): `learn` it here too, so a follow-up reaching this replica is pinned without a
        lookup. Ignored (False) for an endpoint not in the last pool snapshot `sync` followed, and when this
        replica already knows the id at another endpoint: a peer's claim never overwrites what this replica
        learned itself or was told first (a response id names one response, produced once)."""
        if endpoint not in self._epochs:
            return False
        known = self._ids.get(key)
        if known is not None and known[0] != endpoint:
            return False
        if known is None and not self.learn_key(key, endpoint):
            return False
        if prompt_tokens:
            self._set_tokens(key, prompt_tokens)
        return True

    def endpoint_of(self, response_id: str) -> EndpointId | None:
        """The endpoint holding `response_id`, None when unknown or expired. A hit refreshes the id (a
        conversation in use stays remembered) and counts in `num_hits`, except the first after a lookup."""
        response_id = response_key(response_id)  # type: ignore[assignment]
        entry = self._ids.get(response_id)
        if entry is None:
            return None
        now = self.clock()
        ep, expiry = entry
        if expiry <= now:
            self._expire(now)
            self._ids.pop(response_id, None)
            self._found.discard(response_id)
            self._tokens.pop(response_id, None)
            self._drop_from_endpoint(response_id, ep)
            return None
        self._ids[response_id] = (ep, now + self.ttl_s)
        self._ids.move_to_end(response_id)
        if response_id in self._found:
            self._found.discard(response_id)
        else:
            self.num_hits += 1
        return ep

    def set_prompt_tokens(self, response_id: str, num_tokens: int) -> None:
        """The request that produced `response_id` had `num_tokens` prompt tokens (its usage). Ignored for an id
        the directory does not hold (the figure lives and dies with the id)."""
        self._set_tokens(response_key(response_id), num_tokens)

    def _set_tokens(self, key: ResponseKey, num_tokens: int) -> None:
        if key in self._ids:
            self._tokens[key] = num_tokens

    def prompt_tokens(self, response_id: str) -> int | None:
        """The prompt tokens of the request that produced `response_id`, None when not reported (yet)."""
        return self._tokens.get(response_key(response_id))

    def note_missing(self, response_id: str) -> None:
        """Every endpoint answered 404 for `response_id`: answer 404 for it for `NEGATIVE_TTL_S`."""
        response_id = response_key(response_id)  # type: ignore[assignment]
        self._missing.pop(response_id, None)
        self._missing[response_id] = self.clock() + NEGATIVE_TTL_S
        while len(self._missing) > MAX_NEGATIVE_IDS:
            self._missing.popitem(last=False)

    def is_missing(self, response_id: str) -> bool:
        """Whether `response_id` is in the negative cache (module docstring)."""
        key = response_key(response_id)
        expiry = self._missing.get(key)
        if expiry is None:
            return False
        if expiry <= self.clock():
            del self._missing[key]
            return False
        return True

    def forget_endpoint(self, endpoint: EndpointId) -> int:
        """Drop every id `endpoint` holds (it left the pool, or restarted with an empty store); how many."""
        ids = self._by_endpoint.pop(endpoint, None)
        if not ids:
            return 0
        for rid in ids:
            self._ids.pop(rid, None)
            self._found.discard(rid)
            self._tokens.pop(rid, None)
        self.num_forgotten += len(ids)
        return len(ids)

    def sync(self, snapshot: Iterable[EndpointState]) -> None:
        """Follow a pool snapshot: forget the ids of endpoints no longer present and of endpoints whose
        ``restart_epoch`` changed since the last snapshot (the first sight of an endpoint records its epoch)."""
        epochs: dict[EndpointId, int] = {}
        for s in snapshot:
            epochs[s.endpoint] = s.restart_epoch
            seen = self._epochs.get(s.endpoint)
            if seen is not None and seen != s.restart_epoch:
                self.forget_endpoint(s.endpoint)
        for ep in list(self._by_endpoint):
            if ep not in epochs:
                self.forget_endpoint(ep)
        self._epochs = epochs

    def _drop_from_endpoint(self, response_id: str, endpoint: EndpointId) -> None:
        ids = self._by_endpoint.get(endpoint)
        if ids is not None:
            ids.discard(response_id)
            if not ids:
                del self._by_endpoint[endpoint]

    def _expire(self, now: float) -> None:
        """Drop expired ids from the LRU end: every touch sets expiry = now + ttl, so the order by last touch
        is the order by expiry and the sweep stops at the first live id (O(expired))."""
        ids = self._ids
        while ids:
            rid, (ep, expiry) = next(iter(ids.items()))
            if expiry > now:
                return
            del ids[rid]
            self._found.discard(rid)
            self._tokens.pop(rid, None)
            self._drop_from_endpoint(rid, ep)
            self.num_expired += 1


async def http_fetch(session: aiohttp.ClientSession, address: str, response_id: str,
                     headers: Mapping[str, str]) -> int:
    """`Fetch` over `session`: the status of ``GET http://address/v1/responses/{id}`` (body discarded)."""
    url = f"http://{address}{responses_prompt.RESPONSES_PREFIX}{response_id}"
    async with session.get(url, headers=dict(headers), allow_redirects=False) as resp:
        await resp.release()
        return resp.status


class ResponseLookup:
    """Finds the endpoint holding a response id the directory does not know (module docstring).

    `fetch`: how one endpoint is asked (`Fetch`; default: `http_fetch` over a session opened on first use
    and closed by `close`). `retry_after_s`: the Retry-After of its 503s."""

    def __init__(self, directory: ResponseDirectory, *, timeout_s: float, max_in_flight: int,
                 retry_after_s: int = 1, fetch: Fetch | None = None) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self._fetch = fetch
        self._session: aiohttp.ClientSession | None = None
        self._in_flight: dict[str, asyncio.Future[EndpointId]] = {}  # id -> its shared fan-out task
        self.num_lookups = 0  # fan-outs started
        self.num_found = 0  # an endpoint had the id
        self.num_not_found = 0  # every endpoint answered 404
        self.num_failed = 0  # none had it and some did not answer (503)
        self.num_refused = 0  # over max_in_flight (503)
        self.num_requests = 0  # GETs sent to endpoints

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def resolve(self, response_id: str, candidates: Sequence[tuple[EndpointId, str]],
                      headers: Mapping[str, str] | None = None) -> EndpointId:
        """The endpoint among `candidates` (``(endpoint, address)`` of the healthy endpoints) that holds
        `response_id`, now learned by the directory. Raises `OpenAIError`: 404 (vLLM's, when every candidate
        answered 404), 503 with Retry-After (a candidate failed or timed out and none had it;
        no candidate; or too many lookups in flight). `headers` go with each GET (the client's
        ``authorization``, for endpoints that require a key)."""
        task = self._in_flight.get(response_id)
        if task is None:
            if len(self._in_flight) >= self.max_in_flight:
                self.num_refused += 1
                raise OpenAIError(503, "too many response lookups in flight; retry later",
                                  retry_after_s=self.retry_after_s, param="previous_response_id")
            # A task of its own, shared by every request for this id: a client that leaves does not cancel
            # the lookup the others wait on.
            task = asyncio.ensure_future(self._fan_out(response_id, candidates, headers or {}))
            self._in_flight[response_id] = task
            task.add_done_callback(lambda t: self._done(response_id, t))
        return await asyncio.shield(task)

    def _done(self, response_id: str, task: asyncio.Future[EndpointId]) -> None:
        if self._in_flight.get(response_id) is task:
            del self._in_flight[response_id]
        if not task.cancelled():
            task.exception()  # retrieved: a lookup whose waiters all left must not log "never retrieved"

    async def _fan_out(self, response_id: str, candidates: Sequence[tuple[EndpointId, str]],
                       headers: Mapping[str, str]) -> EndpointId:
        self.num_lookups += 1
        if not candidates:
            self.num_failed += 1
            raise self._unavailable(response_id, "no endpoint is healthy")
        fetch = self._fetch or self._http
        tasks = {asyncio.ensure_future(fetch(addr, response_id, headers)): ep for ep, addr in candidates}
        self.num_requests += len(tasks)
        num_failed = 0
        pending = set(tasks)
        try:
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            while pending:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    try:
                        status = t.result()
                    except Exception:  # noqa: BLE001 - refused, reset, DNS: that endpoint did not answer
                        num_failed += 1
                        continue
                    if status == 200:
                        ep = tasks[t]
                        self.directory.learn(response_id, ep, by_lookup=True)
                        self.num_found += 1
                        return ep
                    if status != 404:
                        num_failed += 1
        finally:
            for t in pending:
                t.cancel()
            if pending:  # let the cancelled GETs unwind (their connections close) before answering
                await asyncio.wait(pending, timeout=1.0)
            for t in tasks:  # retrieved: a GET that failed as the deadline passed must not log at exit
                if t.done() and not t.cancelled():
                    t.exception()
        num_failed += len(pending)  # timed out
        if num_failed:
            self.num_failed += 1
            raise self._unavailable(response_id, f"{num_failed} of {len(tasks)} endpoints did not answer")
        self.num_not_found += 1
        self.directory.note_missing(response_id)
        raise responses_prompt.not_found(response_id)

    def _unavailable(self, response_id: str, why: str) -> OpenAIError:
        # No id in the text: it lands in records and dashboards, and a response id reads its response.
        return OpenAIError(503, f"the response could not be located: {why}; retry later",
                           retry_after_s=self.retry_after_s, param="previous_response_id")

    async def _http(self, address: str, response_id: str, headers: Mapping[str, str]) -> int:
        if self._session is None or self._session.closed:
            # Its own session (not the pool's): lookups must not queue behind probes and scrapes.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  auto_decompress=False)
        return await http_fetch(self._session, address, response_id, headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def metrics_families(directory: ResponseDirectory, lookup: ResponseLookup) -> Iterable[Any]:
    """The directory's and the lookups' figures as Prometheus families (read by the metrics thread: plain
    integers, a torn read costs at most one count)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("prefixroute_response_ids", "Responses API response ids the router knows the "
                            "endpoint of (bounded by --max-response-ids).", value=len(directory))
    yield CounterMetricFamily("prefixroute_response_id_hits", "Requests naming a response id the router knew "
                              "(pinned without a lookup; the route right after a lookup is not one).",
                              value=directory.num_hits)
    yield CounterMetricFamily("prefixroute_response_ids_learned", "Response ids learned (from responses seen, "
                              "or found by a lookup).", value=directory.num_learned)
    dropped = CounterMetricFamily("prefixroute_response_ids_dropped", "Response ids forgotten, by reason: "
                                  "expired (--response-id-ttl-s), evicted (--max-response-ids), endpoint (it left "
                                  "the pool or restarted).", labels=["reason"])
    dropped.add_metric(["expired"], directory.num_expired)
    dropped.add_metric(["evicted"], directory.num_evicted)
    dropped.add_metric(["endpoint"], directory.num_forgotten)
    yield dropped
    yield CounterMetricFamily("prefixroute_response_id_claims_refused", "Reports naming a response id the router "
                              "holds at another endpoint, or a second id for one response: refused (an id names "
                              "one response, produced once; a forged or replayed claim moves no conversation).",
                              value=directory.num_refused)
    lookups = CounterMetricFamily("prefixroute_response_lookups", "Lookups of unknown response ids on the "
                                  "endpoints, by outcome: found, not_found (404 everywhere), failed (503: an "
                                  "endpoint did not answer), refused (503: over --max-response-lookups).",
                                  labels=["outcome"])
    lookups.add_metric(["found"], lookup.num_found)
    lookups.add_metric(["not_found"], lookup.num_not_found)
    lookups.add_metric(["failed"], lookup.num_failed)
    lookups.add_metric(["refused"], lookup.num_refused)
    yield lookups
    yield CounterMetricFamily("prefixroute_response_lookup_requests", "GET /v1/responses/{id} requests the "
                              "lookups sent to endpoints.", value=lookup.num_requests)
    yield GaugeMetricFamily("prefixroute_response_lookups_in_flight", "Lookups in flight now.",
                            value=lookup.in_flight)


class ResponsesCollector:
    """A prometheus_client collector of `metrics_families` (register it on the router's metrics registry)."""

    def __init__(self, directory: ResponseDirectory, lookup: ResponseLookup) -> None:
        self.directory = directory
        self.lookup = lookup

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201
        yield from metrics_families(self.directory, self.lookup)
