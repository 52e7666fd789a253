"""`KVEventsLink`: which endpoints a router matches by their KV events, and what it shows about them.

An endpoint that publishes KV events is matched against the events index only while its events can be trusted:
its subscriber is ``live`` (synced from the replay socket, connected, decoding) and the index has no reason to
think the publisher hashes other blocks than the router (`KVEventIndex.block_size_mismatch`,
`KVEventIndex.tokens_unverified`). Every other events endpoint is matched by the router's own index
(*feedback*: its picks, corrected by the cached tokens responses report), exactly as an endpoint without events
is. Its *events state* says why:

==================== ========================================================================================
``live``             matched by its events
``syncing``          subscribed; rebuilding from the replay socket (late join, reconnect)
``down``             not connected to its publisher
``undecodable``      its batches do not decode (subscriber: 2 in a row, or 4 of the last 16)
``block_size_mismatch`` its GPU blocks are neither a multiple of ``--kv-block-tokens`` tokens long nor a
                     divisor of it (a multiple is split into router blocks, a divisor such as SGLang's 1-token
                     pages merged into them: `KVEventIndex` module docstring)
``token_mismatch``   16 requests routed there over 10 s or more, and none found its blocks stored there
``unhealthy``        the endpoint fails its health probes (down, or routed only by the pool's panic mode) while
                     its events would otherwise be trusted (``live`` or ``syncing``): a publisher can outlive its
                     server (vLLM's EngineCore keeps its ZMQ socket after its API server is killed), so a silent
                     stream from a dead server must not pass for a quiet live one
==================== ========================================================================================

An ``unhealthy`` endpoint keeps its events-index entries (not matched meanwhile) and its subscription: when it
passes its probes again it is ``live`` at once if its subscriber stayed live, its entries intact. A server that
came back as a new process is caught as before: its publisher's new connection is replayed and checked against
the last batch applied (``publisher_restart``, ``reconnect_gap``: cleared and rebuilt), and the pool's restart
detection drops the router's own entries. Replay or clear on its return was the other choice: a replay repeats
what the subscriber already checks on every reconnect, and clearing would throw away the cache of a server that
was only unreachable for a while.

Where it shows: ``prefixroute_index_source_info{endpoint, source}`` (events / feedback) and
``prefixroute_kv_events_state{endpoint, state}`` on /metrics, the ready line (``index events x3 (2 live, 1
undecodable) + feedback``) and the dashboard's endpoint table (``events``, ``events (undecodable)``, ...). A
state other than live/syncing is logged once when it begins (an ERROR for undecodable and the mismatches, a
WARNING for down and unhealthy) and once when it ends.

Timing: a subscriber reports its state changes at once (`on_state`: the endpoint leaves ``events`` within
milliseconds of the second undecodable batch); the periodic `check` (every `CHECK_INTERVAL_S`) refreshes the
figures and runs the time-based ``token_mismatch`` rule. Everything runs on the router's event loop; `info`
(read by the metrics thread) is a dict replaced whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prefixroute.extproc.kv_events.index import MAX_SPLIT
from prefixroute.extproc.kv_events.subscriber import KVEventsManager
from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex

log = logging.getLogger("prefixroute.extproc")

CHECK_INTERVAL_S = 1.0
"""How often the link refreshes its figures and the time-based rules."""
TOKEN_MISMATCH_MIN_REQUESTS = 16
TOKEN_MISMATCH_MIN_AGE_S = 10.0
"""``token_mismatch``: this many requests routed to the endpoint, the first this long ago, none of which found
its first block stored there (a correct tokenization verifies an endpoint with its first routed request whose
prompt has a full block: once the server has computed it and published the store, ~ a TTFT later)."""
DOWN_GRACE_S = 2.0
"""A subscriber not yet connected is logged as down only once it stays so this long: at start its replay can
finish a moment before its connection is reported (down, then live, within a millisecond: a normal start, not a
warning). One that was live is logged at once."""
EVENT_STATES = ("live", "syncing", "down", "undecodable", "block_size_mismatch", "token_mismatch", "unhealthy")
_ERROR_STATES = ("undecodable", "block_size_mismatch", "token_mismatch")


class KVEventsLink:
    """The KV-events side of one router (module docstring). `core` is the `RouterCore` (its
    `set_event_endpoints`, `event_index`, `index_sources`); `snapshot` the pool's (block sizes from
    ``vllm:cache_config_info``), or None."""

    def __init__(self, core: Any, manager: KVEventsManager | None, addresses: dict[str, tuple[str, str | None]],
                 snapshot: Callable[[], Iterable[Any]] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.manager = manager
        self.addresses = addresses
        self.snapshot = snapshot
        self.endpoints: list[str] = []
        self.info: dict[str, dict[str, object]] = {}
        self.states: dict[str, tuple[str, str]] = {}  # endpoint -> (events state, detail)
        self._clock = clock
        self._size_warned: set[str] = set()
        self._down_since: dict[str, float] = {}  # endpoint -> when its current "down" began
        self._down_warned: set[str] = set()  # endpoints whose current "down" was logged
        self._was_live: set[str] = set()
        self._task: asyncio.Task | None = None

    def start(self, endpoints: list[str]) -> None:
        """Subscribe (every endpoint starts ``syncing``: matched by feedback until its replay is applied)."""
        self.endpoints = endpoints
        if self.manager is not None:
            self.manager.sync(self.addresses)
        self.check()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def update(self, endpoints: list[str], addresses: dict[str, tuple[str, str | None]]) -> None:
        """The membership changed (endpoint discovery): subscribe to exactly `addresses`; the endpoints that
        left lose their events' entries; new ones start ``syncing``."""
        self.endpoints = endpoints
        self.addresses = addresses
        if self.manager is not None:
            self.manager.sync(addresses)
        self.check()

    def on_pool_change(self, snapshot: object) -> None:
        """The pool's health changed (a pool listener): re-decide at once, so an endpoint that fails its probes
        leaves ``live`` within the probe that took it down, not at the next periodic check."""
        try:
            self.check()
        except Exception:  # noqa: BLE001 - a listener must not stop the pool
            log.exception("KV events check failed")

    def on_state(self, endpoint: str, state: str) -> None:
        """A subscriber's state changed: re-decide at once (the manager's ``on_state`` hook)."""
        try:
            self.check()
        except Exception:  # noqa: BLE001 - a hook must not stop the subscriber
            log.exception("KV events check failed")

    async def wait_settled(self, timeout_s: float) -> bool:
        """Until no subscriber is ``syncing`` (each replayed its publisher's buffer, or found it down), at most
        `timeout_s`: the ready line then says what the router knows, and the first requests route by events."""
        if self.manager is None:
            return True
        deadline = self._clock() + timeout_s
        while True:
            if all(s != "syncing" for s in self.manager.states().values()):
                self.check()
                return True
            if self._clock() >= deadline:
                self.check()
                return False
            await asyncio.sleep(0.02)

    def summary(self) -> str:
        """``x3 (2 live, 1 undecodable)``: for the ready line."""
        counts: dict[str, int] = {}
        for state, _ in self.states.values():
            counts[state] = counts.get(state, 0) + 1
        parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: EVENT_STATES.index(kv[0])))
        return f"x{len(self.addresses)}" + (f" ({parts})" if parts else "")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the check must never stop
                log.exception("KV events check failed")

    def _state_of(self, ep: str, st: Any, now: float, unhealthy: bool = False) -> tuple[str, str]:
        state, detail = st.state, st.state_detail
        if unhealthy and state in ("live", "syncing"):
            return "unhealthy", ("the endpoint fails its health probes: its events are not trusted until it passes "
                                 "them again (a publisher can outlive its server)")
        index = self.core.event_index
        if state == "live" and index is not None:
            n = index.tokens_unverified(ep, now, min_requests=TOKEN_MISMATCH_MIN_REQUESTS,
                                        min_age_s=TOKEN_MISMATCH_MIN_AGE_S)
            if n:
                state = "token_mismatch"
                detail = (f"none of the {n} requests routed there found their first block stored there, though "
                          f"it stores blocks: does the server tokenize prompts as the router does (tokenizer, "
                          f"chat template, BOS)?")
        return state, detail

    def check(self) -> None:
        """Route by events for the ``live`` endpoints only; log state changes; refresh `info`."""
        stats = self.manager.stats() if self.manager is not None else {}
        now = self._clock()
        down = ({str(s.endpoint) for s in self.snapshot() if not s.healthy or s.panic}
                if self.snapshot is not None else set())
        states = {ep: self._state_of(ep, st, now, ep in down) for ep, st in stats.items()}
        for ep, (state, detail) in states.items():
            old = self.states.get(ep, ("syncing", ""))[0]
            pub = self.addresses.get(ep, ("?", None))[0]
            if state == "down":  # said once, and only once it is news (DOWN_GRACE_S)
                since = self._down_since.setdefault(ep, now)
                if ep not in self._down_warned and (ep in self._was_live or now - since >= DOWN_GRACE_S):
                    self._down_warned.add(ep)
                    log.warning("KV events of %s (%s): down%s; its prefix matches come from the router's own index "
                                "(feedback) until they can be trusted", ep, pub, f": {detail}" if detail else "")
                continue
            self._down_since.pop(ep, None)
            was_down = ep in self._down_warned
            self._down_warned.discard(ep)
            if state == "live":
                self._was_live.add(ep)
            if state == old:
                continue
            if state == "token_mismatch":
                # (undecodable and block_size_mismatch are logged by the subscriber, with the bytes it saw)
                log.error("KV events of %s (%s): %s%s; its prefix matches come from the router's own index "
                          "(feedback) until they can be trusted", ep, pub, state, f": {detail}" if detail else "")
            elif state == "unhealthy" and old == "live":
                log.warning("KV events of %s (%s): unhealthy: the endpoint fails its health probes; its events "
                            "are not trusted until it passes them again", ep, pub)
            elif state == "live" and (old in _ERROR_STATES or old == "unhealthy" or was_down):
                log.warning("KV events of %s (%s): %s -> live: matching by its events again", ep, pub,
                            "down" if was_down else old)
        self.states = states
        if self.manager is not None:
            self.core.set_event_endpoints([ep for ep, (s, _) in states.items() if s == "live"])
        self._check_block_sizes()
        index = self.core.event_index
        blocks = index.num_blocks_by_endpoint() if index is not None else {}
        cpu_blocks = index.num_cpu_blocks_by_endpoint() if isinstance(index, TieredKVEventIndex) else {}
        sources = self.core.index_sources(self.endpoints)
        info: dict[str, dict[str, object]] = {}
        for ep in self.endpoints:
            d: dict[str, object] = {"source": sources.get(ep, "")}
            st = stats.get(ep)
            if st is not None:
                state, detail = states[ep]
                d.update(events_state=state, events_detail=detail, connected=st.connected, last_seq=st.last_seq,
                         num_batches=st.num_batches, num_events=st.num_events, num_gaps=st.num_gaps,
                         num_replays=st.num_replays, num_clears=st.num_clears,
                         num_decode_errors=st.num_decode_errors, num_unknown_events=st.num_unknown_events,
                         blocks=blocks.get(ep, 0), cpu_blocks=cpu_blocks.get(ep, 0), form=st.form,
                         server_block_tokens=index.block_size_seen(ep) if index is not None else None,
                         tokens_verified=int(index.is_verified(ep)) if index is not None else None,
                         stored_blocks_by_medium=st.stored_blocks_by_medium,
                         removed_blocks_by_medium=st.removed_blocks_by_medium)
            info[ep] = d
        self.info = info

    def _check_block_sizes(self) -> None:
        """Token blocks only match a server whose KV block size is a multiple or a divisor of --kv-block-tokens:
        say so once per endpoint whose scraped block or page size is neither (its events' blocks are skipped and
        counted too); a multiple or a divisor is said once at INFO (its blocks are split into the router's, its
        pages merged into them)."""
        want = self.core.settings.kv_block_tokens
        if self.snapshot is None or not self.core.settings.tokenizer:
            return
        for s in self.snapshot():
            if s.block_size and s.block_size != want and s.endpoint not in self._size_warned:
                self._size_warned.add(s.endpoint)
                if s.block_size % want == 0 and s.block_size // want <= MAX_SPLIT:
                    log.info("%s: KV block size %d (vllm:cache_config_info) = %d x --kv-block-tokens %d: its "
                             "blocks are matched as %d-token sub-blocks", s.endpoint, s.block_size,
                             s.block_size // want, want, want)
                    continue
                if want % s.block_size == 0:
                    log.info("%s: KV block size %d (its scraped block or page size) divides --kv-block-tokens %d: "
                             "its pages are merged into %d-token blocks (~100 bytes of router memory per cached "
                             "page)", s.endpoint, s.block_size, want, want)
                    continue
                log.warning("%s: KV block size %d (its scraped block or page size) is neither a multiple nor a "
                            "divisor of --kv-block-tokens %d: its prefix matches will not find its blocks; set "
                            "--kv-block-tokens to %d or a divisor of it", s.endpoint, s.block_size, want,
                            s.block_size)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.manager is not None:
            await self.manager.close()
