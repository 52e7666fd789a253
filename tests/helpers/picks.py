"""Real `lifecycle.Pick` records for tests of the parts that read them (servicer, tracker): the router service's
own record type, never a hand-made stand-in."""

from __future__ import annotations

from prefixroute.extproc.lifecycle import Pick
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.types import Decision, EndpointId

CHAT = InferenceRequest(kind="chat", path="/v1/chat/completions", model="m", stream=True)


def make_pick(addresses: tuple[str, ...], decision: Decision | None = None, request: InferenceRequest | None = None,
              decision_us: float = 10.0) -> Pick:
    """A pick of `addresses` (primary first) for `request` (default: a streamed chat), routed by `decision`
    (default: a cold prefix-policy decision naming the same endpoints)."""
    ids = tuple(EndpointId(a) for a in addresses)
    if decision is None:
        decision = Decision(endpoints=ids, reason="cold", policy="prefix")
    return Pick(addresses, ids, request if request is not None else CHAT, decision, decision_us)
