"""Shared helpers for integration tests: free ports, readiness waits, child processes.

Every process started here runs in its own process group and is killed (group-wide) when its
context manager exits, even when the test fails, so no test leaves a server behind.
"""

from helpers.procs import (
    ManagedProcess,
    free_port,
    free_ports,
    http_get,
    prefixroute_cmd,
    start_process,
    wait_for_http,
    wait_for_port,
)

__all__ = [
    "ManagedProcess",
    "free_port",
    "free_ports",
    "http_get",
    "prefixroute_cmd",
    "start_process",
    "wait_for_http",
    "wait_for_port",
]
