"""Shared helpers for integration tests: free ports, child processes (over `prefixroute.procs`).

Every process started here runs in its own process group and is stopped (group-wide) when its
context manager exits, even when the test fails, so no test leaves a server behind.
"""

from helpers.procs import (
    ManagedProcess,
    free_port,
    free_ports,
    http_get,
    prefixroute_cmd,
    start_process,
)

__all__ = [
    "ManagedProcess",
    "free_port",
    "free_ports",
    "http_get",
    "prefixroute_cmd",
    "start_process",
]
