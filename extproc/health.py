"""The picker's gRPC health service (grpc.health.v1 Check), as the Gateway API Inference Extension's endpoint
picker protocol asks: Envoy's gRPC health check of the ext_proc cluster (GIE's reference configuration asks for
``envoy.service.ext_proc.v3.ExternalProcessor``) and Kubernetes' grpc probes (``liveness``, ``readiness``).

Services and their answers (`HealthServicer.status`):
- ``liveness``: SERVING whenever the process answers (a live process is never restarted for an empty pool);
- ``readiness``, ``envoy.service.ext_proc.v3.ExternalProcessor``, ``""`` (the server as a whole) and
  ``inference-extension`` (the service name GIE's and llm-d's charts probe with one replica): SERVING when the
  picker can route, `ready()` (cli.py: at least one endpoint healthy, and the KV-events index connected to at
  least one endpoint when ``--index-source events`` makes it the only source), else NOT_SERVING;
- any other name: the NOT_FOUND status the gRPC health protocol prescribes for an unknown service.
Watch is answered UNIMPLEMENTED (not registered), as GIE's reference picker does; Envoy and the kubelet only
call Check.

Served on the ext_proc port itself (where Envoy checks it, behind the same TLS, without the bearer token: the
answer tells nothing but serving / not serving) and optionally on a plaintext `health_port` of its own, for
kubelet probes, which speak neither TLS nor bearer tokens (GIE's picker: port 9003). `ready` runs on the event
loop, once per check: it must be cheap and must not block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from prefixroute.extproc import wire

LIVENESS = "liveness"
READINESS = "readiness"
READINESS_SERVICES = frozenset({READINESS, wire.SERVICE_NAME, "", "inference-extension"})
"""Names answered with the picker's readiness (module docstring)."""

SERVING = wire.HealthCheckResponse.SERVING
NOT_SERVING = wire.HealthCheckResponse.NOT_SERVING


class HealthServicer:
    """grpc.health.v1 Check over a readiness predicate (module docstring). Serve it with
    ``wire.add_health_to_server(server, servicer.Check)``."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready
        self._serving = wire.HealthCheckResponse(status=SERVING)
        self._not_serving = wire.HealthCheckResponse(status=NOT_SERVING)

    def status(self, service: str) -> int | None:
        """The ServingStatus of `service`, None for an unknown name."""
        if service == LIVENESS:
            return SERVING
        if service in READINESS_SERVICES:
            return SERVING if self.ready() else NOT_SERVING
        return None

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802 - gRPC name
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:200]!r}")
        return self._serving if status == SERVING else self._not_serving
