"""Issue 27's findings, each replayed against real processes (Envoy, the ext_proc service and its parse worker,
simulated servers, nats-server, the telemetry receiver). Every test here failed on the main branch before the
fixes (the first assertion of each names what it was: the admin port open with the token in /config_dump, RSS
+280 MB, the router's p50 x40 under the slow body, NATS without auth, requests sent to the impostor, ...).

Figures the tests print (pytest -s): latencies and affinity by phase, RSS growth, counts of forged messages."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import orjson
import pytest

from helpers.fleet import start_fleet
from helpers.hardening import MODEL, SteadyClient, gateway, listening_ports, post, tree_rss_bytes
from helpers.procs import unix_http_get
from helpers.waiting import until
from prefixroute import identity
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import (GATEWAY_DIR_PREFIX, HEALTH_PATH, OWNER_FILE, GatewayProcesses,
                                         GatewaySettings)
from prefixroute.extproc.peers import codec
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port, http_get, prefixroute_argv, tcp_open
from prefixroute.supervisor import RestartPolicy, Supervisor

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def chat(content: str, **extra) -> dict:  # noqa: ANN003
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}], **extra}


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- HIGH 1: the admin port ------------------------------------------------------------------------------------
def test_admin_is_closed_and_no_secret_shows_and_a_drained_envoy_is_restarted(tmp_path: Path) -> None:
    with ExitStack() as stack:
        fleet = start_fleet(stack, 1, tmp_path)
        gw = gateway(stack, fleet.endpoints, tmp_path)
        # Off by default: Envoy listens on the gateway port alone (main: an admin port on 127.0.0.1, open to
        # every local user, whose /config_dump printed the ext_proc token).
        assert listening_ports(gw.envoy.pid) == {gw.gateway.port}
        folder = gw.config_path.parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        for name in ("envoy.yaml", "extproc.token", "owner"):
            assert stat.S_IMODE((folder / name).stat().st_mode) & 0o077 == 0, name
        assert gw.auth_token not in gw.config_path.read_text()  # Envoy reads the token file itself
        for log in ("envoy.log", "extproc.log"):
            assert stat.S_IMODE((tmp_path / log).stat().st_mode) == 0o600, log
        status, _, _ = post(gw.gateway.port, "/v1/chat/completions", chat("admin off"))
        assert status == 200

    with ExitStack() as stack:  # loopback: read-only paths only
        fleet = start_fleet(stack, 1, tmp_path / "l")
        gw = gateway(stack, fleet.endpoints, tmp_path / "l", envoy_admin="loopback")
        admin = f"http://127.0.0.1:{gw.admin_port}"
        assert http_get(f"{admin}/stats?filter=server.live")[0] == 200
        assert http_get(f"{admin}/config_dump")[0] == 403
        for path in ("/logging?level=debug", "/drain_listeners", "/quitquitquit", "/healthcheck/fail"):
            req = urllib.request.Request(admin + path, method="POST")
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=5)  # noqa: S310 - loopback
            assert info.value.code == 403, path
        assert post(gw.gateway.port, "/v1/chat/completions", chat("still serving"))[0] == 200

    with ExitStack() as stack:  # unix: everything, to the owner only; still no secret anywhere
        fleet = start_fleet(stack, 1, tmp_path / "u")
        gw = gateway(stack, fleet.endpoints, tmp_path / "u", envoy_admin="unix")
        sock = gw.admin_socket
        assert stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0
        status, dump = unix_http_get(sock, "/config_dump?include_eds")
        assert status == 200 and b"prefixroute_extproc_token" in dump and gw.auth_token.encode() not in dump
        assert unix_http_get(sock, "/logging?level=trace", method="POST")[0] == 200
        for i in range(3):
            assert post(gw.gateway.port, "/v1/chat/completions", chat(f"traced {i}"),
                        {"authorization": "Bearer client-key"})[0] == 200
        def traced() -> str | None:
            log = (tmp_path / "u" / "envoy.log").read_text(errors="replace")
            return log if "router decoding headers" in log or "request headers complete" in log else None

        log = until(traced, 10, message="Envoy's trace lines in its log")  # trace logging is on
        assert gw.auth_token not in log  # the ext_proc token: at no log level

        # Drained listeners: Envoy runs but serves nothing (main: the supervisor saw a live process and did
        # nothing; 0 of 30 probes answered). The supervisor's probe goes through the listener.
        supervisor = Supervisor(gw.group, RestartPolicy(live_interval_s=0.3, live_failures=3), label="test")
        supervisor.poll()
        old = gw.envoy.pid
        assert unix_http_get(sock, "/drain_listeners", method="POST")[0] == 200
        t0 = time.monotonic()

        def back() -> bool:
            supervisor.poll()
            return gw.envoy.pid != old and http_get(f"{gw.url}{HEALTH_PATH}", timeout_s=0.5)[0] == 200

        until(back, 20.0, message="a drained Envoy restarted and serving")
        print(f"drained Envoy serving again after {time.monotonic() - t0:.1f} s")
        assert post(gw.gateway.port, "/v1/chat/completions", chat("back"))[0] == 200


# --- HIGH 2: memory a client can take --------------------------------------------------------------------------
def test_a_flood_of_huge_cache_keys_stays_within_the_memory_budget(tmp_path: Path) -> None:
    budget_mb, n, key_mib = 64, 40, 7
    with ExitStack() as stack:
        fleet = start_fleet(stack, 2, tmp_path)
        gw = gateway(stack, fleet.endpoints, tmp_path, routing=RoutingSettings(memory_budget_mb=budget_mb))
        pid = gw.extproc.pid

        def send(i: int) -> int:
            body = orjson.dumps(chat("hello", prompt_cache_key=f"{i}-" + "k" * (key_mib << 20)))
            for _ in range(5):  # a 503 (the parse queue busy on a loaded host) is retried, as clients do
                status = post(gw.gateway.port, "/v1/chat/completions", body,
                              {"x-session-id": f"{i}-" + "s" * 30_000})[0]
                if status != 503:
                    return status
                time.sleep(0.5)  # a client's retry pace
            return status

        assert send(-1) == 200  # warm: the parse worker, allocator arenas
        time.sleep(1)  # on purpose: the warm-up's memory settles before the baseline (no signal says when)
        rss0 = tree_rss_bytes(pid)
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda k=k: statuses.extend(send(i) for i in range(k, n, 4)))
                   for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2)  # on purpose: freed blocks go back to the system before the figure is taken
        grown = tree_rss_bytes(pid) - rss0
        print(f"{n} x {key_mib} MiB prompt_cache_key: router RSS +{grown / 2**20:.1f} MiB "
              f"(budget {budget_mb} MiB, sent {n * key_mib} MiB)")
        assert statuses.count(200) == n, statuses
        # main: +280 MiB (each key kept raw in the session table and the policy's tables)
        assert grown < budget_mb << 20, grown


# --- HIGH 3: one body must not hold the router -----------------------------------------------------------------
ATTACK_CODE = """
import http.client, orjson, sys, time
body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 200_000})
end = time.time() + float(sys.argv[2]); counts = {}; next_s = 0.0
MIN_INTERVAL_S = float(sys.argv[3])
while time.time() < end:
    time.sleep(max(0.0, next_s - time.time()))
    next_s = time.time() + MIN_INTERVAL_S
    c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse(); data = r.read(); c.close()
    key = f"{r.status} {'max_messages' in data.decode(errors='replace')}"
    counts[key] = counts.get(key, 0) + 1
print(counts)
"""


ATTACK_INTERVAL_S = 0.125
"""Each attacker sends at most 8 bodies a second: what the CPU-share bound below was set against. Unpaced, the
faster the router refuses a body the more bodies arrive (~11 a second each once refusals took ~30 ms), and the
steady client's share of the 2 shared cores falls with the attackers' own CPU (sending, Envoy buffering 6.4 MB),
not with anything the router holds. Main parsed each body on the loop for ~0.3 s: 16 a second hold it all the
time, so the bounds still tell the two apart."""


def test_slow_to_parse_bodies_beside_normal_traffic(tmp_path: Path) -> None:
    """The issue's 6.4 MB body of 200,000 one-character messages, from two clients (other processes), while a
    steady client sends chats with 8 shared prefixes. Main parsed it on the event loop (6.5 s each with the
    chat template; 0.3 s in text mode): normal requests waited behind it and failed open."""
    phase_s = 8.0
    with ExitStack() as stack:
        fleet = start_fleet(stack, 4, tmp_path)
        gw = gateway(stack, fleet.endpoints, tmp_path)
        client = SteadyClient(gw.gateway.port).start()
        try:
            time.sleep(2.0)  # the phases below last fixed times on purpose: the steady client measures each
            client.phase = "base"
            time.sleep(phase_s)
            client.phase = "attack"
            attackers = [subprocess.Popen([sys.executable, "-c", ATTACK_CODE, str(gw.gateway.port), str(phase_s),
                                           str(ATTACK_INTERVAL_S)],
                                          stdout=subprocess.PIPE, text=True) for _ in range(2)]
            outs = [p.communicate(timeout=120)[0] for p in attackers]
            client.phase = "after"
        finally:
            client.stop()
        print(client.summary("base"), client.summary("attack"), "attackers:", outs, sep="\n")
        counts: dict[str, int] = {}
        for out in outs:
            for k, v in eval(out).items():  # noqa: S307 - our own child's dict
                counts[k] = counts.get(k, 0) + v
        refused = counts.get("400 True", 0)
        assert refused >= 0.8 * sum(counts.values()), counts  # a 400 naming max_messages, not a fail-open
        base50, attack50 = client.p("base", 0.5), client.p("attack", 0.5)
        base99, attack99 = client.p("base", 0.99), client.p("attack", 0.99)
        served = len(client.latencies("attack")) / max(1, len(client.latencies("base")))
        # main (measured here, same run length): the loop parsed each body (~0.3 s): 127 normal requests
        # answered during the attack against 4,671 before (2.7%), p99 8.5 -> 479 ms; the bodies got 404 after
        # a full parse. The bounds leave room for the CPU the attack itself takes (2 cores, shared).
        assert served >= 0.25, served
        assert attack50 <= 2.0 * base50 + 0.010, (base50, attack50)
        assert attack99 <= 5.0 * base99 + 0.050, (base99, attack99)
        assert client.holders("attack") == client.holders("base")  # routing unchanged: each prefix stays put
        assert client.affinity("attack") >= client.affinity("base") - 0.02
        assert not [s for s in client.samples if s[0] == "attack" and s[4] != 200]


def test_a_body_parsed_past_envoys_answer_timeout_is_refused_not_failed_open(tmp_path: Path) -> None:
    """Envoy's answer timeout at 40 ms (default 500) stands in for a host loaded enough that a large body's trip
    to the worker and parse pass it (CI saw 10 of 30 floods of 6.4 MB do so at 500 ms). The router asks Envoy
    to wait for that answer (servicer.PARSE_EXTENSION_S), so the 1.6 MB flood still gets its 400. Before: Envoy
    failed it open after the timeout, and the body, unvetted, reached the server (its own 400 on context length,
    which names no budget). Measured here: without the extension 0 of 2 runs passed, with it 6 of 6 (4 beside a
    busy core). The body's own delivery must fit in the timeout: 3.2 MB did not at 40 ms."""
    flood = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 50_000})
    with ExitStack() as stack:
        fleet = start_fleet(stack, 1, tmp_path)
        gw = gateway(stack, fleet.endpoints, tmp_path, envoy_overrides={"extproc_message_timeout_ms": 40})
        assert post(gw.gateway.port, "/v1/chat/completions", chat("warm"))[0] == 200
        for _ in range(3):
            status, _, data = post(gw.gateway.port, "/v1/chat/completions", flood)
            assert (status, b"max_messages" in data) == (400, True), data[:300]
        assert post(gw.gateway.port, "/v1/chat/completions", chat("after"))[0] == 200


# --- MED 1: the messaging bus ---------------------------------------------------------------------------------
def test_the_bus_needs_the_credential_and_forged_messages_change_nothing(tmp_path: Path) -> None:
    import nats

    with ExitStack() as stack:
        fleet = start_fleet(stack, 4, tmp_path)
        gw = gateway(stack, fleet.endpoints, tmp_path, replicas=2)
        port = int(gw.peers_url.rsplit(":", 1)[1])
        cmdline = Path(f"/proc/{gw.nats.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        conf = gw.config_path.parent / "nats.conf"
        token = conf.read_text().split('token: "', 1)[1].split('"', 1)[0]
        assert token not in cmdline and stat.S_IMODE(conf.stat().st_mode) == 0o600

        async def forge() -> None:
            # Without the token: refused (main: no authentication, anyone read and published).
            with pytest.raises(Exception) as info:
                await nats.connect(gw.peers_url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)
            assert "uthoriz" in str(info.value) or "auth" in str(info.value).lower(), info.value
            # With the token but not the bus key (what an impostor server learns): its messages change nothing.
            nc = await nats.connect(gw.peers_url, token=token, allow_reconnect=False, connect_timeout=2)
            hashes = [0] * 8  # any prefix
            for ep in fleet.endpoints:  # 5,000 picks against every endpoint, unsigned and signed with a wrong key
                for i in range(0, 5000, 500):
                    msgs = [codec.Pick(i + j, ep, hashes, 1e6) for j in range(500)]
                    data = codec.encode(codec.Batch("forger", 1, msgs, i + 1))
                    await nc.publish("prefixroute.routing.forger", data)
                    await nc.publish("prefixroute.routing.forger", codec.seal(b"x" * 32, "prefixroute.routing.forger",
                                                                                data))
            await nc.flush()
            await nc.close()

        # A warm prefix first.
        body = json.dumps(chat("Shared system prompt. " * 200)).encode()
        served = {post(gw.gateway.port, "/v1/chat/completions", body)[1].get("x-gateway-destination-endpoint-served")
                  for _ in range(10)}
        asyncio.run(forge())

        def num_invalid() -> float:
            return sum(metric(http_get(f"http://127.0.0.1:{p}/metrics")[1].decode(), "prefixroute_peer_messages_total",
                              direction="received", kind="invalid") for p in gw.metrics_ports)

        # every forged batch (2 kinds x 4 endpoints x 10 batches) reached both replicas and was dropped
        until(lambda: num_invalid() >= 2 * len(fleet.endpoints) * 10 * 2 - 1, 10, message=lambda: num_invalid())
        after = [post(gw.gateway.port, "/v1/chat/completions", body)[1].get("x-gateway-destination-endpoint-served")
                 for _ in range(40)]
        invalid = num_invalid()
        print(f"warm prefix on {served}; after 40,000 forged picks: {set(after)}; invalid batches counted {invalid}")
        assert len(served) == 1 and set(after) == served  # main: 40 of 40 elsewhere
        assert invalid >= 2 * len(fleet.endpoints) * 10 * 2 - 1  # every forged batch dropped, on both replicas
        dropped = sum(metric(http_get(f"http://127.0.0.1:{p}/metrics")[1].decode(), "prefixroute_peer_messages_total",
                             direction="dropped") for p in gw.metrics_ports)
        assert dropped == 0


# --- MED 2: a crashed child's port -----------------------------------------------------------------------------
class Impostor:
    """An HTTP server that answers everything 200 like a healthy model server, counting requests by path."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.paths: list[str] = []
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode(errors="replace").split("\r\n")
                path = lines[0].split(" ")[1]
                length = next((int(h.split(":", 1)[1]) for h in lines[1:] if h.lower().startswith("content-length")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                self.paths.append(path)
                body = b'{"object":"list","data":[]}' if path.startswith("/v1/models") else b"{}"
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                             % (len(body), body))
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_a_crashed_servers_port_cannot_be_taken_under_up(tmp_path: Path) -> None:
    """`prefixroute up` holds each model server's listening socket: when the server dies its port is never free
    (main: another user bound it 0.48 s later and was sent 16 of 48 of that server's requests, prompts included;
    the real server then crash-looped on "address already in use")."""
    from helpers.stack import LocalStack

    with LocalStack(tmp_path, num_servers=2, time_scale=0.02) as up:
        port = up.server_ports[0]
        old = up.pid("server-0")
        os.kill(old, signal.SIGKILL)
        t0 = time.monotonic()
        taken = []
        while time.monotonic() - t0 < 2.0:  # try to take the port as fast as a local user could
            imp = _try_impostor(port)
            if imp is not None:
                taken.append(imp)
                imp.close()
                break
            time.sleep(0.005)  # an attack loop over 2 s, not a wait for a condition
        assert not taken, "another process took the crashed server's port"
        statuses = [post(up.gateway_port, "/v1/chat/completions", chat(f"after the crash {i} " * 20))[0]
                    for i in range(30)]
        assert statuses.count(200) == 30, statuses  # reset while down, so Envoy used the other endpoint
        until(lambda: up.pid("server-0") not in (None, old), 15.0, message=up.logs)
        assert post(up.gateway_port, "/v1/chat/completions", chat("restarted"))[0] == 200


def test_an_impostor_on_an_endpoints_port_fails_its_identity_check(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Where the launcher does not hold the ports (servers started by others), the per-run identity key: the
    first health probe after another process took the port finds no proof, and from then on it gets nothing."""
    key = identity.new_key()
    monkeypatch.setenv(identity.KEY_ENV, key)  # the servers and the router (as `prefixroute up` does)
    with ExitStack() as stack:
        fleet = start_fleet(stack, 3, tmp_path)
        gw = gateway(stack, fleet.endpoints, tmp_path)
        victim = fleet.endpoints[0]
        port = int(victim.rsplit(":", 1)[1])
        os.kill(fleet.servers[victim].pid, signal.SIGKILL)
        fleet.servers[victim].popen.wait(5)
        impostor = until(lambda: _try_impostor(port), 5.0, interval_s=0.01, message="binding the crashed server's port")
        log = tmp_path / "extproc.log"
        try:
            statuses = []
            # The first probe after the port was taken finds it out (probe_interval_s: 1 s). A time bound, not a
            # count: at ~2-4 ms a request, a few hundred go by in one interval (500 once did on a loaded host).
            deadline = time.monotonic() + 10.0
            while "failed its identity check" not in log.read_text():
                statuses.append(post(gw.gateway.port, "/v1/chat/completions", chat(f"p {len(statuses)} " * 50))[0])
                assert time.monotonic() < deadline, f"no identity failure logged after {len(statuses)} requests"
            before = len([p for p in impostor.paths if p.startswith("/v1/chat")])
            statuses += [post(gw.gateway.port, "/v1/chat/completions", chat(f"again {i} " * 50))[0]
                         for i in range(60)]
            after = len([p for p in impostor.paths if p.startswith("/v1/chat")]) - before
            print(f"impostor: {before} client requests before the first probe found it out, {after} after")
            assert after == 0  # main: its probes passed, it kept getting a third of the traffic
            assert statuses.count(200) == len(statuses)
        finally:
            impostor.close()


def _try_impostor(port: int) -> Impostor | None:
    try:
        return Impostor(port)
    except OSError:
        return None


def test_an_impostor_nats_server_gets_no_message(tmp_path: Path) -> None:
    from prefixroute.extproc.peers.server import nats_server_argv

    with ExitStack() as stack:
        fleet = start_fleet(stack, 2, tmp_path)
        gw = gateway(stack, fleet.endpoints, tmp_path, replicas=2)
        port = int(gw.peers_url.rsplit(":", 1)[1])
        gw.nats.kill()
        impostor = subprocess.Popen(nats_server_argv(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(lambda: (impostor.kill(), impostor.wait(5)))
        until(lambda: tcp_open(port), 5.0, message="the impostor nats-server listening")
        received: list[bytes] = []

        async def listen() -> None:
            import nats

            nc = await nats.connect(f"nats://127.0.0.1:{port}")

            async def got(m) -> None:  # noqa: ANN001
                received.append(m.data)

            await nc.subscribe(">", cb=got)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6.0:
                await asyncio.to_thread(post, gw.gateway.port, "/v1/chat/completions", chat("talk " * 100))
            await nc.close()

        asyncio.run(listen())
        print(f"impostor nats-server received {len(received)} messages")
        assert not received  # main: the replicas reconnected to it and published every pick
        assert "does not require authentication" in "".join(
            (tmp_path / f"extproc-{k}.log").read_text() for k in range(2))


# --- LOW -------------------------------------------------------------------------------------------------------
def test_low_findings_validation_413_and_stale_gateway_folders(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    # A SIGKILLed launcher's gateway folder (token inside) is removed by the next start (main: left behind).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    stale = tmp_path / "tmp" / f"{GATEWAY_DIR_PREFIX}dead"
    stale.mkdir(mode=0o700)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (stale / OWNER_FILE).write_text(f"{dead.pid} 1\n")
    (stale / "extproc.token").write_text("old-token")
    with ExitStack() as stack:
        fleet = start_fleet(stack, 1, tmp_path)
        gw = gateway(stack, fleet.endpoints, tmp_path)
        assert not stale.exists()
        port = gw.gateway.port
        # Validation as vLLM 0.33 (main: 200 for each).
        for extra in ({"logit_bias": 5}, {"tool_choice": 5}, {"response_format": 5},
                      {"tools": [{"type": "function"}]}):
            status, headers, body = post(port, "/v1/chat/completions", chat("x", **extra))
            assert status == 400 and json.loads(body)["error"]["param"], (extra, body)
        status, _, body = post(port, "/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": None}]})
        assert status == 400 and json.loads(body)["error"]["param"] == "messages[0].content"
        # A 33 KB Responses body with a long id: vLLM's 404 naming it (main: Envoy's 413 "8 MiB exceeded").
        status, _, body = post(port, "/v1/responses", {"model": MODEL, "input": "hi",
                                                        "previous_response_id": "resp_" + "x" * 33_000})
        assert status == 404 and "not found" in json.loads(body)["error"]["message"], body[:200]
        status, _, body = post(port, "/v1/responses", {"model": MODEL, "input": "y" * 40_000, "max_output_tokens": 1})
        assert status == 200, body[:200]  # main: 413 for any Responses body over 32 KiB


def test_low_findings_telemetry_store_api_and_records_when_the_router_dies(tmp_path: Path) -> None:
    token = "t" * 32
    tport, hport = free_port(), free_port()
    db = tmp_path / "store" / "t.db"
    env = {**os.environ, "PREFIXROUTE_TELEMETRY_AUTH_TOKEN": token}
    with ExitStack() as stack:
        recv = subprocess.Popen(prefixroute_argv("telemetry", "--port", str(tport), "--http-port", str(hport),
                                                 "--db", str(db), "--envoy-record-hold-s", "2"), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(lambda: (recv.terminate(), recv.wait(10)))
        until(lambda: http_get(f"http://127.0.0.1:{hport}/healthz")[0] == 200, 20.0, message="the receiver up")
        assert stat.S_IMODE(db.stat().st_mode) == 0o600  # main: 0644, anyone read what the API guards
        # JSON errors for every method (main: http.server's HTML 501 for POST).
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            req = urllib.request.Request(f"http://127.0.0.1:{hport}/api/requests", data=b"{}", method=method)
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=5)  # noqa: S310
            assert info.value.code == 405 and json.loads(info.value.read())["error"]["code"] == 405
        # Requests while the router is down (fail open): Envoy's own records (main: none).
        fleet = start_fleet(stack, 2, tmp_path)
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{tport}"  # the router's own records
        os.environ["OTEL_EXPORTER_OTLP_HEADERS"] = f"authorization=Bearer%20{token}"
        try:
            gw = GatewayProcesses(GatewaySettings(port=free_port(), ports="random", extproc_replicas=1),
                                  RoutingSettings(),
                                  PoolSettings(endpoints=tuple(fleet.endpoints)), log_dir=tmp_path,
                                  records_to=(f"127.0.0.1:{tport}", token))
            stack.enter_context(gw)
        finally:
            del os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"], os.environ["OTEL_EXPORTER_OTLP_HEADERS"]
        ids = [f"before-{i}" for i in range(5)]
        for rid in ids:
            assert post(gw.gateway.port, "/v1/chat/completions", chat(rid), {"x-request-id": rid})[0] == 200
        os.kill(gw.extproc.pid, signal.SIGKILL)
        gw.extproc.popen.wait(5)
        down = [f"down-{i}" for i in range(10)]
        for rid in down:
            assert post(gw.gateway.port, "/v1/chat/completions", chat(rid), {"x-request-id": rid})[0] == 200

        def stored() -> list[str]:
            req = urllib.request.Request(f"http://127.0.0.1:{hport}/api/requests?since_s=600",
                                         headers={"authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310
                return [row.get("request_id") for row in json.load(r)]

        until(lambda: set(down) | set(ids) <= set(stored()), 15.0, interval_s=0.5, message="every record stored")
        time.sleep(2.5)  # on purpose, past the receiver's hold: Envoy's duplicates of the router's records
        # would be in now
        got = stored()
        print(f"records of requests served while the router was down: {len(set(down) & set(got))}/10")
        assert set(down) <= set(got)
        assert sorted(r for r in got if r in ids or r in down) == sorted(ids + down)  # each exactly once


def test_a_stream_nobody_reads_is_cut_as_the_docs_say(tmp_path: Path) -> None:
    """docs/security.md (Bounds) and docs/failure-modes.md: a stream its client does not read is cut by the server
    once it cannot write (256 KiB held, or paused `--stall-timeout-s`), which starts only once the kernel's socket
    buffers on the way through Envoy are full: a few MB (issue 27 measured ~1.78 MB pending after 60 s at a human
    pace and nothing cut, against a README that promised 256 KiB or 30 s). A fast stream fills them in seconds."""
    from prefixroute.procs import ProcessGroup

    port = free_port()
    with ExitStack() as stack:
        group = stack.enter_context(ProcessGroup(tmp_path))
        group.start("s0", prefixroute_argv("model-server", "--port", str(port), "--time-scale", "0.01",
                                           "--stall-timeout-s", "3"),
                    ready=lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200)
        gw = gateway(stack, [f"127.0.0.1:{port}"], tmp_path)
        sock = socket.create_connection(("127.0.0.1", gw.gateway.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"model": MODEL, "prompt": "tell me a very long story " * 40, "max_tokens": 120_000,
                           "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(body), body))
        t0 = time.monotonic()

        def aborts() -> float:
            text = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
            return metric(text, "prefixroute:slow_client_aborts_total")

        until(lambda: aborts() >= 1, 60.0, interval_s=0.5, message="the unread stream cut")
        print(f"unread stream cut by the server after {time.monotonic() - t0:.1f} s")
        sock.close()
