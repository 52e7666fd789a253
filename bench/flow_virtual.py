"""Flow control on the virtual fleet: the live router's `FlowControl` (extproc/flow/control.py) on a
`VirtualFleet`'s clock, so ``--virtual`` sweeps and the oracle run the same queue as the gateway.

`FleetFlow` wraps a router's route function. At each arrival it reads the router's `loads()` (what its
saturation detector sees) and either places the request at once (below saturation: the route function, as
without flow control), holds it (the fleet's route answer None), or sheds it (an OpenAIError: 429/503). Held
requests are released after every engine step (`on_step`: a first token, a finished request or a step that
emptied a queue), each placed by the route function at that moment (late binding), while some endpoint has room;
a deadline timer (`VirtualFleet.call_at`) sheds those that wait too long. Placement is synchronous here, so
each release already sees the previous one's load (the live gate waits for `placed`).

`OracleFlow` gives the oracle's view: each server's true queued prefill (seconds, its own cost model), waiting
count and KV usage, and a request's true cheapest prefill (its best hit), so "oracle with queue" is the limit
for our router with its queue.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from prefixroute.extproc.flow.control import FlowControl, ReleaseReason, Verdict
from prefixroute.extproc.flow.queue import QueuedRequest
from prefixroute.extproc.flow.saturation import EndpointLoad, Saturation, SaturationDetector
from prefixroute.extproc.flow.settings import Classifier, FlowSettings
from prefixroute.extproc.tenants import Tenants
from prefixroute.model_servers.virtual_fleet import SimRequest, VirtualFleet
from prefixroute.openai_errors import OpenAIError

Route = Callable[[SimRequest, VirtualFleet], "int | str"]


class FleetFlow:
    """Flow control in front of `route` on `fleet` (module docstring). ``loads()``: each endpoint's load now;
    ``cost_of(req)``: its predicted service seconds (its cheapest prefill); ``group_of(req)``: a key shared by
    requests of one prefix (held members are re-costed when one is placed), or None. ``shed=False``: the
    counterfactual of a run's sheds (bench/results.py `false_sheds`): nothing is shed for its deadline, at
    arrival or while held (a held request waits until released); a full queue still sheds."""

    def __init__(self, fleet: VirtualFleet, route: Route, settings: FlowSettings, *,
                 loads: Callable[[], Sequence[EndpointLoad]], cost_of: Callable[[SimRequest], float],
                 group_of: Callable[[SimRequest], Hashable | None] = lambda req: None,
                 tenants: Tenants | None = None, shed: bool = True) -> None:
        self.fleet = fleet
        self.shed = shed
        self._route = route
        self.control = FlowControl(settings)
        self.detector = SaturationDetector(settings.saturation_queued_s, settings.saturation_waiting,
                                           settings.saturation_kv_usage_ratio)
        self.classifier = Classifier(settings, tenants)
        self.loads = loads
        self.cost_of = cost_of
        self.group_of = group_of
        self._held: dict[str, SimRequest] = {}
        self.waits_s: dict[str, float] = {}  # request id -> seconds it was held (released or shed)

    def saturation(self) -> Saturation:
        return self.detector.detect(self.loads())

    def route(self, req: SimRequest, fleet: VirtualFleet) -> int | str | None:
        now = fleet.now_s
        flow = self.classifier.classify(req.headers)
        saturation = self.saturation()
        if not saturation.saturated:  # nothing is held below saturation; no cost estimate either
            self.control.offer(QueuedRequest(req.request_id, 0, "", 0.0, 0, now), saturation, now)  # ADMIT
            if self._held:
                self.pump(ReleaseReason.ARRIVAL)  # held ones go first: they came earlier
            return self._place(req)
        deadline_s = now + flow.deadline_s if self.shed else float("inf")
        entry = QueuedRequest(req.request_id, flow.priority, flow.fairness_id, self.cost_of(req), len(req.body),
                              now, deadline_s, self.group_of(req))
        offer = self.control.offer(entry, saturation, now)
        for victim in offer.evicted:
            self._shed(victim, self.control.evicted_error(saturation, now))
        if offer.verdict is Verdict.SHED:
            assert offer.error is not None
            raise offer.error
        self._held[req.request_id] = req
        if self.shed:
            fleet.call_at(entry.deadline_s, self._expire)
        return None

    def _place(self, req: SimRequest) -> int | str:
        target = self._route(req, self.fleet)
        group = self.group_of(req)
        if group is not None:
            queue = self.control.queue
            for member in queue.group_members(group):
                queue.update_cost(member, self.cost_of(self._held[member.key]))  # type: ignore[index]
        return target

    def on_step(self, fleet: VirtualFleet, i: int) -> None:
        if self._held:
            self.pump(ReleaseReason.RELEASE)

    def pump(self, reason: ReleaseReason) -> None:
        """Release held requests while some endpoint has room, each placed now (late binding)."""
        fleet = self.fleet
        while self._held:
            entry = self.control.release(self.saturation(), fleet.now_s, reason)
            if entry is None:
                return
            req = self._held.pop(entry.key)  # type: ignore[arg-type]
            self.waits_s[req.request_id] = entry.waited_s(fleet.now_s)
            try:
                target = self._place(req)
            except OpenAIError as exc:  # the router refused it now (e.g. no healthy endpoint left)
                fleet.refuse(req.request_id, exc)
                continue
            fleet.dispatch(req.request_id, target)

    def _expire(self) -> None:
        now = self.fleet.now_s
        for entry, error in self.control.expire(self.saturation(), now):
            self._shed(entry, error)

    def _shed(self, entry: QueuedRequest, error: OpenAIError) -> None:
        req = self._held.pop(entry.key, None)  # type: ignore[arg-type]
        if req is not None:
            self.waits_s[req.request_id] = entry.waited_s(self.fleet.now_s)
            self.fleet.refuse(req.request_id, error)


class OracleFlow:
    """The oracle's `loads` and `cost_of` (module docstring), from the fleet's true state and `time_s`, the
    oracle's own pricing (tokens, decoding requests) -> seconds."""

    def __init__(self, fleet: VirtualFleet, time_s: Callable[[float, int], float],
                 own_tokens: Callable[[str], int | None]) -> None:
        self.fleet = fleet
        self.time_s = time_s
        self.own_tokens = own_tokens  # a placed request's uncached prompt tokens at its pick (None: unknown)
        self._base_s = time_s(1.0, 0)

    def loads(self) -> list[EndpointLoad]:
        out = []
        for ep, core in zip(self.fleet.endpoint_ids, self.fleet.engines):
            queued, decoding = 0.0, 0
            for r in core.running:
                if r.first_token_s is None:
                    queued += r.num_prompt_tokens - r.num_computed
                else:
                    decoding += 1
            for r in core.waiting:
                own = self.own_tokens(r.request_id)
                queued += r.num_prompt_tokens if own is None else own
            queued_s = self.time_s(queued, decoding) - self._base_s if queued else 0.0
            out.append(EndpointLoad(ep, queued_s, len(core.waiting), core.cache.usage_ratio,
                                    num_in_flight=len(core.running) + len(core.waiting)))
        return out

    def cost_of(self, req: SimRequest) -> float:
        n = len(req.prompt_ids)
        best_hit = max(self.fleet.cached_prefix_tokens(req), default=0)
        return self.time_s(max(1, n - best_hit), 0)

    def group_of(self, req: SimRequest) -> Hashable | None:
        hashes = self.fleet._hashes(req)  # noqa: SLF001 - the fleet's own block hashes of this request
        return hashes[min(3, len(hashes) - 1)] if hashes else None
