"""Decision replay: record every pick the router makes over a fixed, seeded workload, and check that a changed
router still makes exactly those picks. Not a benchmark and not a test: a tool for refactors of the routing
code ("routing decisions unchanged").

    python -m prefixroute.bench.decision_replay record FILE   # on the code to compare against
    python -m prefixroute.bench.decision_replay check FILE    # on the changed code: "N identical, M differ"

Two kinds of scenario, each fully deterministic (seeded workloads, seeded router, a fake or virtual clock; no
sockets, no threads):

- service scenarios: the router service (`extproc.service.PoolRouter` over an in-memory pool) routes a
  synthetic stream of chat, completions, Responses API (``previous_response_id`` of responses it learned),
  session (``x-session-id``) and ``/v1/models`` requests, for every policy x the index sources that learn from
  picks (approximate, feedback), plus a 300-endpoint pool (the prefix policy's sampled scoring) and token
  blocks (``--tokenizer sim``). Each pick's lifecycle is played back in a seeded order: first token, usage,
  release (sometimes before the first token, sometimes without usage), failovers (Envoy's served-endpoint
  report naming a fallback), the Responses id learned; another replica's messages (picks, done, release,
  failover, observations) arrive in batches, and the pool changes (an endpoint down and back, a restart).
- virtual-fleet scenarios: `bench.virtual_run.simulate_policy` (the same router service over the simulated
  engines, KV events in process) for every policy x every index source (approximate, feedback, events, auto)
  on a mixed workload.

Per decision the file holds the picked endpoints in order, the reason, the matched / total / pending / session
blocks, the predicted TTFT (rounded to 1e-6 ms) and the best alternative, plus what was published to the other
replicas; per virtual request its endpoint and the predicted TTFT. `check` compares scenario by scenario and
prints the first differences. The driver only uses the router service's request interface (`route`,
`first_token`, `usage`, `served`, `learn_response`, `release`, `apply_peer_batch`, `expire_peers`) and builds
the router in `_build_router`, the one place to follow a change of how routers are built.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import heapq
import inspect
import json
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import orjson

from prefixroute.bench import workloads
from prefixroute.bench.virtual_run import simulate_policy
from prefixroute.extproc.endpoints import Listener
from prefixroute.extproc.peers import codec
from prefixroute.extproc.response_directory import NeedsLookup
from prefixroute.extproc.routing.settings import POLICIES, RoutingSettings
from prefixroute.extproc.service import PoolRouter
from prefixroute.openai_errors import OpenAIError
from prefixroute.types import EndpointId, EndpointState

try:  # the record side may run on code from before the factory (see `_build_router`)
    from prefixroute.extproc.factory import build_router
except ImportError:  # pragma: no cover - only on older code
    build_router = None  # type: ignore[assignment]

FORMAT_VERSION = 1
VIRTUAL_SOURCES = ("approximate", "feedback", "events", "auto")
SERVICE_SOURCES = ("approximate", "feedback")


# --- the one place that builds a router (follow the code's factory here) -----------------------------------------
def _build_router(routing: RoutingSettings, pool: ReplayPool, clock: Callable[[], float],
                  publisher: Any = None) -> PoolRouter:
    """The router, its picks published to `publisher` (a scenario's stand-in for the other replicas)."""
    if build_router is None:  # code from before the one factory (extproc/factory.py): what it wired
        from prefixroute.extproc.routing.router import RouterCore
        router = PoolRouter(RouterCore(routing, track_prefill=True), pool, clock=clock)
    elif "peers" in inspect.signature(build_router).parameters:
        return build_router(routing, pool, clock=clock, peers=None if publisher is None else lambda _: publisher)
    else:  # code from before the factory built the router complete
        router = build_router(routing, pool, clock=clock)
    if publisher is not None:
        router.peers = publisher  # type: ignore[misc]  # older code's way
    return router


class ReplayPool:
    """An in-memory `extproc.endpoints.Pool`: fixed endpoints whose health, restart epoch and load figures the
    driver sets. Same contract as the live pool (snapshot replaced whole on change, listeners on structural
    changes)."""

    def __init__(self, ids: Sequence[str], *, num_gpu_blocks: int = 320, block_size: int = 16) -> None:
        self._order = tuple(EndpointId(e) for e in ids)
        self._states = [EndpointState(ep, models=frozenset({"m"}), num_requests_running=0, num_requests_waiting=0,
                                      kv_cache_usage_ratio=0.0, num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                      address=ep) for ep in self._order]
        self._snapshot = tuple(self._states)
        self._in_flight = {ep: 0 for ep in self._order}
        self._listeners: list[Listener] = []
        self.failures: list[EndpointId] = []
        self.adapters = None  # no LoRA adapters

    def snapshot(self) -> tuple[EndpointState, ...]:
        return self._snapshot

    @property
    def in_flight(self) -> Mapping[EndpointId, int]:
        return self._in_flight

    @property
    def endpoints(self) -> tuple[EndpointId, ...]:
        return self._order

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)
        listener(self._snapshot)

    def acquire(self, endpoint: EndpointId) -> None:
        self._in_flight[endpoint] += 1

    def release(self, endpoint: EndpointId) -> None:
        self._in_flight[endpoint] = max(0, self._in_flight[endpoint] - 1)

    def report_failure(self, endpoint: EndpointId) -> None:
        self.failures.append(endpoint)

    def scrape(self, rng: random.Random) -> None:
        """New load figures (not a structural change: no listener)."""
        self._states = [dataclasses.replace(s, num_requests_running=self._in_flight[s.endpoint],
                                            num_requests_waiting=rng.randrange(3),
                                            kv_cache_usage_ratio=round(rng.random(), 3)) for s in self._states]
        self._snapshot = tuple(self._states)

    def change(self, i: int, **fields: Any) -> None:
        """A structural change of endpoint `i` (health, restart epoch): listeners are called."""
        self._states[i] = dataclasses.replace(self._states[i], **fields)
        self._snapshot = tuple(self._states)
        for listener in self._listeners:
            listener(self._snapshot)


class _Publisher:
    """The other replicas' side of `PoolRouter.peers`: keeps what was published."""

    def __init__(self) -> None:
        self.messages: list[codec.Message] = []

    def publish(self, message: codec.Message) -> None:
        self.messages.append(message)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _text(rng: random.Random, n_words: int, tag: str) -> str:
    words = ("alpha", "beta", "gamma", "delta", "omega", "route", "cache", "prefix", "token", "block", "queue")
    return tag + " " + " ".join(rng.choice(words) for _ in range(n_words))


@dataclasses.dataclass
class _Live:
    pick: Any
    kind: str
    response: bool


class ServiceDriver:
    """One service scenario: a seeded stream of requests and lifecycle events through `PoolRouter`."""

    def __init__(self, routing: RoutingSettings, num_endpoints: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now_s = 0.0
        self.pool = ReplayPool([f"10.1.{i // 200}.{i % 200}:8000" for i in range(num_endpoints)])
        self.publisher = _Publisher()
        self.router = _build_router(routing, self.pool, lambda: self.now_s, self.publisher)
        self.events: list[tuple[float, int, str, int]] = []  # (time, seq, what, pick number)
        self.live: dict[int, _Live] = {}
        self.seq = 0
        self.systems = [_text(random.Random(f"{seed}:sys{g}"), 60 + 40 * (g % 5), f"system {g}")
                        for g in range(12)]
        self.sessions: dict[int, list[dict[str, str]]] = {}
        self.response_ids: list[str] = []
        self.peer_seq = 0
        self.peer_recent: list[tuple[int, str, tuple[int, ...]]] = []  # (seq, endpoint, hashes) of peers' picks
        self.own_hashes: list[tuple[int, ...]] = []
        self.start_s: dict[int, float] = {}  # pick number -> its arrival (for its TTFT)
        self.out: list[list[Any]] = []

    # --- requests ----------------------------------------------------------------------------------------
    def _request(self, n: int) -> tuple[str, str, dict[str, str], bytes, str]:
        rng = self.rng
        x = rng.random()
        if x < 0.02:
            return "GET", "/v1/models", {}, b"", "other"
        if x < 0.12:
            sid = rng.randrange(24)
            hist = self.sessions.setdefault(sid, [{"role": "system", "content": self.systems[sid % 12]}])
            hist.append({"role": "user", "content": _text(rng, 8, f"turn {n}")})
            body = {"model": "m", "stream": True, "messages": list(hist)}
            hist.append({"role": "assistant", "content": _text(rng, 6, f"answer {n}")})
            if len(hist) > 14:
                del self.sessions[sid]
            return "POST", "/v1/chat/completions", {"x-session-id": f"s{sid}"}, orjson.dumps(body), "session"
        if x < 0.20:
            body = {"model": "m", "input": _text(rng, 10, f"ask {n}"), "instructions": self.systems[n % 3]}
            if self.response_ids and rng.random() < 0.7:
                body["previous_response_id"] = rng.choice(self.response_ids[-40:])
            return "POST", "/v1/responses", {}, orjson.dumps(body), "responses"
        if x < 0.27:
            body = {"model": "m", "prompt": self.systems[rng.randrange(12)] + _text(rng, 5, f"q {n}")}
            return "POST", "/v1/completions", {}, orjson.dumps(body), "completion"
        g = min(int(rng.paretovariate(1.2)) - 1, 11)
        body = {"model": "m", "stream": True, "messages": [{"role": "system", "content": self.systems[g]},
                                                           {"role": "user", "content": _text(rng, 6, f"q {n}")}]}
        return "POST", "/v1/chat/completions", {}, orjson.dumps(body), "chat"

    def _schedule(self, at_s: float, what: str, n: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at_s, self.seq, what, n))

    def _route_one(self, n: int) -> None:
        method, path, headers, body, kind = self._request(n)
        published = len(self.publisher.messages)
        try:
            pick = self.router.route(method, path, headers, body)
        except NeedsLookup as e:
            self.out.append([n, kind, "lookup", e.response_id is not None])
            return
        except OpenAIError as e:
            self.out.append([n, kind, "error", e.status])
            return
        d = pick.decision
        news = [[type(m).__name__, m.endpoint, _r(m.pending_tokens), len(m.block_hashes)]
                for m in self.publisher.messages[published:] if type(m) is codec.Pick]
        self.out.append([n, kind, list(d.endpoints), d.reason, d.matched_blocks, d.total_blocks, d.pending_blocks,
                         d.session_blocks, _r(d.predicted_ttft_ms), d.alternative_endpoint,
                         _r(d.alternative_ttft_ms), news])
        if pick.request.block_hashes:
            self.own_hashes.append(tuple(pick.request.block_hashes))
        self.live[n] = _Live(pick, kind, kind == "responses")
        rng = self.rng
        ttft = 0.01 + d.total_blocks * 0.002 * (1.0 - 0.8 * (d.matched_blocks / max(1, d.total_blocks))) + \
            0.01 * self.pool.in_flight[d.endpoints[0]] + rng.random() * 0.01
        end = ttft + 0.05 + rng.random() * 0.4
        fate = rng.random()
        if fate < 0.06 and len(d.endpoints) > 1:
            self._schedule(self.now_s + 0.001, "failover", n)
        if fate < 0.1:
            self._schedule(self.now_s + ttft * 0.5, "release", n)  # ended before its first token was reported
            self._schedule(self.now_s + ttft, "first_token", n)
        else:
            self._schedule(self.now_s + ttft, "first_token", n)
            self._schedule(self.now_s + end, "release", n)
        if 0.95 < fate:
            self._schedule(self.now_s + ttft * 0.25, "usage", n)  # a usage report before the first token's
        if fate > 0.05:
            self._schedule(self.now_s + end + 0.001, "usage", n)

    def _lifecycle(self, what: str, n: int) -> None:
        live = self.live.get(n)
        if live is None:
            return
        pick, router = live.pick, self.router
        if what == "failover":
            router.served(pick, pick.endpoints[1], 200)
        elif what == "first_token":
            router.first_token(pick, max(0.001, self.now_s - self.start_s[n]))
        elif what == "usage":
            if live.response:
                rid = f"resp_{n}"
                router.learn_response(pick, rid, None)
                self.response_ids.append(rid)
            d = pick.decision
            prompt = max(1, d.total_blocks * 16 + 7)
            # A quarter of the responses found much less cached than predicted (the server evicted sooner than
            # the router's LRU assumed): the feedback source shrinks that endpoint's LRU.
            x = self.rng.random()
            cached = d.matched_blocks * 16 if x < 0.65 else d.matched_blocks * 4 if x < 0.9 else 0
            router.usage(pick, prompt, min(prompt, cached))
        elif what == "release":
            router.release(pick)

    # --- the other replicas and the pool ------------------------------------------------------------------
    def _peer_batch(self) -> None:
        rng = self.rng
        ids = self.pool.endpoints
        msgs: list[codec.Message] = []
        for _ in range(rng.randrange(1, 6)):
            x = rng.random()
            if x < 0.45 or not self.peer_recent:
                self.peer_seq += 1
                hashes = rng.choice(self.own_hashes) if self.own_hashes and rng.random() < 0.7 else \
                    tuple(rng.getrandbits(63) for _ in range(rng.randrange(1, 6)))
                ep = rng.choice(ids)
                msgs.append(codec.Pick(self.peer_seq, ep, hashes, float(rng.randrange(0, 4000)), None))
                self.peer_recent.append((self.peer_seq, ep, hashes))
            elif x < 0.65:
                msgs.append(codec.Done(rng.choice(self.peer_recent)[0]))
            elif x < 0.8:
                seq, _, _ = self.peer_recent.pop(rng.randrange(len(self.peer_recent)))
                msgs.append(codec.Release(seq))
            elif x < 0.88:
                seq, _, hashes = rng.choice(self.peer_recent)
                msgs.append(codec.Failover(seq, rng.choice(ids), hashes, None))
            else:
                p = float(rng.randrange(100, 5000))
                msgs.append(codec.Observed(rng.choice(ids), p, float(rng.randrange(0, int(p))),
                                           0.02 + rng.random() * 0.3, float(rng.randrange(0, 8000)),
                                           rng.randrange(0, 8)))
        self.router.apply_peer_batch(("peer-a", 1), msgs, self.now_s)

    def _pool_event(self, step: int) -> None:
        n = len(self.pool.endpoints)
        i = (step // 97) % n
        state = self.pool.snapshot()[i]
        if step % 3 == 0:
            self.pool.change(i, restart_epoch=state.restart_epoch + 1)
        else:
            self.pool.change(i, healthy=not state.healthy)

    def run(self, num_decisions: int) -> list[list[Any]]:
        rng = self.rng
        for n in range(num_decisions):
            self.now_s += rng.expovariate(40.0)
            while self.events and self.events[0][0] <= self.now_s:
                _, _, what, k = heapq.heappop(self.events)
                self._lifecycle(what, k)
            if n % 25 == 24:
                self._peer_batch()
            if n % 50 == 49:
                self.pool.scrape(rng)
                self.router.expire_peers(self.now_s)
            if n % 97 == 96:
                self._pool_event(n)
            self.start_s[n] = self.now_s
            self._route_one(n)
        return self.out


def _service_scenarios(num_decisions: int) -> dict[str, Callable[[], list[list[Any]]]]:
    out: dict[str, Callable[[], list[list[Any]]]] = {}
    for policy in POLICIES:
        for source in SERVICE_SOURCES:
            routing = RoutingSettings(policy=policy, index_source=source, rng_seed=7, num_fallbacks=2)
            out[f"service/{policy}@{source}"] = lambda r=routing: ServiceDriver(r, 6, 11).run(num_decisions)
    big = RoutingSettings(policy="prefix", index_source="feedback", rng_seed=3, max_scored_endpoints=16)
    out["service/prefix@feedback/300-endpoints"] = lambda: ServiceDriver(big, 300, 5).run(num_decisions)
    tok = RoutingSettings(policy="prefix", index_source="feedback", tokenizer="sim", rng_seed=9)
    out["service/prefix@feedback/token-blocks"] = lambda: ServiceDriver(tok, 8, 13).run(num_decisions)
    return out


def _virtual_scenarios(num_requests: int) -> dict[str, Callable[[], list[list[Any]]]]:
    out: dict[str, Callable[[], list[list[Any]]]] = {}
    mix = workloads.mix(num_requests=num_requests, seed=4, prefix_tokens=1024, document_tokens=2048)
    turns = workloads.multi_turn(num_sessions=12, num_turns=max(2, num_requests // 24), seed=4)

    def one(workload: workloads.Workload, policy: str, source: str) -> list[list[Any]]:
        predictions: list[tuple[str, float, float]] = []
        res, _, _ = simulate_policy(workload, policy, num_servers=4, seed=2, concurrency=12,
                                    predictions=predictions, index_source=source)
        rows: list[list[Any]] = [[r.index, r.endpoint, r.cached_tokens, r.error] for r in res]
        rows += [["prediction", ep, _r(p * 1000.0)] for ep, p, _ in predictions]
        return rows

    for policy in POLICIES:
        for source in VIRTUAL_SOURCES:
            out[f"virtual/{policy}@{source}/mix"] = lambda p=policy, s=source: one(mix, p, s)
        out[f"virtual/{policy}@auto/multi-turn"] = lambda p=policy: one(turns, p, "auto")
    return out


def scenarios(scale: float) -> dict[str, Callable[[], list[list[Any]]]]:
    """Every scenario by name (`scale` 1.0: ~20,000 decisions in all)."""
    return {**_service_scenarios(int(1200 * scale)), **_virtual_scenarios(int(300 * scale))}


def _isolated_environment() -> None:
    """Settings read the environment: a PREFIXROUTE_* variable would change the router under test."""
    for name in [n for n in os.environ if n.startswith("PREFIXROUTE_")]:
        del os.environ[name]


def _open(path: str, mode: str) -> IO[str]:
    """The file as text; gzip-compressed when its name ends in ``.gz`` (the committed golden is)."""
    return gzip.open(path, mode) if path.endswith(".gz") else open(path, mode[0])


def record(path: str, scale: float) -> int:
    _isolated_environment()
    doc: dict[str, Any] = {"version": FORMAT_VERSION, "scale": scale, "scenarios": {}}
    total = 0
    for name, run in scenarios(scale).items():
        t0 = time.perf_counter()
        rows = run()
        doc["scenarios"][name] = json.loads(json.dumps(rows))
        total += len(rows)
        print(f"{name}: {len(rows)} rows in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    with _open(path, "wt") as f:
        json.dump(doc, f, separators=(",", ":"))
    print(f"recorded {total} rows in {len(doc['scenarios'])} scenarios to {path}")
    return 0


def check(path: str, *, only: str = "", show: int = 5) -> int:
    """Replay every scenario of the file and compare row by row; 0 when all are identical."""
    _isolated_environment()
    with _open(path, "rt") as f:
        doc = json.load(f)
    if doc.get("version") != FORMAT_VERSION:
        print(f"{path}: format version {doc.get('version')}, this tool writes {FORMAT_VERSION}")
        return 2
    runs = scenarios(doc["scale"])
    same = differ = 0
    for name, want in doc["scenarios"].items():
        if only and only not in name:
            continue
        if name not in runs:
            print(f"{name}: no such scenario any more")
            differ += len(want)
            continue
        got = json.loads(json.dumps(runs[name]()))
        bad = [i for i in range(max(len(want), len(got))) if i >= len(want) or i >= len(got) or want[i] != got[i]]
        same += max(len(want), len(got)) - len(bad)
        differ += len(bad)
        print(f"{name}: {len(want) - len([i for i in bad if i < len(want)])} identical, {len(bad)} differ",
              file=sys.stderr)
        for i in bad[:show]:
            print(f"  row {i}: recorded {want[i] if i < len(want) else None}\n"
                  f"          replayed {got[i] if i < len(got) else None}")
    print(f"{same} identical, {differ} differ")
    return 0 if differ == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "check"))
    parser.add_argument("file")
    parser.add_argument("--scale", type=float, default=1.0, help="record: workload size (1.0: ~20,000 decisions)")
    parser.add_argument("--only", default="", help="check: only the scenarios whose name contains this")
    args = parser.parse_args(argv)
    if args.action == "record":
        return record(args.file, args.scale)
    return check(args.file, only=args.only)


if __name__ == "__main__":
    raise SystemExit(main())
