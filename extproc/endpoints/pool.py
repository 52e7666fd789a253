"""`EndpointPool`: the live view of the model-server endpoints (health, models, load metrics, in-flight).

Implements `prefixroute.extproc.endpoints.Pool`. Runs in the router's event loop (asyncio, single loop, not
thread-safe). Per endpoint, small loops share one keep-alive aiohttp session, so one slow or dead endpoint never
delays another:

- resolve (host names only; an IP literal is its own address): the name is looked up with the loop's
  executor-backed ``getaddrinfo`` (never blocking the loop) at start, every ``resolve_interval_s``, and at once
  after a passive failure (a restarted container gets a new address). The address (``ip:port``, ``[v6]:port``)
  is published in the snapshot (`EndpointState.address`) and is what probes, scrapes and Envoy connect to. A
  name that has never resolved is not probed, so never healthy, and is looked up again every
  ``probe_interval_s``. When a later lookup returns other addresses only, the endpoint moves to the first one
  and is down until that address answers a probe; a lookup that fails keeps the last address (a DNS outage
  must not take a working fleet down: probes still check it answers).
- probe: ``GET /health`` every ``probe_interval_s``; ``unhealthy_after_failures`` consecutive failures -> down,
  one success -> up. An endpoint starts down and comes up on its first successful probe (so nothing is routed
  to an endpoint never seen alive); call `wait_ready` before serving. Each probe has one outcome
  (`PROBE_OUTCOMES`, counted per endpoint): ``ok``; ``connection`` (refused, reset, closed: the process is gone),
  ``status`` (an answer other than 200) and ``identity`` (module `prefixroute.identity`) are the server's own
  word and count at once; ``timeout`` counts only when the router's event loop ran on time: a probe that timed
  out while the loop itself stalled for `LAG_DISCOUNT_RATIO` of ``probe_timeout_s`` or more (`LoopLag`, sampled
  in this loop) is ``discounted_for_lag`` and changes nothing, neither a failure nor a success (the answer may
  be sitting unread in the socket: a starved router must not eject the servers it could not listen to).
  Probes stay on this loop, measured (scripts/bench_probe_thread.py): a probe thread with a loop of its own kept
  its verdicts through Python-bound stalls of the main loop (18 in 6 s, against none), but made a busy main
  loop's timer lateness worse (p99 +2.5 to +11 ms in 3 of 4 alternations), and while the loop stalls that long
  its decisions miss Envoy's message timeout and fail open to round robin, which no verdict reaches.
- panic mode (Envoy's ``healthy_panic_threshold``): while fewer than ``healthy_panic_threshold_ratio`` of the
  endpoints pass their probes and at least one endpoint is *down for timeouts* (was up at its address, and its
  latest counted failure is a timeout), every such endpoint is published healthy with ``EndpointState.panic``
  set, so routing goes on as if it were healthy. An endpoint whose latest failure is a refused connection, a
  reset, an HTTP error or an identity failure stays out (routing there cannot help), and so does one never seen
  alive (so a starting pool is never in panic). Entering and leaving it are logged; its time is counted.
- passive failures (`report_failure`, from the gateway's served-endpoint reports) are a *suspicion*, never
  trusted alone: anyone who reaches the ext_proc port can forge one. The report probes the endpoint at once
  (a confirming probe); a failed confirming probe marks it down at once (no second failure needed) and
  looks its name up again; a successful one leaves it up (counted in `num_unconfirmed_failures`), and further
  reports for it are ignored for ``failure_probe_delay_s`` (so forged reports cost at most a few probes per
  second). A real failure (connection refused: the process died) is confirmed within one probe round trip;
  meanwhile Envoy's fallbacks serve the requests still sent there.
- models: ``GET /v1/models`` when the endpoint comes up and every ``models_interval_s`` (LoRA adapters listed
  there become routable). A failed fetch keeps the previous list; never fetched = empty = unknown = any model.
- scrape: ``GET /metrics`` every ``scrape_interval_s`` while up (less often for an endpoint whose scrapes take
  more than ``max_scrape_time_ratio`` of that: `endpoint_scrape_interval_s`), parsed by `scrape.parse_metrics`
  (only the needed lines). Figures older than ``metrics_stale_after_s`` are published as None (a sweep expires them even
  when no scrape lands); the age counted leaves out the time the router's loop was stalled since the scrape
  (the same `LoopLag`): figures the router had no chance to refresh are not the endpoint's fault.
- restarts: each scrape is compared with the endpoint's previous one (`scrape.restart_reason`: process start
  time changed, or a cumulative counter went backwards). A restart increments the endpoint's
  ``EndpointState.restart_epoch`` and is a structural change, so listeners learn of it (the router then drops
  that endpoint's prefix-index entries: its KV cache is empty). The pool only reports; it keeps no routing
  state.

Counted for /metrics (`health_figures`, read by `PoolHealthCollector` from the metrics thread): probes by
outcome, endpoints marked down by cause (`EJECTION_CAUSES`), panic mode's time and entries, the loop's lag,
scraped figures kept because the loop stalled.

Reading is O(1): `snapshot()` returns a tuple of immutable `EndpointState` that is replaced whole whenever a
lookup, probe, model fetch or scrape changes something. Listeners (`add_listener`) are called with the new
snapshot only on *structural* changes (membership, health, models, KV capacity, address, restart epoch), not on
every scrape.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import random
import socket
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path

import aiohttp

from prefixroute import identity
from prefixroute.extproc.endpoints import Listener
from prefixroute.extproc.endpoints.loop_lag import LoopLag
from prefixroute.extproc.endpoints.scrape import (ScrapedMetrics, event_addresses, parse_adapters, parse_endpoint_list, parse_metrics, parse_models,
                                                  read_endpoints_file, restart_reason)
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.types import EndpointId, EndpointState

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port) -> IP address strings``, best first; raises OSError when the name does not resolve."""
_FETCH_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)

OK, TIMEOUT, CONNECTION, STATUS, IDENTITY, DISCOUNTED = ("ok", "timeout", "connection", "status", "identity",
                                                         "discounted_for_lag")
PROBE_OUTCOMES = (OK, TIMEOUT, CONNECTION, STATUS, IDENTITY, DISCOUNTED)
"""What one health probe found (module docstring): ok; timeout; connection (refused, reset, closed); status (an
answer other than 200); identity (the answer did not prove the endpoint's identity); discounted_for_lag (timed
out while the router's loop stalled: no verdict)."""
MOVED = "moved"
EJECTION_CAUSES = (TIMEOUT, CONNECTION, STATUS, IDENTITY, MOVED)
"""Why an endpoint was marked down: its failing probes' outcome, or moved (its name resolved elsewhere: down until
the new address answers)."""
LAG_DISCOUNT_RATIO = 0.5
"""A timed-out probe counts against the endpoint only when the router's loop stalled for less than this fraction
of ``probe_timeout_s`` during it: the server then had at least half the timeout of the router's attention (a
healthy one answers in milliseconds) and did not answer."""


def format_address(ip: str, port: int) -> str:
    """``ip:port``, with an IPv6 address in brackets (``[::1]:8000``): what ORIGINAL_DST parses."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def literal_address(endpoint: EndpointId) -> str | None:
    """The address of an endpoint whose host is an IP literal (the endpoint itself, canonical), None for a name."""
    host, _, port = endpoint.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return format_address(str(ip), int(port))


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` passed. Not ``asyncio.wait_for``: on Python 3.11 it swallows a
    cancellation that lands as the event is set, and `close()` then waits forever for the loop it cancelled."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


async def resolve_host(host: str, port: int) -> list[str]:
    """The default `Resolver`: the event loop's ``getaddrinfo`` (runs in its executor, never blocks the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(sockaddr[0]) for _, _, _, _, sockaddr in infos]


def endpoint_specs(settings: PoolSettings) -> list[str]:
    """The endpoint specs of ``--endpoints`` then ``--endpoints-file`` (unvalidated; ValueError if the file
    cannot be read)."""
    specs: list[str] = list(settings.endpoints)
    if settings.endpoints_file:
        path = Path(settings.endpoints_file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read endpoints file {path}: {exc.strerror}") from None
        specs += read_endpoints_file(text)
    return specs


def event_addresses_from_settings(settings: PoolSettings) -> dict[EndpointId, tuple[str, str | None]]:
    """Endpoint -> (KV-event PUB address, replay address or None), for those that publish (see
    `scrape.event_addresses`)."""
    return event_addresses(endpoint_specs(settings), settings.kv_events_port_offset,
                           settings.kv_events_replay_port_offset)


def endpoints_from_settings(settings: PoolSettings) -> tuple[EndpointId, ...]:
    """Validated endpoints from ``--endpoints`` then ``--endpoints-file``; ValueError with a clear message when
    there are none and no ``--endpoints-dns`` name will discover some (then empty is the start)."""
    endpoints = parse_endpoint_list(endpoint_specs(settings))
    if not endpoints and not settings.endpoints_dns:  # discovered endpoints arrive later (set_endpoints)
        raise ValueError("no endpoints configured: pass --endpoints host:port,..., --endpoints-file PATH or "
                         "--endpoints-dns NAME:PORT (env PREFIXROUTE_ENDPOINTS / PREFIXROUTE_ENDPOINTS_FILE / "
                         "PREFIXROUTE_ENDPOINTS_DNS)")
    return endpoints


class _Watch:
    """Mutable per-endpoint bookkeeping (private; the outside world sees `EndpointState` snapshots)."""

    __slots__ = ("endpoint", "host", "port", "address", "healthy", "num_failures", "models", "models_fetched",
                 "metrics", "scraped_at_s", "fresh", "wake", "came_up", "resolved", "resolve_wake",
                 "num_lookup_failures", "tasks", "base_url", "suspect", "quiet_until_s", "restart_epoch",
                 "ever_scraped", "ever_up", "down_cause", "kept_scrape_at_s", "num_discounted",
                 "scrape_costs_s")

    def __init__(self, endpoint: EndpointId) -> None:
        self.endpoint = endpoint
        host, _, port = endpoint.rpartition(":")
        self.host = host
        self.port = int(port)
        self.address = literal_address(endpoint)  # None until the name resolves
        self.resolved = asyncio.Event()  # set once an address is known
        self.resolve_wake = asyncio.Event()  # set to look the name up now (after a passive failure)
        self.num_lookup_failures = 0
        self.base_url = ""  # http://ADDRESS once the address is known (probes wait for it)
        if self.address is not None:
            self.base_url = f"http://{self.address}"
            self.resolved.set()
        self.healthy = False
        self.num_failures = 0
        self.models: frozenset[str] = frozenset()
        self.models_fetched = False
        self.metrics = ScrapedMetrics()
        self.scraped_at_s: float | None = None
        self.fresh = False  # metrics published as current (not yet expired)
        self.wake = asyncio.Event()  # set to probe now (after a passive failure)
        self.came_up = asyncio.Event()  # set by the probe loop when the endpoint comes up
        self.tasks: list[asyncio.Task[None]] = []
        self.suspect = False  # a passive failure was reported: the next probe started confirms or clears it
        self.quiet_until_s = 0.0  # reports before this (clock) are ignored: the last one was not confirmed
        self.restart_epoch = 0  # restarts detected by the scrapes (published in EndpointState)
        self.ever_scraped = False  # `metrics` holds a real scrape (the baseline for restart detection)
        self.ever_up = False  # passed a probe at its current address once (panic mode never routes to it before)
        self.down_cause: str | None = None  # while down: the outcome of its latest counted failure (or MOVED)
        self.kept_scrape_at_s: float | None = None  # the scrape whose figures were last kept for loop lag
        self.num_discounted = 0  # probes discounted for lag since its last counted one (judged by the next)
        # Its latest scrapes' round trips, the router's loop stalls left out (their median is the scrape's cost).
        self.scrape_costs_s: collections.deque[float] = collections.deque(maxlen=5)


class EndpointPool:
    """Health, models, metrics and in-flight counts of a set of endpoints. See the module docstring."""

    def __init__(self, settings: PoolSettings, endpoints: Sequence[str] | None = None, *,
                 clock: Callable[[], float] = time.monotonic, resolver: Resolver = resolve_host,
                 lag: LoopLag | None = None) -> None:
        """`resolver` looks host names up (default: the loop's getaddrinfo; tests inject their own). `lag`: the
        loop's stalls (default: a `LoopLag` on `clock`, sampled from `start` to `close`)."""
        self.settings = settings
        self._clock = clock
        self._resolver = resolver
        self.lag = lag if lag is not None else LoopLag(clock=clock)
        self._lag_task: asyncio.Task[None] | None = None
        ids = parse_endpoint_list(endpoints) if endpoints is not None else endpoints_from_settings(settings)
        self._order: list[EndpointId] = list(ids)
        self._watches: dict[EndpointId, _Watch] = {}
        # LoRA adapter names any endpoint listed (``parent`` set in /v1/models): requests for them are hashed
        # with the adapter as vLLM's lora_name extra key (token mode). Only grows: a name once an adapter stays one.
        self.adapters: set[str] = set()
        self._states: list[EndpointState] = [EndpointState(ep, healthy=False, address=literal_address(ep))
                                             for ep in ids]
        self._pos: dict[EndpointId, int] = {ep: i for i, ep in enumerate(ids)}
        self._snapshot: tuple[EndpointState, ...] = tuple(self._states)
        self._in_flight: dict[EndpointId, int] = {ep: 0 for ep in ids}
        self._listeners: list[Listener] = []
        self.num_unconfirmed_failures = 0  # passive failure reports whose confirming probe succeeded
        self.num_identity_failures = 0  # health answers that did not prove the endpoint's identity
        self._identity_key = identity.resolve_key(settings.endpoint_identity_key_file)
        self.num_ignored_failure_reports = 0  # reports dropped: endpoint already down, confirming, or quiet
        self.num_restarts = 0  # restarts detected (all endpoints)
        # Health figures (`health_figures`): plain dicts, copied whole by the metrics thread.
        self.num_probes: dict[tuple[EndpointId, str], int] = {}  # (endpoint, PROBE_OUTCOMES) -> probes
        self.num_ejections: dict[tuple[EndpointId, str], int] = {}  # (endpoint, EJECTION_CAUSES) -> times down
        self.num_metrics_kept_for_lag = 0  # scrapes whose figures outlived the staleness limit by loop stalls only
        # Discounted probes judged by the endpoint's next counted probe: ("ok" right to discount, "failed" wrong)
        self.num_discounted_judged: dict[str, int] = {"ok": 0, "failed": 0}
        self.num_panic_picks = 0  # requests picked for an endpoint routed only by panic mode
        self._panic_since_s: float | None = None  # when the current panic began (None: not in panic)
        self._panic_s = 0.0  # time in panic mode before the current one
        self.num_panics = 0  # times panic mode began
        self._session: aiohttp.ClientSession | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    # --- reading --------------------------------------------------------------------------------------------
    def snapshot(self) -> tuple[EndpointState, ...]:
        """The current states, in configured order. O(1); the tuple is never mutated (a new one replaces it)."""
        return self._snapshot

    @property
    def in_flight(self) -> Mapping[EndpointId, int]:
        """Requests picked and not yet finished, per endpoint (a live read-only view; never negative)."""
        return self._in_flight

    @property
    def endpoints(self) -> tuple[EndpointId, ...]:
        return tuple(self._order)

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(snapshot)` now and after each structural change (membership, health, models, KV
        capacity). Listeners run synchronously in the event loop and must be quick; exceptions are logged."""
        self._listeners.append(listener)
        self._call(listener)

    # --- in-flight accounting ----------------------------------------------------------------------------------
    def acquire(self, endpoint: EndpointId) -> None:
        """A request was sent to `endpoint` (call at the pick, or when the served endpoint is known)."""
        self._in_flight[endpoint] = self._in_flight.get(endpoint, 0) + 1
        if self._panic_since_s is not None:  # (one attribute read outside panic mode)
            i = self._pos.get(endpoint)
            if i is not None and self._states[i].panic:
                self.num_panic_picks += 1

    def release(self, endpoint: EndpointId) -> None:
        """A request to `endpoint` ended (response done, failed or cancelled). Never goes below zero."""
        n = self._in_flight.get(endpoint, 0)
        if endpoint in self._pos:
            self._in_flight[endpoint] = n - 1 if n > 0 else 0
        elif n > 1:
            self._in_flight[endpoint] = n - 1
        else:
            self._in_flight.pop(endpoint, None)  # a removed endpoint whose last request just ended

    def report_failure(self, endpoint: EndpointId) -> None:
        """Passive failure reported (the gateway saw a connect refused/reset): a suspicion, not a verdict (module
        docstring). Probe the endpoint now; the probe loop marks it down if that probe fails. Ignored (counted)
        for an endpoint that is down, already being confirmed, or within ``failure_probe_delay_s`` of a report
        its probe did not confirm. Returns at once; never changes the snapshot itself."""
        w = self._watches.get(endpoint)
        if w is None or self._session is None or self._closed:  # probe loops run only between start and close
            return
        if not w.healthy or w.suspect or self._clock() < w.quiet_until_s:
            self.num_ignored_failure_reports += 1
            return
        w.suspect = True
        w.wake.set()

    @property
    def scrape_interval_s(self) -> float:
        """The scrape interval in effect: ``scrape_interval_s``, lengthened so the whole pool stays within
        ``max_scrapes_per_s``."""
        st = self.settings
        return max(st.scrape_interval_s, len(self._order) / st.max_scrapes_per_s)

    @property
    def metrics_stale_after_s(self) -> float:
        """The staleness limit in effect: ``metrics_stale_after_s``, or 10 scrape intervals if longer."""
        return max(self.settings.metrics_stale_after_s,
                   10 * self.scrape_interval_s if self.scrape_interval_s > self.settings.scrape_interval_s else 0.0)

    @property
    def in_panic(self) -> bool:
        """Panic mode is on (module docstring)."""
        return self._panic_since_s is not None

    def panic_seconds(self) -> float:
        """Time spent in panic mode since the pool was made, the current stretch included."""
        since = self._panic_since_s
        return self._panic_s + (self._clock() - since if since is not None else 0.0)

    def health_figures(self) -> dict[str, object]:
        """What the pool got right and wrong, for /metrics (thread-safe copies): ``probes`` {(endpoint, outcome):
        n}, ``ejections`` {(endpoint, cause): n}, ``panic`` (0/1), ``panic_seconds``, ``num_panics``,
        ``loop_lag_s`` (worst recent stall), ``loop_stall_s`` (all stalls), ``metrics_kept_for_lag``,
        ``discounted_judged`` {"ok": n, "failed": n} (discounted probes by the endpoint's next counted one: a
        failure says the discount may have hidden a real one), ``panic_picks``."""
        return {"probes": self.num_probes.copy(), "ejections": self.num_ejections.copy(),
                "panic": 1.0 if self.in_panic else 0.0, "panic_seconds": self.panic_seconds(),
                "num_panics": self.num_panics, "loop_lag_s": self.lag.max_lag_s(),
                "loop_stall_s": self.lag.total_stall_s, "metrics_kept_for_lag": self.num_metrics_kept_for_lag,
                "discounted_judged": self.num_discounted_judged.copy(), "panic_picks": self.num_panic_picks}

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the HTTP session and start watching every endpoint (returns at once; see `wait_ready`)."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.settings.max_connections_per_endpoint,
                                         keepalive_timeout=60, use_dns_cache=True)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              skip_auto_headers=("User-Agent", "Accept-Encoding"))
        self._lag_task = asyncio.create_task(self.lag.run(), name="pool-loop-lag")
        for ep in self._order:
            self._start_watch(ep)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="pool-stale-sweep")

    async def close(self) -> None:
        """Stop every loop and close the connections. Idempotent."""
        self._closed = True
        tasks = [t for w in self._watches.values() for t in w.tasks]
        if self._sweeper is not None:
            tasks.append(self._sweeper)
        if self._lag_task is not None:
            tasks.append(self._lag_task)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EndpointPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout_s: float, *, num_healthy: int | None = None) -> bool:
        """Wait until `num_healthy` endpoints (default: all) are up and have had their model list fetched once.
        Returns whether that happened within `timeout_s` (False is not an error: the pool keeps watching)."""
        want = len(self._order) if num_healthy is None else min(num_healthy, len(self._order))
        deadline = self._clock() + timeout_s
        while True:
            ready = sum(1 for w in self._watches.values() if w.healthy and w.models_fetched)
            if ready >= want:
                return True
            if self._clock() >= deadline:
                return False
            await asyncio.sleep(0.02)

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """Replace the membership (validated): new endpoints start down and are probed; removed ones stop being
        watched and leave the snapshot (listeners then drop their prefix-index entries)."""
        new = list(parse_endpoint_list(endpoints))
        for ep in [e for e in self._order if e not in new]:
            w = self._watches.pop(ep, None)
            if w is not None:
                for t in w.tasks:
                    t.cancel()
            if self._in_flight.get(ep) == 0:
                del self._in_flight[ep]
        for ep in new:
            self._in_flight.setdefault(ep, 0)
        self._order = new
        self._pos = {ep: i for i, ep in enumerate(new)}
        if self._session is not None:
            for ep in new:
                if ep not in self._watches:
                    self._start_watch(ep)
        self._update_panic()
        self._publish(structural=True)

    # --- internals -------------------------------------------------------------------------------------------
    def _start_watch(self, ep: EndpointId) -> None:
        w = _Watch(ep)
        self._watches[ep] = w
        w.tasks = [asyncio.create_task(self._probe_loop(w), name=f"probe {ep}"),
                   asyncio.create_task(self._models_loop(w), name=f"models {ep}"),
                   asyncio.create_task(self._scrape_loop(w), name=f"scrape {ep}")]
        if w.address is None:
            w.tasks.append(asyncio.create_task(self._resolve_loop(w), name=f"resolve {ep}"))

    def _panic_eligible(self, w: _Watch) -> bool:
        """Routed in panic mode: seen alive at its address, down only because its probes timed out."""
        return not w.healthy and w.ever_up and w.down_cause == TIMEOUT and w.address is not None

    def _fresh(self, w: _Watch, now: float) -> bool:
        """Its scraped figures are current: at most ``metrics_stale_after_s`` old, not counting the time the
        loop stalled since that scrape (module docstring)."""
        at = w.scraped_at_s
        if at is None:
            return False
        limit = self.metrics_stale_after_s
        if now - at <= limit:
            return True
        if now - at - self.lag.stall_s(at, now) > limit:
            return False
        if w.kept_scrape_at_s != at:
            w.kept_scrape_at_s = at
            self.num_metrics_kept_for_lag += 1
        return True

    def _state(self, ep: EndpointId, now: float) -> EndpointState:
        w = self._watches.get(ep)
        if w is None:
            return EndpointState(ep, healthy=False, address=literal_address(ep))
        m = w.metrics
        fresh = self._fresh(w, now)
        w.fresh = fresh
        panic = self._panic_since_s is not None and self._panic_eligible(w)  # (the pool's contract: healthy)
        healthy = w.healthy or panic
        if not fresh:
            return EndpointState(ep, healthy=healthy, models=w.models, num_gpu_blocks=m.num_gpu_blocks,
                                 block_size=m.block_size, num_cpu_blocks=m.num_cpu_blocks, scraped_at_s=w.scraped_at_s,
                                 address=w.address, restart_epoch=w.restart_epoch, panic=panic)
        return EndpointState(ep, healthy=healthy, models=w.models, num_requests_running=m.num_requests_running,
                             num_requests_waiting=m.num_requests_waiting, kv_cache_usage_ratio=m.kv_cache_usage_ratio,
                             num_gpu_blocks=m.num_gpu_blocks, block_size=m.block_size, num_cpu_blocks=m.num_cpu_blocks,
                             prefix_cache_tokens=m.prefix_cache_tokens, scraped_at_s=w.scraped_at_s, address=w.address,
                             restart_epoch=w.restart_epoch, panic=panic)

    def _update_panic(self) -> bool:
        """Enter or leave panic mode from the probe verdicts (module docstring); whether it changed."""
        ratio = self.settings.healthy_panic_threshold_ratio
        n = len(self._order)
        num_up = sum(1 for w in self._watches.values() if w.healthy)
        routed = sum(1 for w in self._watches.values() if self._panic_eligible(w))
        panic = ratio > 0 and num_up < ratio * n and routed > 0
        if panic == (self._panic_since_s is not None):
            return False
        now = self._clock()
        if panic:
            self._panic_since_s = now
            self.num_panics += 1
            log.warning("endpoint pool in panic mode: %d of %d endpoints pass their probes (below %.0f%%); routing "
                        "as if the %d that only timed out were healthy", num_up, n, ratio * 100, routed)
        else:
            since, self._panic_since_s = self._panic_since_s, None
            self._panic_s += now - since  # type: ignore[operator]
            log.warning("endpoint pool out of panic mode: %d of %d endpoints pass their probes (%.1f s in panic)",
                        num_up, n, now - since)  # type: ignore[operator]
        return True

    def _set_health(self, w: _Watch, healthy: bool, cause: str | None = None) -> None:
        """Mark `w` up, or down for `cause` (counted), and publish: the whole snapshot when panic mode began
        or ended, else `w`'s state."""
        w.healthy = healthy
        if healthy:
            w.ever_up = True
            w.down_cause = None
        else:
            w.down_cause = cause
            if cause is not None:
                key = (w.endpoint, cause)
                self.num_ejections[key] = self.num_ejections.get(key, 0) + 1
        self._health_changed(w)

    def _health_changed(self, w: _Watch) -> None:
        """`w`'s health or down cause changed: publish the whole snapshot when panic mode began or ended (every
        timed-out endpoint's routing changes), else `w`'s state."""
        if self._update_panic():
            self._publish(structural=True)
        else:
            self._publish(w, structural=True)

    def _publish(self, w: _Watch | None = None, *, structural: bool) -> None:
        """Replace the snapshot: rebuild `w`'s state only (a scrape landed: O(1) Python work plus a C-speed
        tuple copy, so 256 endpoints x 10 scrapes/s stay cheap), or every state when `w` is None."""
        now = self._clock()
        if w is None:
            self._states = [self._state(ep, now) for ep in self._order]
            self._pos = {ep: i for i, ep in enumerate(self._order)}
        else:
            i = self._pos.get(w.endpoint)
            if i is None:  # removed while a fetch was in flight
                return
            self._states[i] = self._state(w.endpoint, now)
        self._snapshot = tuple(self._states)
        if structural:
            for listener in self._listeners:
                self._call(listener)

    def _call(self, listener: Listener) -> None:
        try:
            listener(self._snapshot)
        except Exception:  # a faulty listener must not stop health tracking
            log.exception("endpoint pool listener failed")

    async def _get(self, w: _Watch, path: str, timeout_s: float) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.get(w.base_url + path, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     allow_redirects=False) as resp:
            return resp.status, await resp.read()

    async def _probe_health(self, w: _Watch, timeout_s: float) -> str:
        """GET /health: its outcome (`PROBE_OUTCOMES`, but never ``discounted_for_lag``: the caller judges the
        lag). Without an identity key every 200 is ok; with one, only an answer to a fresh challenge made with
        the key is (prefixroute.identity), any other 200 is ``identity``."""
        assert self._session is not None
        key = self._identity_key
        challenge = identity.new_challenge() if key else ""
        try:
            async with self._session.get(w.base_url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         allow_redirects=False,
                                         headers={identity.CHALLENGE_HEADER: challenge} if key else None) as resp:
                await resp.read()
                if resp.status != 200:
                    return STATUS
                if key and not identity.verify(key, challenge, resp.headers.get(identity.PROOF_HEADER)):
                    return IDENTITY
                return OK
        except asyncio.TimeoutError:  # (aiohttp's connect and read timeouts are TimeoutErrors too)
            return TIMEOUT
        except (aiohttp.ClientError, OSError):  # refused, reset, closed mid-answer, malformed answer
            return CONNECTION

    async def _resolve_loop(self, w: _Watch) -> None:
        st = self.settings
        while True:
            w.resolve_wake.clear()  # before the lookup: a wake-up requested during it triggers another one
            try:
                ips = await self._resolver(w.host, w.port)
                w.num_lookup_failures = 0
            except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
                ips = ()
                w.num_lookup_failures += 1
                # Warn once per outage: a name not resolving yet is normal while a stack starts.
                log.log(logging.WARNING if w.num_lookup_failures == 1 else logging.DEBUG,
                        "endpoint %s: %s does not resolve (%s)%s", w.endpoint, w.host, exc,
                        f"; keeping {w.address}" if w.address else "; not routed to until it does")
            if ips:
                self._set_address(w, [format_address(ip, w.port) for ip in ips])
            await _wait(w.resolve_wake, st.resolve_interval_s if w.address else st.probe_interval_s)

    def _set_address(self, w: _Watch, addresses: Sequence[str]) -> None:
        if w.address in addresses:
            return  # still valid: stay on it (a name with several addresses must not flap between them)
        old, w.address = w.address, addresses[0]
        w.base_url = f"http://{w.address}"
        if old is None:
            log.info("endpoint %s resolved to %s", w.endpoint, w.address)
            w.resolved.set()
        else:
            log.warning("endpoint %s moved from %s to %s", w.endpoint, old, w.address)
        w.ever_up = False  # not routed to until the new address answers a probe (not even in panic mode)
        w.wake.set()
        if w.healthy:
            self._set_health(w, False, MOVED)
        else:
            w.down_cause = MOVED
            self._health_changed(w)

    async def _probe_loop(self, w: _Watch) -> None:
        st = self.settings
        await w.resolved.wait()  # nothing to probe before the name resolves: the endpoint stays down
        while True:
            w.wake.clear()  # before probing: a wake-up requested during the probe then triggers another one
            url = w.base_url
            confirming = w.suspect  # only a probe started after the report may confirm or clear it
            started = self._clock()
            outcome = await self._probe_health(w, st.probe_timeout_s)
            if outcome == TIMEOUT and self.lag.stall_s(started) >= LAG_DISCOUNT_RATIO * st.probe_timeout_s:
                outcome = DISCOUNTED  # the router's loop, not the endpoint, was late: no verdict
            key = (w.endpoint, outcome)
            self.num_probes[key] = self.num_probes.get(key, 0) + 1
            if outcome == DISCOUNTED:
                w.num_discounted += 1
            elif w.num_discounted:  # the next verdict judges the discounts before it
                self.num_discounted_judged["ok" if outcome == OK else "failed"] += w.num_discounted
                w.num_discounted = 0
            if outcome == IDENTITY:
                # Something answers on its port but is not the server started there: down now, whatever its
                # health says, and not routed to until the real one answers again.
                w.num_failures = max(w.num_failures, st.unhealthy_after_failures - 1)
                self.num_identity_failures += 1
                if w.healthy or self.num_identity_failures in (1, 10, 100) or self.num_identity_failures % 1000 == 0:
                    log.error("endpoint %s failed its identity check: the process on %s is not the model server "
                              "started there (another process took its port?); not routed to", w.endpoint,
                              w.base_url)
            if url != w.base_url:
                continue  # the endpoint moved during the probe: probe the new address
            if confirming:
                w.suspect = False
            if outcome == OK:
                w.num_failures = 0
                if confirming:
                    # Alive: the report was wrong (forged, or a one-off reset). Reports are ignored for a while.
                    self.num_unconfirmed_failures += 1
                    w.quiet_until_s = self._clock() + st.failure_probe_delay_s
                    log.info("endpoint %s answers its probe: passive failure report not confirmed", w.endpoint)
                if not w.healthy:
                    log.info("endpoint %s is up", w.endpoint)
                    self._set_health(w, True)
                    w.came_up.set()
            elif outcome == DISCOUNTED:
                # Neither a failure nor a success; a report it was confirming is dropped unconfirmed (the next
                # real failure Envoy sees reports again).
                if self.num_probes[key] in (1, 10, 100) or self.num_probes[key] % 1000 == 0:
                    log.info("endpoint %s: a probe timed out while the router's event loop stalled (%.2f s); not "
                             "counted against it (%d such probes so far)", w.endpoint,
                             self.lag.stall_s(started), self.num_probes[key])
            else:
                w.num_failures += 1
                if confirming and w.healthy:
                    # Confirmed: down now, look the name up again (it may have moved), re-probe soon.
                    w.num_failures = max(w.num_failures, st.unhealthy_after_failures)
                    w.resolve_wake.set()
                    log.warning("endpoint %s marked down after a passive failure (confirmed by a failed probe: %s)",
                                w.endpoint, outcome)
                    self._set_health(w, False, outcome)
                    await _wait(w.wake, st.failure_probe_delay_s)
                    continue
                if w.healthy and w.num_failures >= st.unhealthy_after_failures:
                    log.warning("endpoint %s is down after %d failed probes (%s)", w.endpoint, w.num_failures,
                                outcome)
                    self._set_health(w, False, outcome)
                elif not w.healthy and w.down_cause != outcome:
                    # Still down, for another reason now (a hung server that died leaves panic mode's set).
                    w.down_cause = outcome
                    self._health_changed(w)
            await _wait(w.wake, st.probe_interval_s)

    async def _models_loop(self, w: _Watch) -> None:
        st = self.settings
        while True:
            if w.healthy:
                # Refresh periodically, or at once when the endpoint comes back up (it may have restarted
                # with other adapters).
                await _wait(w.came_up, st.models_interval_s)
            else:
                await w.came_up.wait()
            w.came_up.clear()
            if not w.healthy:
                continue
            try:
                status, body = await self._get(w, "/v1/models", st.probe_timeout_s * 2)
                if status == 200:
                    models = parse_models(body)
                    self.adapters.update(parse_adapters(body))
                    if models != w.models:
                        w.models = models
                        self._publish(w, structural=True)
                elif status == 404 and w.models:  # no model list: unknown = serves any model
                    w.models = frozenset()
                    self._publish(w, structural=True)
            except (*_FETCH_ERRORS, ValueError) as exc:
                log.debug("model list of %s not fetched: %s", w.endpoint, exc)
            w.models_fetched = True

    async def _scrape_loop(self, w: _Watch) -> None:
        st = self.settings
        # Spread the endpoints' scrapes over the interval: a burst of N scrapes at once would delay the
        # routing decisions sharing this event loop.
        await asyncio.sleep(random.random() * self.scrape_interval_s)
        while True:
            t0 = self._clock()
            if w.healthy:
                try:
                    status, body = await self._get(w, "/metrics", st.scrape_timeout_s)
                    t1 = self._clock()
                    w.scrape_costs_s.append(max(0.0, t1 - t0 - self.lag.stall_s(t0, t1)))
                    if status == 200:
                        m = parse_metrics(body)
                        structural = (m.num_gpu_blocks, m.block_size) != (w.metrics.num_gpu_blocks,
                                                                           w.metrics.block_size)
                        why = restart_reason(w.metrics, m) if w.ever_scraped else None
                        if why is not None:
                            w.restart_epoch += 1
                            self.num_restarts += 1
                            structural = True
                            log.warning("endpoint %s restarted (%s): its KV cache is empty", w.endpoint, why)
                        w.ever_scraped = True
                        w.metrics = m
                        w.scraped_at_s = self._clock()
                        self._publish(w, structural=structural)
                except _FETCH_ERRORS as exc:
                    log.debug("scrape of %s failed: %s", w.endpoint, exc)
            await asyncio.sleep(max(0.0, self.endpoint_scrape_interval_s(w.endpoint) - (self._clock() - t0)))

    def endpoint_scrape_interval_s(self, ep: EndpointId) -> float:
        """The scrape interval of one endpoint: the pool's (`scrape_interval_s`), lengthened while its scrapes
        take more than ``max_scrape_time_ratio`` of that time, never beyond half the staleness limit (so its
        figures never expire between two scrapes that land). A scrape's cost is the median round trip of its
        latest five, so one slow answer (or a stall of the router the loop-lag sampler under-counts) moves
        nothing."""
        interval = self.scrape_interval_s
        ratio = self.settings.max_scrape_time_ratio
        w = self._watches.get(ep)
        if w is None or ratio <= 0.0 or not w.scrape_costs_s:
            return interval
        cost_s = statistics.median(w.scrape_costs_s)
        if cost_s <= interval * ratio:
            return interval
        return max(interval, min(cost_s / ratio, self.metrics_stale_after_s / 2))

    async def _sweep_loop(self) -> None:
        """Expire stale metrics even when no scrape lands (a hung endpoint must not keep old load figures)."""
        while True:
            limit = self.metrics_stale_after_s
            await asyncio.sleep(limit / 4)
            now = self._clock()
            for w in self._watches.values():
                if w.fresh and (w.scraped_at_s is None or now - w.scraped_at_s > limit):
                    self._publish(w, structural=False)
