"""gRPC's start-up settings (common/grpc_runtime.py): who sets GRPC_EXPERIMENTS, and that the installed grpcio
knows the experiment prefixroute turns off (a grpcio that dropped it logs "Unknown experiment" and runs its
default: this fails then, so the setting is reviewed)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from prefixroute.grpc_runtime import (GRPC_EXPERIMENTS_DEFAULT, GRPC_EXPERIMENTS_ENV, GRPC_FORK_SUPPORT_ENV,
                                      apply_grpc_defaults, grpc_child_env)

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test


@pytest.mark.parametrize("before, after, changed", [
    (None, GRPC_EXPERIMENTS_DEFAULT, True),
    ("", "", False),                          # the user's "gRPC's own defaults" is kept
    ("-event_engine_client", "-event_engine_client", False),
])
def test_apply_grpc_defaults_sets_only_an_unset_variable(before, after, changed):
    env = {"OTHER": "1"} if before is None else {"OTHER": "1", GRPC_EXPERIMENTS_ENV: before}
    assert apply_grpc_defaults(env) is changed
    assert env == {"OTHER": "1", GRPC_EXPERIMENTS_ENV: after, GRPC_FORK_SUPPORT_ENV: "false"}


def test_a_fork_support_setting_of_the_users_is_kept():
    env = {GRPC_FORK_SUPPORT_ENV: "true"}
    apply_grpc_defaults(env)
    assert env[GRPC_FORK_SUPPORT_ENV] == "true"


@pytest.mark.parametrize("parent, child", [(None, GRPC_EXPERIMENTS_DEFAULT), ("", ""), ("x", "x")])
def test_child_env_passes_the_users_setting_or_the_default(monkeypatch, parent, child):
    if parent is None:
        monkeypatch.delenv(GRPC_EXPERIMENTS_ENV, raising=False)
    else:
        monkeypatch.setenv(GRPC_EXPERIMENTS_ENV, parent)
    monkeypatch.delenv(GRPC_FORK_SUPPORT_ENV, raising=False)
    assert grpc_child_env() == {GRPC_EXPERIMENTS_ENV: child, GRPC_FORK_SUPPORT_ENV: "false"}


def _python(code: str, env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != GRPC_EXPERIMENTS_ENV}
    if env_value is not None:
        env[GRPC_EXPERIMENTS_ENV] = env_value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_console_script_sets_it_before_grpc_is_imported():
    # cli.main with no command prints its help; the command modules (which import grpc) are not imported.
    code = """
        import os, sys
        from prefixroute import cli
        sys.stdout = open(os.devnull, "w")
        cli.main([])
        sys.stdout = sys.__stdout__
        print(repr(os.environ.get("GRPC_EXPERIMENTS")), "grpc" in sys.modules)
    """
    assert _python(code, None).stdout.split() == [repr(GRPC_EXPERIMENTS_DEFAULT), "False"]
    assert _python(code, "").stdout.split() == ["''", "False"]


def test_nothing_is_set_once_grpc_is_imported():
    # Too late to take effect in this process: the variable would claim a setting the process does not run with.
    out = _python("""
        import os, grpc
        from prefixroute.grpc_runtime import apply_grpc_defaults
        print(apply_grpc_defaults(), os.environ.get("GRPC_EXPERIMENTS"))
    """, None)
    assert out.stdout.split() == ["False", "None"]


SERVER = """
    import asyncio, grpc
    async def main():
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await server.stop(None)
    asyncio.run(main())
    print("served")
"""


def test_the_installed_grpcio_knows_the_experiment():
    out = _python(SERVER, GRPC_EXPERIMENTS_DEFAULT)
    assert out.stdout.strip() == "served", out.stderr
    assert "Unknown experiment" not in out.stderr, out.stderr
    # The check can fail: a name grpcio does not know is reported on the same stream.
    unknown = _python(SERVER, "-no_such_experiment_in_grpcio")
    assert "Unknown experiment" in unknown.stderr, unknown.stderr


FORK_UNDER_LOAD = """
    import concurrent.futures, subprocess, sys, threading, time
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stop = False

    def calls():
        while not stop:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    threads = [threading.Thread(target=calls) for _ in range(2)]
    for t in threads:
        t.start()
    aborted = 0
    for _ in range(150):
        p = subprocess.run(["true"], close_fds=True, capture_output=True, start_new_session=True, preexec_fn=lambda: None)
        aborted += p.returncode != 0
    stop = True
    for t in threads:
        t.join()
    print(aborted)
"""


def test_children_started_beside_live_grpc_calls_reach_exec():
    """A process with live gRPC calls starts 150 children (fork + exec, close_fds): with gRPC's fork handlers on,
    grpcio 1.80-1.85 can abort a child before its exec (grpc/grpc#43055: model servers, Envoy and the dashboard
    died at start so in this suite); with the default prefixroute sets, none does."""
    env = {k: v for k, v in os.environ.items() if k != GRPC_FORK_SUPPORT_ENV}
    env[GRPC_FORK_SUPPORT_ENV] = "false"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(FORK_UNDER_LOAD)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0", out.stdout
