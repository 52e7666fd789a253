"""Flow control in the live router: `FlowHold` is what the router service asks (`PoolRouter.flow`)
and `FlowListener` what tells it that capacity freed.

- `admits_now()`: True below saturation (the request is routed at once, as without flow control; held ones, if
  any, are released first); False past it: the router service raises `NeedsHold` and the servicer awaits
  `hold(request, headers)` (the request's class from its headers, its cheapest prefill and prefix group from
  the router's view), then routes it with the state at that moment and calls `placed(ticket)`.
- `FlowListener` (a lifecycle listener): a first token or a released request pumps the gate; a timer at the
  pool's scrape interval pumps it too while something is held (a scrape that shows room; also the net under a
  lost event). Nothing runs while nothing is held.

One event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from prefixroute.extproc.lifecycle import LifecycleListener, Pick
from prefixroute.extproc.routing.request import InferenceRequest

from .control import ReleaseReason
from .gate import FlowGate, Ticket
from .router import RouterView
from .settings import Classifier


class FlowHold:
    """The router service's port to flow control (module docstring)."""

    def __init__(self, gate: FlowGate, classifier: Classifier, view: RouterView, *, tick_s: float = 0.05) -> None:
        """`tick_s`: how often a held queue re-reads the pool (its scrape interval)."""
        self.gate = gate
        self.classifier = classifier
        self.view = view
        self.tick_s = tick_s
        self._tick: asyncio.TimerHandle | None = None

    def admits_now(self) -> bool:
        """Whether a new request is routed at once (some endpoint has room). Counts it as admitted if so."""
        gate = self.gate
        control = gate.control
        # The first endpoint with room answers (not the whole pool): below saturation this costs one or a few
        # endpoints' figures per decision. The signal shown is then that endpoint's ratio, not the pool's least.
        room = self.view.room_ratio(gate.detector)
        if room is None:
            control.stats.saturation_signal = gate.saturation().signal
            return False
        control.stats.saturation_signal = room
        control.stats.num_admitted += 1
        if gate.num_held:
            gate.pump(ReleaseReason.ARRIVAL)
        return True

    async def hold(self, request: InferenceRequest, headers: Mapping[str, str]) -> Ticket:
        """Hold `request` until released (returns its ticket) or shed (raises `control.Shed`, an OpenAIError
        429/503 with retry_after_s). Cancelled (client gone): it leaves the queue."""
        view = self.view
        flow_class = self.classifier.classify(headers)
        self._ensure_tick()
        return await self.gate.admit(request, flow_class, cost_s=view.cost_of(request),
                                     num_bytes=request.num_prompt_chars, group=view.group_of(request))

    def placed(self, ticket: Ticket) -> None:
        self.gate.placed(ticket)

    def deadline_s(self, headers: Mapping[str, str]) -> float:
        """The queue deadline a request with these headers gets (what Envoy must wait for its answer)."""
        return self.classifier.classify(headers).deadline_s

    def _ensure_tick(self) -> None:
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(self.tick_s, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        gate = self.gate
        if gate.num_held:
            gate.pump(ReleaseReason.SCRAPE)
            self._ensure_tick()


class FlowListener(LifecycleListener):
    """Capacity events for the gate: a first token, a released request (module docstring)."""

    def __init__(self, gate: FlowGate) -> None:
        self.gate = gate

    def on_first_token(self, pick: Pick) -> None:
        if self.gate.num_held:
            self.gate.pump(ReleaseReason.FIRST_TOKEN)

    def on_released(self, pick: Pick) -> None:
        if self.gate.num_held:
            self.gate.pump(ReleaseReason.RELEASE)


def flow_for(settings, *, tick_s: float, stale_after_s: float):  # noqa: ANN001, ANN201
    """What builds flow control for a router (`PoolRouter`'s ``flow`` argument, given by `factory.build_router`)
    per `settings` (`FlowSettings`): called with the router at the end of its construction, it adds the capacity
    listener and returns the router's `FlowHold` (its `FlowControl`, for /metrics: ``hold.gate.control``).
    Requests are classified by what ``router.tenants`` trusts (extproc/tenants.py). `tick_s`: the pool's scrape
    interval; `stale_after_s`: its metrics_stale_after_s."""
    from .control import FlowControl
    from .saturation import SaturationDetector

    def build(router) -> FlowHold:  # noqa: ANN001
        view = RouterView(router, stale_after_s=stale_after_s, drain=settings.saturation_drain)
        # The drain rate leaves out the router's own loop stalls (the gate's clock is the loop's: monotonic, as
        # the pool's lag sampler's).
        control = FlowControl(settings, stall_s=view.stall_s)
        detector = SaturationDetector(settings.saturation_queued_s, settings.saturation_waiting,
                                      settings.saturation_kv_usage_ratio)
        gate = FlowGate(control, detector, view.loads, recost=view.cost_of)
        router.add_listener(FlowListener(gate))
        return FlowHold(gate, Classifier(settings, router.tenants), view, tick_s=tick_s)

    return build
