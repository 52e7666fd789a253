"""The simulated fleet of a real bench run: fresh model servers per run, optionally publishing KV events.

`start_fleet` starts ``--servers`` model servers (``prefixroute model-server --port P --id 127.0.0.1:P``) in a
`ProcessGroup` and waits for each one's /health, so every run begins with empty KV caches and the same
configuration; `served_model` asks the fleet its model id and `scrape_server_counters` reads each server's
/metrics (requests served, prefix-cache hits) as a cross-check after a run.

KV events: when the simulated servers can publish them (`fleet_publishes_events`: ``prefixroute model-server
--help`` lists ``--kv-events-config``), every run's servers publish, each on its own pair of consecutive free
ports (PUB, replay = PUB + 1, the gateway's default kv_events_replay_port_offset, `KVEventsPlan`), so every
router meets the same fleet. Servers that cannot publish: the runs go on without events
(`resolve_kv_events`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
from collections.abc import Sequence

from prefixroute import procs as procs_mod
from prefixroute.model_servers.kv_events_publisher import config_json
from prefixroute.procs import LOOPBACK as HOST
from prefixroute.procs import (ManagedProcess, ProcessGroup, StartupError, free_port, free_ports, http_get,
                               port_in_use, prefixroute_argv)


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """The simulated fleet of a bench run. `ports` (optional) pins the servers' ports so every run of a bench
    has the same endpoint ids (comparable endpoint shares); empty = fresh free ports per start. `kv_events`:
    the servers publish KV events (True), do not (False), or None = when they can (`fleet_publishes_events`)
    and --server-args sets no --kv-events-config of its own; `run_bench` resolves None."""

    num_servers: int
    profile: str = ""
    server_args: tuple[str, ...] = ()
    startup_timeout_s: float = 60.0
    ports: tuple[int, ...] = ()
    kv_events: bool | None = None


def distinct_free_ports(n: int) -> tuple[int, ...]:
    return tuple(free_ports(n))


# --------------------------------------------------------------------------------------------- KV events

KV_EVENTS_TOPIC = ""
"""Topic the bench's servers publish under: vLLM's default, the empty topic. vllm-router 0.1.17's ``kv_aware``
takes its static ``--kv-event-source`` publishers on the empty topic only (its CLI has no topic flag, and its
subscriber drops every message whose topic frame is not exactly that), so any other topic leaves it without events
and routing as if blind; our gateway subscribes to every topic, so it reads either."""


@functools.cache
def fleet_publishes_events() -> bool:
    """Whether ``prefixroute model-server`` takes ``--kv-events-config`` (asked once per process: its --help).
    The one switch between a bench without events (servers that cannot publish) and one with them."""
    try:
        out = subprocess.run(prefixroute_argv("model-server", "--help"), capture_output=True, text=True,
                             timeout=60.0, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "--kv-events-config" in out.stdout


def kv_events_config(pub_port: int, replay_port: int, topic: str = KV_EVENTS_TOPIC) -> str:
    """The ``--kv-events-config`` JSON of one server, vLLM's KVEventsConfig shape, on loopback."""
    return config_json(pub_port, replay_port, topic=topic)


def free_port_pairs(n: int) -> list[tuple[int, int]]:
    """`n` pairs (p, p + 1) of free ports, all distinct: a publisher's PUB and replay sockets (the gateway finds
    the replay socket at PUB + kv_events_replay_port_offset, 1 by default)."""
    pairs: list[tuple[int, int]] = []
    taken: set[int] = set()
    for _ in range(200 * n):
        if len(pairs) == n:
            break
        p = free_port()
        if p + 1 > 65535 or p + 1 in taken or p + 1 in procs_mod._handed_out or port_in_use(p + 1):
            continue
        # Reserve p + 1 in the process-wide set free_ports draws against, so no later port collides with it.
        procs_mod._handed_out.add(p + 1)
        pairs.append((p, p + 1))
        taken.update((p, p + 1))
    if len(pairs) < n:
        raise StartupError(f"found only {len(pairs)} of {n} pairs of consecutive free ports for KV events")
    return pairs


@dataclasses.dataclass(frozen=True)
class KVEventsPlan:
    """Where each server of a fleet publishes: ``pub_ports[k]`` (replay on + 1) for the k-th server."""

    pub_ports: tuple[int, ...]

    @classmethod
    def allocate(cls, num_servers: int) -> KVEventsPlan:
        return cls(tuple(p for p, _ in free_port_pairs(num_servers)))

    def server_args(self, k: int) -> list[str]:
        """Flags that make the k-th server publish on its pair of ports."""
        return ["--kv-events-config", kv_events_config(self.pub_ports[k], self.pub_ports[k] + 1)]

    def gateway_endpoints(self, endpoints: Sequence[str]) -> list[str]:
        """``host:port@tcp://127.0.0.1:PUB`` per endpoint, in fleet order (the gateway's --endpoints form)."""
        if len(endpoints) != len(self.pub_ports):
            raise ValueError("one event address per endpoint")
        return [f"{ep}@tcp://{HOST}:{p}" for ep, p in zip(endpoints, self.pub_ports)]


def server_args_set_kv_events(server_args: Sequence[str]) -> bool:
    return any(a == "--kv-events-config" or a.startswith("--kv-events-config=") for a in server_args)


def resolve_kv_events(fleet: FleetConfig) -> FleetConfig:
    """`fleet` with `kv_events` decided: None -> publish when the servers can and --server-args does not
    configure events itself (one address for every server would collide; the bench cannot know them)."""
    if fleet.kv_events is not None:
        return fleet
    on = not server_args_set_kv_events(fleet.server_args) and fleet_publishes_events()
    return dataclasses.replace(fleet, kv_events=on)


def start_fleet(group: ProcessGroup, cfg: FleetConfig, events: KVEventsPlan | None = None) -> list[str]:
    """Start the model servers and wait for /health on each; returns their ``host:port`` ids. With `events`,
    each publishes KV events on its ports of the plan."""
    if cfg.ports and len(cfg.ports) != cfg.num_servers:
        raise ValueError("FleetConfig.ports must give one port per server")
    endpoints = []
    procs: list[ManagedProcess] = []
    for k in range(cfg.num_servers):
        port = cfg.ports[k] if cfg.ports else free_port()
        ep = f"{HOST}:{port}"
        argv = prefixroute_argv("model-server", "--host", HOST, "--port", str(port), "--id", ep)
        if cfg.profile:
            argv += ["--profile", cfg.profile]
        if events is not None:
            argv += events.server_args(k)
        argv += list(cfg.server_args)
        ports = (port, events.pub_ports[k], events.pub_ports[k] + 1) if events is not None else (port,)
        procs.append(group.start(f"server-{k}", argv, ports=ports, wait=False,
                                 ready=lambda ep=ep: http_get(f"http://{ep}/health")[0] == 200))
        endpoints.append(ep)
    group.wait_ready(procs, timeout_s=cfg.startup_timeout_s)  # started in parallel, waited for in turn
    return endpoints



def served_model(endpoint: str) -> str:
    """The model id the fleet serves (from GET /v1/models), so requests never 404."""
    status, body = http_get(f"http://{endpoint}/v1/models")
    if status != 200:
        raise StartupError(f"GET /v1/models on {endpoint} returned {status}")
    return json.loads(body)["data"][0]["id"]


_METRIC_RE = re.compile(r'^(vllm:request_success_total|vllm:prefix_cache_hits_total|vllm:prefix_cache_queries_total|'
                        r'vllm:external_prefix_cache_hits_total)'
                        r'(?:\{[^}]*\})?\s+([0-9.eE+-]+)$', re.M)


def scrape_server_counters(endpoints: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per endpoint: requests served, prefix-cache hit/query tokens and, with a CPU offload tier, the tokens loaded
    from it (``external_prefix_cache_hits``) from its /metrics (fresh servers, so the totals are this run's).
    Missing figures are absent."""
    out: dict[str, dict[str, float]] = {}
    for ep in endpoints:
        status, body = http_get(f"http://{ep}/metrics")
        vals: dict[str, float] = {}
        if status == 200:
            for m in _METRIC_RE.finditer(body.decode(errors="replace")):
                key = m.group(1).removeprefix("vllm:").removesuffix("_total")
                vals[key] = vals.get(key, 0.0) + float(m.group(2))
        out[ep] = vals
    return out
