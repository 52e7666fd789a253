"""Settings of flow control at the gateway, and how a request's headers map to its class."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

from prefixroute.extproc.headers import FAIRNESS_HEADER, OBJECTIVE_HEADER, PRIORITY_HEADER
from prefixroute.extproc.tenants import DEFAULT_FLOW, Tenants
from prefixroute.settings import Settings, setting

DEFAULT_FAIRNESS_ID = DEFAULT_FLOW
"""A request without a fairness id is of this flow (GIE's name for it)."""


@dataclasses.dataclass(frozen=True)
class FlowSettings(Settings):
    """When the gateway holds requests, in what order it releases them and when it sheds them. Immutable;
    validated on construction."""

    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_"
    TITLE: ClassVar[str] = "Flow control"

    flow_control: bool = setting(
        True,
        "Hold requests in the router while no endpoint can start one soon (saturation), release them in priority, "
        "tenant-fair, shortest-predicted-prefill-first order as capacity frees, and shed with 429 past their "
        "deadline or a full queue. Below saturation nothing is held. Off: every request goes to an engine's queue "
        "at once (engines queue first come, first served).")
    saturation_queued_s: float = setting(
        0.25,
        "An endpoint has room while the time model predicts less than this many seconds of queueing (prefill "
        "ahead, decoding load included) there: enough work queued on each engine to keep it busy between releases "
        "(a few engine steps), little enough that the order is decided here, where a cache hit can go first.")
    saturation_drain: bool = setting(
        False,
        "How the detector reads an endpoint's predicted queueing. Off (default): the prefill of every streamed "
        "request sent there counts as queued until its first token (or its end) is reported, so the gate reopens "
        "only when the server shows progress (a non-streamed response reports no first token: its prefill drains "
        "at the predicted rate). On: the old estimate for every request, that queued prefill "
        "drains at the time model's predicted rate between events; it reopens the gate early (releasing work into "
        "a still full engine queue) whenever the real server is slower than predicted.")
    saturation_waiting: int = setting(
        5,
        "An endpoint has room only while its scraped vllm:num_requests_waiting is under this (GIE's saturation "
        "detector's queue depth default). Checked only while the scrape is fresh.")
    saturation_kv_usage_ratio: float = setting(
        0.8,
        "An endpoint has room only while its scraped vllm:kv_cache_usage_perc is under this (GIE's default 0.8): "
        "past it an engine preempts. Checked only while the scrape is fresh.")
    max_queued_requests: int = setting(
        4096,
        "Most requests held at once; a request arriving at a full queue evicts the newest held request of a lower "
        "priority class, or is shed (429).")
    max_queued_mb: float = setting(
        256.0,
        "Most megabytes of request bodies held at once (bounds the router's memory as max_queued_requests bounds "
        "the count: 4096 x 64 KB prompts).")
    deadline_s: float = setting(
        30.0,
        "Default most seconds a request may wait in the gateway queue: it is shed (429 with Retry-After) when its "
        "deadline passes while held, or at once when the queue's drain rate says it would. The deadline_header "
        "overrides it per request. 30 s: past it most interactive clients have given up.")
    max_deadline_s: float = setting(
        60.0,
        "Most seconds any request may wait in the gateway queue, whatever its deadline header asks: Envoy waits "
        "for a held answer only up to its extproc_max_hold_s (90 s by default), so this stays under it.")
    deadline_header: str = setting(
        "x-prefixroute-deadline-ms",
        "Request header (lower case): most milliseconds this request may wait in the gateway queue.")
    priority_header: str = setting(
        PRIORITY_HEADER,
        "Request header (lower case) set by a trusted ingress: the request's priority, an integer (higher first; "
        "< 0 sheddable first, as GIE's InferenceObjective priority; default 0). Read only with 'priority' in "
        "trusted_headers (a client's own copy sets nothing); takes precedence over the tenant table and "
        "objective_header.")
    objective_header: str = setting(
        OBJECTIVE_HEADER,
        "Request header (lower case) naming the request's InferenceObjective (GIE's header); its priority is "
        "looked up in objective_priorities (unknown names: 0). Read only with 'objective' in trusted_headers.")
    objective_priorities: tuple[str, ...] = setting(
        (),
        "InferenceObjective priorities, name=priority pairs separated by commas (e.g. "
        "critical=100,standard=0,batch=-1): the spec.priority of the pool's InferenceObjectives.")
    fairness_header: str = setting(
        FAIRNESS_HEADER,
        "Request header (lower case) naming the request's flow for fairness across tenants (GIE's fairness id "
        "header), read with 'fairness' in trusted_headers (the default: prefixroute's Envoy sets it to the "
        "client's address, whatever the client sent). A request of a tenant (the tenant table, or a trusted "
        "tenant header) is its tenant's flow instead; without either, one default flow.")
    max_wait_ratio: float = setting(
        2.0,
        "Aging: the oldest held request of a tenant goes first once it has waited this many times the average "
        "wait of its class (and at least aging_min_s), so shortest-first ordering never starves a long prompt. "
        "2: over 17 points of the virtual suite (conversation trace slices, agent loops, mix, documents, 288 x "
        "8k-token prompts at 40-300% of capacity), against the same router without a queue, the queue lost 3 points "
        "(TTFT P90 or P99 over 1.05x, or hit ratio 0.005 under) at 1.5 and 2, 6 at 2.5 and 3, 8 at 4; at 2 it "
        "served the most requests within their deadline and shed the fewest, for a smaller median gain (P50 0.68x "
        "the no-queue router's, 0.54x at 4).")
    aging_min_s: float = setting(
        1.0,
        "Aging never takes over before a request has waited this long (the average is near 0 as a queue starts).")

    def __post_init__(self) -> None:
        if self.saturation_queued_s <= 0 or self.saturation_waiting <= 0 or self.saturation_kv_usage_ratio <= 0:
            raise ValueError("saturation bounds must be > 0")
        if self.max_queued_requests < 1 or self.max_queued_mb <= 0:
            raise ValueError("max_queued_requests must be >= 1 and max_queued_mb > 0")
        if not 0 < self.deadline_s <= self.max_deadline_s:
            raise ValueError("deadline_s must be > 0 and at most max_deadline_s")
        if self.max_wait_ratio < 1 or self.aging_min_s < 0:
            raise ValueError("max_wait_ratio must be >= 1 and aging_min_s >= 0")
        self.objectives()  # validates the pairs

    @property
    def max_queued_bytes(self) -> int:
        return int(self.max_queued_mb * 1024 * 1024)

    def objectives(self) -> dict[str, int]:
        """objective_priorities as name -> priority; raises ValueError on a malformed pair."""
        out: dict[str, int] = {}
        for pair in self.objective_priorities:
            name, sep, value = pair.partition("=")
            try:
                if not sep or not name.strip():
                    raise ValueError
                out[name.strip()] = int(value)
            except ValueError:
                raise ValueError(f"objective_priorities: expected name=integer, got {pair!r}") from None
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class FlowClass:
    """What flow control needs of a request's headers: its priority, its flow (fairness id) and its deadline."""

    priority: int = 0
    fairness_id: str = DEFAULT_FAIRNESS_ID
    deadline_s: float = 30.0


class Classifier:
    """Maps request headers (lower-case names) to a `FlowClass`, believing only what `tenants` trusts
    (extproc/tenants.py: the operator's table and the headers a trusted ingress sets; a client's own priority,
    tenant or fairness header sets nothing). Priority: a trusted priority header, else the tenant's in the table,
    else a trusted objective's in objective_priorities, else 0. A malformed deadline is ignored (the default
    applies): a client's typo must not turn into a 400 from a part that only orders work."""

    def __init__(self, settings: FlowSettings, tenants: Tenants | None = None) -> None:
        self.settings = settings
        self.tenants = tenants if tenants is not None else Tenants(
            priority_header=settings.priority_header, objective_header=settings.objective_header,
            fairness_header=settings.fairness_header)
        self._objectives = settings.objectives()

    def classify(self, headers: Mapping[str, str]) -> FlowClass:
        s = self.settings
        client = self.tenants.resolve(headers)
        priority = client.priority
        if priority is None:
            objective = self.tenants.objective(headers)
            priority = self._objectives.get(objective, 0) if objective else 0
        deadline_s = s.deadline_s
        ms = _float(headers.get(s.deadline_header)) if s.deadline_header else None
        if ms is not None and ms > 0:
            deadline_s = min(ms / 1000.0, s.max_deadline_s)
        return FlowClass(priority, client.flow, deadline_s)


def _float(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        v = float(raw.strip())
    except ValueError:
        return None
    return v if math.isfinite(v) else None
