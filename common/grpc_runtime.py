"""gRPC's C-core settings that prefixroute's processes start with (the ext_proc's CPU per request).

gRPC reads ``GRPC_EXPERIMENTS`` once, when `grpc` is first imported; setting it later does nothing (measured:
a server that sets it after ``import grpc`` costs what one without it does). So `apply_grpc_defaults` runs in the
console script (common/cli.py) before any command module is imported, and every child a launcher starts
(`prefixroute up`'s telemetry receiver, say) inherits the variable; `GatewayProcesses` passes it to its ext_proc
replicas explicitly (`grpc_child_env`), whoever launched it.

Contract: a ``GRPC_EXPERIMENTS`` the user set, even to the empty string (gRPC's own defaults), is never changed.

Why `GRPC_EXPERIMENTS_DEFAULT` turns gRPC's ``event_engine_listener`` experiment off (grpcio 1.85, on by default
there): the server then accepts and serves connections on gRPC's older iomgr listener instead of the
EventEngine one, and a Python server pays less CPU per message. `scripts/bench_grpc_servers.py` (a bare
bidirectional stream, 2 round trips per request, the routing stream's shape): 430-530 against 620-700 us of
server CPU per request; `prefixroute overhead-bench --extproc-variants grpc-event-engine-listener` measures it
in the router (docs/benchmarks.md). Servers only: gRPC clients (the OTLP exporter, health checks) are unchanged.
If a later grpcio drops the experiment, gRPC logs ``Unknown experiment`` at start and runs its default;
tests/integration/core/test_grpc_runtime.py fails on such a grpcio, so the setting is reviewed, not left dead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

GRPC_EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
GRPC_EXPERIMENTS_DEFAULT = "-event_engine_listener"
"""gRPC experiments prefixroute's processes start with when the user set none (module docstring: why)."""
GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
GRPC_FORK_SUPPORT_DEFAULT = "false"
"""gRPC's fork handlers off unless the user set them: prefixroute's processes start children only by fork + exec
(`subprocess`, multiprocessing's "spawn"), never a forked child that goes on using gRPC, and with the handlers on
grpcio 1.80-1.85 restarts its epoll poller in the child between fork and exec, where ``close_fds`` has closed its
epoll descriptor: the child aborts before exec ("epoll_wait error: Bad file descriptor", status -6; grpc/grpc
#43055). Seen here as model servers, Envoy and the dashboard dying at start when their launcher held gRPC
channels."""


def apply_grpc_defaults(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``GRPC_EXPERIMENTS`` to `GRPC_EXPERIMENTS_DEFAULT` in `environ` (default: this process's) unless it is
    set; True when it set it. ``GRPC_ENABLE_FORK_SUPPORT`` likewise to `GRPC_FORK_SUPPORT_DEFAULT`. For this process's own environment, only while `grpc` is not yet imported (else
    False and nothing set: the variable would claim a setting the process does not run with); the children it
    starts afterwards inherit it."""
    env = os.environ if environ is None else environ
    if environ is None and "grpc" in sys.modules:
        return False
    env.setdefault(GRPC_FORK_SUPPORT_ENV, GRPC_FORK_SUPPORT_DEFAULT)
    if GRPC_EXPERIMENTS_ENV in env:
        return False
    env[GRPC_EXPERIMENTS_ENV] = GRPC_EXPERIMENTS_DEFAULT
    return True


def grpc_child_env() -> dict[str, str]:
    """The gRPC variables for a child gRPC server this process starts (`GatewayProcesses`' ext_proc replicas):
    this process's ``GRPC_EXPERIMENTS`` when set, else `GRPC_EXPERIMENTS_DEFAULT`. So a launcher that imported
    grpc before `apply_grpc_defaults` could run (a test, an embedding program) starts its children as the
    console script does."""
    return {GRPC_EXPERIMENTS_ENV: os.environ.get(GRPC_EXPERIMENTS_ENV, GRPC_EXPERIMENTS_DEFAULT),
            GRPC_FORK_SUPPORT_ENV: os.environ.get(GRPC_FORK_SUPPORT_ENV, GRPC_FORK_SUPPORT_DEFAULT)}
