"""`prefixroute overhead-bench`: what routing through the ext_proc service adds to every request.

In one run, against the same minimal upstream (fast_upstream.py: answers a small JSON at once):

- baseline: Envoy with no ext_proc filter, routing straight to the upstream;
- routed:   the real gateway (Envoy + `prefixroute extproc` with the real router and endpoint pool);
- gie (``--gie``): the Gateway API Inference Extension's reference Envoy configuration (extproc/gie_reference.yaml:
  request and response bodies FULL_DUPLEX_STREAMED, the picker over TLS) in front of `prefixroute extproc` in GIE
  mode, same router, same upstream: what the picker costs behind a GIE gateway, beside our own mode; with
  ``--gie-plaintext`` also "gie-plain", the same without the TLS to the picker (a departure from GIE's file, to
  tell the protocol's cost from TLS's).

For each prompt size it prints the latency p50/p99 on one keep-alive connection (baseline and routed runs
interleaved over several rounds, so machine noise hits both alike), the added latency, and the most
requests per second over many connections, with ratios. The machine is shared and noisy: compare ratios,
and rerun when the load average is high (it is printed).

Inter-token latency (``--mode itl`` or ``all``): streamed responses (the upstream sends a token event every
``itl_ms``) through two real gateways on the same upstream, telemetry on (the gateway's default facts path:
the Lua filter scans every body chunk, one record and one early report per request, spans exported) and
telemetry off (neither, no export), interleaved;
prints ITL p50/p99 per configuration and the on/off ratios. Telemetry must leave ITL unchanged within noise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import orjson

from prefixroute import settings
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.envoy_config import EnvoySettings, render
from prefixroute.extproc import gie_reference
from prefixroute.grpc_runtime import GRPC_EXPERIMENTS_ENV, grpc_child_env
from prefixroute.procs import (ManagedProcess, ProcessGroup, free_port, free_ports, http_get, parent_death_preexec,
                               prefixroute_argv, stop_group, tcp_open)
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings, envoy_binary
from prefixroute.bench.http_load import build_request, latency_ms, max_rate, stream_token_times
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.settings import Settings, setting

MODEL = "bench-model"  # what fast_upstream lists in /v1/models


@dataclasses.dataclass(frozen=True)
class OverheadBenchSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_OVERHEAD_BENCH_"
    TITLE: ClassVar[str] = "Overhead benchmark"

    prompt_kb: tuple[str, ...] = setting(("4", "64"), "Prompt sizes in KiB (4: a typical chat turn with a system "
                                         "prompt; 64: a long RAG/agent context).")
    num_requests: int = setting(1500, "Sequential requests per round and configuration for the latency figures "
                                "(1500 x rounds gives a stable p99).")
    num_rounds: int = setting(3, "Rounds alternating baseline and routed runs (spreads machine noise over both).")
    num_connections: int = setting(32, "Concurrent connections for the requests-per-second figure (enough to "
                                   "saturate 2 cores).")
    rate_duration_s: float = setting(3.0, "Seconds of load per requests-per-second measurement.")
    policy: str = setting("prefix", "Routing policy of the routed configuration.")
    replicas: tuple[str, ...] = setting(("1",), "ext_proc replica counts of the routed gateway, each its own "
                                        "gateway measured in the same rounds (e.g. 1,2: the routed req/s of two "
                                        "replicas against one, same run); replicas share picks through an "
                                        "embedded NATS.")
    routing_filter: str = setting("auto", "The routed gateways' routing filter (gateway --routing-filter): 'auto' "
                                  "(the gateway's default: ext_proc), "
                                  "'ext_proc' or 'ext_authz_http' (Envoy's ext_authz filter over HTTP); with "
                                  "--replicas 1,2 it says how each scales.")
    peers: bool = setting(True, "Replicas share their picks through the embedded NATS (the gateway default); "
                          "--no-peers measures them sharing nothing (the bus's own cost).")
    report_served: bool = setting(True, "Routed configuration sends response headers to ext_proc (the gateway "
                                  "default); --no-report-served measures without that message.")
    telemetry: bool = setting(True, "Routed configuration with per-request spans exported (the gateway default); "
                              "--no-telemetry measures it without them (the facts path stays: the router learns "
                              "from it either way).")
    gie: bool = setting(False, "Also measure GIE mode in the same rounds: GIE's reference Envoy configuration (bodies "
                        "FULL_DUPLEX_STREAMED, the picker over TLS) in front of a picker in GIE mode; its added latency "
                        "and req/s beside the routed configuration's.")
    gie_plaintext: bool = setting(False, "With --gie, also measure GIE mode with the picker reached without TLS (GIE's "
                                  "file reaches it over TLS; this departure, for measuring only, tells the "
                                  "protocol's cost from TLS's): a row 'gie-plain'.")
    variants: tuple[str, ...] = setting((), "Also measure these variants of the routed gateway in the same rounds "
                                        ": 'observe' (the observing ext_proc filter instead of the facts "
                                        "path: the gateway before 2026-12-05), 'records' (that, with Envoy's request "
                                        "records, no Lua filter), 'timing' (that, with records and the first-token "
                                        "Lua filter: `up` before the facts path), 'lua-facts' (no observing ext_proc filter: a Lua "
                                        "filter takes first body byte, usage and response id, once per request, to the router), 'facts' (the "
                                        "facts path as `up` runs it), 'no-observe' "
                                        "(the routing filter alone, no facts: the floor), 'routing-buffered' (the default again: "
                                        "an A/A control), 'routing-buffered-partial', 'routing-full-duplex', "
                                        "'routing-streamed-early', 'routing-skip-headers' (the "
                                        "routing filter's other processing modes: EnvoySettings.routing_processing), "
                                        "'routing-authz-http' and 'authz-http-facts' (routed by Envoy's ext_authz "
                                        "filter over HTTP: gateway --routing-filter ext_authz_http), 'routing-extproc' and "
                                        "'extproc-facts' (routed by the ext_proc filter). 'facts' and the routed "
                                        "configuration take the gateway's default routing filter (--routing-filter "
                                        "auto). Records go to a closed local port.")
    # --- ext_proc process variants (the hot path's settings, measured in the same rounds) ---
    extproc_variants: tuple[str, ...] = setting((), "Also measure routed gateways whose ext_proc process runs with "
                                                "other settings, in the same rounds: a name of EXTPROC_VARIANTS "
                                                "('asyncio': no uvloop; 'grpc-throughput': gRPC's throughput "
                                                "optimization target; 'grpc-window-64k': gRPC's default 64 KiB "
                                                "stream window; 'grpc-streams-100': 100 concurrent streams; "
                                                "'grpc-event-engine-listener': gRPC's own default listener, which "
                                                "prefixroute turns off: common/grpc_runtime.py), or "
                                                "'grpc:NAME=VALUE' for any gRPC server option (--grpc-options); "
                                                "'floor': the facts path's Envoy in front of a grpc.aio ext_proc "
                                                "that does no routing work (bench/floor_extproc.py), beside "
                                                "--variants facts: the router's own CPU is the difference.")
    stream_tokens: int = setting(0, "Latency mode with streamed responses of this many token events (the upstream "
                                 "sends one every --itl-ms): what per-chunk work costs; 0 = the small JSON answer.")
    mode: str = setting("all", "'latency' (added latency and req/s), 'itl' (inter-token latency with telemetry "
                        "on vs off) or 'all'.")
    itl_streams: int = setting(20, "Streamed requests per round and configuration in the ITL mode (x tokens x "
                               "rounds gives ~2000 gaps per configuration).")
    itl_tokens: int = setting(40, "Token events per streamed response in the ITL mode.")
    itl_ms: float = setting(5.0, "Upstream inter-token interval in ms (5: a fast decode step, so gateway "
                            "jitter stands out rather than hides in a long interval).")


def _body(num_bytes: int, stream_tokens: int = 0) -> bytes:
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    text = " ".join(words[i % len(words)] + str(i) for i in range(num_bytes // 7))[:num_bytes]
    stream = {"stream": True, "stream_options": {"include_usage": True}} if stream_tokens else {}
    return orjson.dumps({"model": MODEL, "max_tokens": stream_tokens or 16, **stream, "messages": [
        {"role": "system", "content": text}, {"role": "user", "content": "Summarise the above."}]})


# The observing path, by name: the routed configuration is the gateway's default (the facts path, since
# 2026-12-05), and these variants are what `up` and `gateway` ran before it.
_OBSERVE = {"observe_responses": True, "response_facts_lua": False}
VARIANTS = {
    "records": {"records": True, "first_token_lua": False, **_OBSERVE},
    "timing": {"records": True, **_OBSERVE},
    "observe": dict(_OBSERVE),
    "lua-facts": {"records": True, "response_facts_lua": True, "observe_responses": False, "report_served": False},
    "no-observe": {"observe_responses": False, "response_facts_lua": False, "report_served": False},
}
# The facts path as `prefixroute up` runs it (records on, facts Lua + facts logger to the ext_proc
# replica, no observing filter); compare with "timing" (records + the observing filter: `up` before it).
VARIANTS["facts"] = {"records": True, "response_facts_lua": True, "observe_responses": False}
# The routing filter's processing options on Envoy 1.40 (listener.routing_processing; measured and
# checked in bench-results/routing-modes/): each against "routed" ('buffered', the default) in the same rounds;
# "routing-buffered" is the default again under another name (an A/A control: the rounds' noise and order bias).
VARIANTS.update({f"routing-{mode}": {"routing_processing": mode} for mode in
                 ("buffered", "buffered-partial", "full-duplex", "streamed-early", "skip-headers")})
# ext_authz over HTTP (authz_http.py): a gateway setting, since the router then serves a port of its own.
VARIANTS["routing-authz-http"] = {"routing_filter": "ext_authz_http"}
VARIANTS["authz-http-facts"] = {**VARIANTS["facts"], "routing_filter": "ext_authz_http"}
# The ext_proc routing filter, the gateway's default (auto), named.
VARIANTS["routing-extproc"] = {"routing_filter": "ext_proc"}
VARIANTS["extproc-facts"] = {**VARIANTS["facts"], "routing_filter": "ext_proc"}
"""Routed gateway variants (--variants): Envoy settings over the routed configuration's; "records" sends Envoy's
request records (to a closed local port: Envoy builds and batches them, the export fails)."""


# --- ext_proc process variants (--extproc-variants) ---
GRPC_EE_LISTENER_VARIANT = "grpc-event-engine-listener"
EXTPROC_VARIANTS: dict[str, list[str]] = {
    "asyncio": ["--no-uvloop"],
    "grpc-throughput": ["--grpc-options", "grpc.optimization_target=throughput"],
    "grpc-window-64k": ["--grpc-options", "grpc.http2.lookahead_bytes=65536,grpc.http2.bdp_probe=1"],
    "grpc-streams-100": ["--grpc-options", "grpc.max_concurrent_streams=100"],
    GRPC_EE_LISTENER_VARIANT: [],
}
"""--extproc-variants names -> extra `prefixroute extproc` arguments of that routed gateway (one replica)."""
EXTPROC_VARIANT_ENV: dict[str, dict[str, str]] = {
    # gRPC's own defaults: its EventEngine listener, which prefixroute turns off (common/grpc_runtime.py).
    GRPC_EE_LISTENER_VARIANT: {GRPC_EXPERIMENTS_ENV: ""},
}
"""--extproc-variants names -> variables added to that ext_proc replica's environment."""


FLOOR_VARIANT = "floor"
"""--extproc-variants name of the Python ext_proc's floor: the facts path's Envoy (as `prefixroute up` runs it) in
front of bench/floor_extproc.py, a grpc.aio server that answers each routing stream with pre-built bytes and does
no routing work. Measured beside --variants facts, the difference is the router's own work per request."""


class _FloorGateway(GatewayProcesses):
    """A gateway whose ext_proc replica is bench/floor_extproc.py, routing every request to `endpoint`."""

    def __init__(self, endpoint: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._floor_endpoint = endpoint

    def _extproc_child(self, k: int) -> ManagedProcess:
        port = self.extproc_ports[k]
        # The same gRPC settings as the router's replicas (grpc_child_env), whoever launched the bench.
        return self._child("extproc-floor", [sys.executable, "-m", "prefixroute.bench.floor_extproc", str(port),
                                             self._floor_endpoint], ready=lambda: tcp_open(port), ports=(port,),
                           env={**grpc_child_env(), **self.extra_extproc_env})


def variant_overrides(name: str) -> dict[str, Any]:
    """The Envoy settings of --variants `name` (ValueError when unknown); records, when on, go to a closed local
    port (Envoy builds and batches them, the export fails)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")
    over: dict[str, Any] = {k: v for k, v in VARIANTS[name].items() if k not in ("records", "routing_filter")}
    if VARIANTS[name].get("records"):
        over["records_otlp_address"] = f"127.0.0.1:{free_port()}"
    return over


def _facts_overrides() -> dict[str, Any]:
    """The Envoy settings of the "facts" variant: the gateway as `prefixroute up` runs it."""
    return variant_overrides("facts")


def extproc_variant_args(name: str) -> list[str]:
    """The `prefixroute extproc` arguments of an --extproc-variants entry; ValueError for an unknown name."""
    if name.startswith("grpc:"):
        return ["--grpc-options", name.removeprefix("grpc:")]
    if name not in EXTPROC_VARIANTS:
        raise ValueError(f"unknown ext_proc variant {name!r}: choose from {', '.join(EXTPROC_VARIANTS)}, "
                         f"{FLOOR_VARIANT} or grpc:NAME=VALUE")
    return EXTPROC_VARIANTS[name]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _span_sink_args() -> list[str]:
    """Where the routed gateways export spans: the user's OTEL_EXPORTER_OTLP_ENDPOINT if set, else a closed
    local port (export fails fast and spans are dropped, the per-request work is unchanged), never a
    receiver someone else runs on the default port 4317."""
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return []
    return ["--otlp-endpoint", f"http://127.0.0.1:{free_port()}"]


def _itl(s: OverheadBenchSettings, endpoint: str, tmp: Path) -> None:
    """Inter-token latency through the gateway, telemetry on vs off (see module docstring)."""
    body = orjson.dumps({"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
                         "max_tokens": s.itl_tokens, "messages": [{"role": "user", "content": "Count."}]})
    req = build_request("/v1/chat/completions", body)
    gws = {on: GatewayProcesses(GatewaySettings(port=free_port(), ports="random", listen_address="127.0.0.1", telemetry=on,
                                                extproc_replicas=1),
                                RoutingSettings(policy=s.policy), PoolSettings(endpoints=(endpoint,)),
                                log_dir=tmp / ("itl-on" if on else "itl-off"), extra_extproc_args=_span_sink_args())
           for on in (True, False)}
    gaps: dict[bool, list[float]] = {True: [], False: []}
    ttft: dict[bool, list[float]] = {True: [], False: []}
    with gws[True], gws[False]:
        for on in (True, False):  # warm-up
            stream_token_times(gws[on].gateway.port, req)
        for _ in range(s.num_rounds):
            for _ in range(s.itl_streams):
                for on in (True, False):
                    t0 = time.perf_counter()
                    status, times = stream_token_times(gws[on].gateway.port, req)
                    if status != 200 or len(times) < s.itl_tokens:
                        raise RuntimeError(f"streamed request: status {status}, {len(times)} events")
                    ttft[on].append((times[0] - t0) * 1000.0)
                    # Content events only (the last two are usage and [DONE], sent together).
                    tok = times[:s.itl_tokens]
                    gaps[on] += [(b - a) * 1000.0 for a, b in zip(tok, tok[1:])]
    print(f"\ninter-token latency: upstream every {s.itl_ms:g} ms, {s.num_rounds} rounds x {s.itl_streams} "
          f"streams x {s.itl_tokens} tokens per configuration, load average {os.getloadavg()[0]:.2f}")
    print(f"{'telemetry':>9} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p50':>9}  (ms)")
    fig = {}
    for on in (True, False):
        fig[on] = (_pct(gaps[on], 0.5), _pct(gaps[on], 0.99), _pct(ttft[on], 0.5))
        print(f"{'on' if on else 'off':>9} {fig[on][0]:8.3f} {fig[on][1]:8.3f} {fig[on][2]:9.3f}")
    print(f"{'on/off':>9} {'x%.3f' % (fig[True][0] / fig[False][0]):>8} {'x%.3f' % (fig[True][1] / fig[False][1]):>8} "
          f"{'x%.3f' % (fig[True][2] / fig[False][2]):>9}")


def _start_gie(s: OverheadBenchSettings, endpoint: str, tmp: Path, stack: contextlib.ExitStack,
               plaintext: bool = False) -> tuple[int, int]:
    """GIE's reference Envoy + a picker in GIE mode (TLS, as that configuration reaches its picker; none with
    `plaintext`), on the same upstream: (gateway port, picker pid). Both stop with `stack`."""
    name = "gie-plain" if plaintext else "gie"
    tls: list[str] = []
    if not plaintext:
        cert, key = gie_reference.self_signed_certificate(tmp / "gie-tls")
        tls = ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    picker_port = free_port()
    group = stack.enter_context(ProcessGroup(tmp / name, ready_timeout_s=60.0))
    picker = group.start(f"{name}-picker", prefixroute_argv(
        "extproc", "--port", str(picker_port), "--listen-address", "127.0.0.1", "--metrics-port", "-1",
        "--endpoints", endpoint, "--policy", s.policy, "--protocol", "gie", *tls,
        *(_span_sink_args() if s.telemetry else ["--no-traces"])),
        ready=lambda: tcp_open(picker_port), ports=(picker_port,))
    ports = gie_reference.Ports(*free_ports(3))
    config = tmp / f"{name}-envoy.yaml"
    config.write_text(gie_reference.render(ports, f"127.0.0.1:{picker_port}", plaintext=plaintext))
    group.start(f"{name}-envoy", [envoy_binary(), "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
                                  "-l", "warning"],
                ready=lambda: http_get(f"http://127.0.0.1:{ports.admin}/ready", timeout_s=0.5)[0] == 200
                and tcp_open(ports.gateway), ports=(ports.gateway, ports.admin, ports.ready))
    # GIE's access log writes every request to Envoy's stdout: into the log file, as in a pod.
    return ports.gateway, picker.pid or 0


def _routed_name(n: int, counts: list[int]) -> str:
    """The routed configuration's name in the table: "routed" alone, "routed-xN" when replica counts compare."""
    return "routed" if counts == [1] else f"routed-x{n}"


def run(s: OverheadBenchSettings) -> int:
    if s.mode not in ("latency", "itl", "all"):
        raise ValueError(f"mode must be 'latency', 'itl' or 'all', got {s.mode!r}")
    tmp = Path(tempfile.mkdtemp(prefix="prefixroute-overhead-"))
    up_port = free_port()
    upstream = _detached([sys.executable, "-m", "prefixroute.bench.fast_upstream", str(up_port), str(s.itl_ms)])
    baseline: subprocess.Popen[bytes] | None = None
    endpoint = f"127.0.0.1:{up_port}"
    try:
        _wait_listening(up_port, upstream, "fast upstream did not start", timeout_s=10)
        if s.mode == "itl":
            _itl(s, endpoint, tmp)
            return 0
        base_port = free_port()
        base_cfg = tmp / "baseline.yaml"
        base_cfg.write_text(render(EnvoySettings(gateway_port=base_port, listen_address="127.0.0.1",
                                                 admin_port=free_port(), endpoints=(endpoint,),
                                                 extproc_enabled=False)))
        baseline = _detached([envoy_binary(), "-c", str(base_cfg), "--disable-hot-restart", "--concurrency", "1",
                              "-l", "warning"])
        counts = [int(n) for n in s.replicas]
        if not counts or any(not 1 <= n <= 16 for n in counts) or len(set(counts)) != len(counts):
            raise ValueError(f"replicas must be distinct counts 1-16, got {','.join(s.replicas)}")
        with contextlib.ExitStack() as started:
            envoy_pids = {"baseline": baseline.pid}
            configs, pids = _start_configurations(s, started, counts, endpoint, tmp, envoy_pids)
            _wait_listening(base_port, baseline, "baseline Envoy exited")
            configs = {"baseline": base_port, **configs}
            print(f"overhead-bench: Envoy 1 worker each, policy {s.policy}, report_served {s.report_served}, "
                  f"telemetry {s.telemetry}, routing filter {s.routing_filter}, "
                  f"replicas {','.join(map(str, counts))}{', gie' if 'gie' in pids else ''}, "
                  f"variants {','.join(s.variants) or 'none'}, "
                  f"ext_proc variants {','.join(s.extproc_variants) or 'none'}, "
                  f"{'streamed %d tokens every %g ms' % (s.stream_tokens, s.itl_ms) if s.stream_tokens else 'JSON'}"
                  f" responses, {s.num_rounds} rounds x {s.num_requests} requests, "
                  f"ext_proc GRPC_EXPERIMENTS {grpc_child_env()[GRPC_EXPERIMENTS_ENV]!r}, "
                  f"load average {os.getloadavg()[0]:.2f}")
            print(f"{'prompt':>7} {'config':>11} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
            for kb in s.prompt_kb:
                _measure_prompt_size(s, kb, configs, pids, _routed_name(counts[0], counts), envoy_pids)
            print(f"load average after: {os.getloadavg()[0]:.2f}")
        if s.mode == "all":
            _itl(s, endpoint, tmp)
    finally:
        stop_group(baseline)
        stop_group(upstream)
    return 0


def _detached(argv: list[str]) -> subprocess.Popen[bytes]:
    """A child in its own session (stopped with `stop_group`), output discarded, gone with this process."""
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=parent_death_preexec())


def _wait_listening(port: int, proc: subprocess.Popen[bytes], failure: str, timeout_s: float | None = None) -> None:
    """Until `port` accepts connections; RuntimeError(`failure`) when `proc` exits first or `timeout_s` passes."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not tcp_open(port):
        if (deadline is not None and time.monotonic() > deadline) or proc.poll() is not None:
            raise RuntimeError(failure)
        time.sleep(0.05)


def _start_configurations(s: OverheadBenchSettings, started: contextlib.ExitStack, counts: list[int],
                          endpoint: str, tmp: Path,
                          envoy_pids: dict[str, int]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Start the routed gateways (one per replica count, then one per --variants name) and, with --gie, GIE mode's;
    all stop with `started`. Returns (configuration -> gateway port, configuration -> its router processes' pids),
    routed first; fills `envoy_pids` (configuration -> its Envoy's pid) for our own gateways."""
    gws: dict[int | str, GatewayProcesses] = {n: GatewayProcesses(
        GatewaySettings(port=free_port(), ports="random", listen_address="127.0.0.1", telemetry=s.telemetry,
                        extproc_replicas=n, embedded_nats=s.peers, routing_filter=s.routing_filter),
        RoutingSettings(policy=s.policy), PoolSettings(endpoints=(endpoint,)),
        log_dir=tmp / f"replicas-{n}", envoy_overrides={"report_served": s.report_served},
        extra_extproc_args=_span_sink_args()) for n in counts}
    for name in s.variants:
        over = variant_overrides(name)
        gws[name] = GatewayProcesses(
            GatewaySettings(port=free_port(), ports="random", listen_address="127.0.0.1", telemetry=s.telemetry,
                            extproc_replicas=1, embedded_nats=s.peers,
                            routing_filter=VARIANTS[name].get("routing_filter", "auto")),
            RoutingSettings(policy=s.policy), PoolSettings(endpoints=(endpoint,)), log_dir=tmp / f"variant-{name}",
            envoy_overrides={"report_served": s.report_served, **over}, extra_extproc_args=_span_sink_args())
    for name in s.extproc_variants:  # --extproc-variants: the routed gateway, its ext_proc run otherwise
        if name == FLOOR_VARIANT:
            gws[name] = _FloorGateway(
                endpoint, GatewaySettings(port=free_port(), ports="random", listen_address="127.0.0.1",
                                          telemetry=s.telemetry, extproc_replicas=1, embedded_nats=False),
                RoutingSettings(policy=s.policy), PoolSettings(endpoints=(endpoint,)), log_dir=tmp / "floor",
                envoy_overrides={"report_served": s.report_served, **_facts_overrides()})
            continue
        gws[name] = GatewayProcesses(
            GatewaySettings(port=free_port(), ports="random", listen_address="127.0.0.1", telemetry=s.telemetry,
                            extproc_replicas=1, embedded_nats=s.peers),
            RoutingSettings(policy=s.policy), PoolSettings(endpoints=(endpoint,)),
            log_dir=tmp / f"extproc-variant-{len(gws)}", envoy_overrides={"report_served": s.report_served},
            extra_extproc_args=[*_span_sink_args(), *extproc_variant_args(name)],
            extra_extproc_env=EXTPROC_VARIANT_ENV.get(name))
    for gw in gws.values():
        started.enter_context(gw)

    def label(n: int | str) -> str:
        return n if isinstance(n, str) else _routed_name(n, counts)

    configs = {label(n): gw.gateway.port for n, gw in gws.items()}
    pids = {label(n): [p.pid for p in gw.extprocs if p.pid] for n, gw in gws.items()}
    envoy_pids.update({label(n): gw.envoy.pid for n, gw in gws.items() if gw.envoy is not None and gw.envoy.pid})
    if s.gie:
        configs["gie"], gie_pid = _start_gie(s, endpoint, tmp, started)
        pids["gie"] = [gie_pid]
    if s.gie and s.gie_plaintext:
        configs["gie-plain"], plain_pid = _start_gie(s, endpoint, tmp, started, plaintext=True)
        pids["gie-plain"] = [plain_pid]
    return configs, pids


PROJECTED_REPLICAS = (2, 4, 8)
"""Replica counts the --replicas projection is printed for (what 8 would give on a larger machine)."""


@dataclasses.dataclass(frozen=True)
class ReplicaProjection:
    """What N replicas would route on a machine with cores enough for all, from CPU per request measured here.

    Model (each routed request is picked by one replica and applied, from the pick bus, by each of the N - 1
    others): the replicas together spend ``route_us + (N - 1) * apply_us`` per request, Envoy ``envoy_us``.
    `rps_core_each` = N * 1e6 / replicas' CPU per request: what N replicas route with a core each (the replicas
    the limit, as on a 2-core host), and `envoy_cores` the cores Envoy then needs; `rps_per_core` = 1e6 /
    (replicas' + Envoy's CPU per request): routed requests per second per core the gateway is given, all
    processes counted; `cores_at_1k_rps`: the cores a gateway routing 1,000 req/s needs.
    Assumes each process's CPU per request stays as measured here (contention for this host's cores included)
    and Envoy's workers scale; fed with one machine's figures, not run on a larger one: a projection."""

    num_replicas: int
    replicas_us: float
    envoy_us: float

    @property
    def rps_core_each(self) -> float:
        return self.num_replicas * 1e6 / self.replicas_us

    @property
    def envoy_cores(self) -> float:
        return self.rps_core_each * self.envoy_us / 1e6

    @property
    def rps_per_core(self) -> float:
        return 1e6 / (self.replicas_us + self.envoy_us)

    @property
    def cores_at_1k_rps(self) -> float:
        return (self.replicas_us + self.envoy_us) / 1e3


def project_replicas(route_us: float, apply_us: float, envoy_us: float,
                     counts: tuple[int, ...] = PROJECTED_REPLICAS) -> list[ReplicaProjection]:
    """`ReplicaProjection` for each of `counts` (each >= 1): `route_us` is one replica's ext_proc CPU per
    request alone, `apply_us` (>= 0; a negative measurement, noise, is taken as 0) what each further replica
    adds per request, `envoy_us` Envoy's CPU per request."""
    apply_us = max(apply_us, 0.0)
    return [ReplicaProjection(n, route_us + (n - 1) * apply_us, envoy_us) for n in counts]


def _print_projection(kb: str, counts: list[int], cpu_us: dict[str, float], envoy_us: dict[str, float]) -> None:
    """With --replicas 1,N: each further replica's CPU per request, and `project_replicas` for 2, 4, 8. The one
    replica's own cost is the facts path's when --variants facts ran too (the gateway as `up` runs it), else the
    routed configuration's; what a further replica adds (applying the others' picks) is the routed one's."""
    if 1 not in counts or len(counts) < 2:
        return
    one = _routed_name(1, counts)
    n = max(c for c in counts if c != 1)
    many = _routed_name(n, counts)
    apply_us = (cpu_us[many] - cpu_us[one]) / (n - 1)
    base = "facts" if "facts" in cpu_us and "facts" in envoy_us else one
    print(f"{kb + ' KB':>7} {'replicas':>11} one replica ({base}) {cpu_us[base]:.0f} us/request of ext_proc CPU, "
          f"each further replica +{apply_us:.0f} (x{n} against x1), Envoy {envoy_us[base]:.0f}; projected, cores "
          f"enough for all:")
    alone = 1e6 / cpu_us[base]
    for p in project_replicas(cpu_us[base], apply_us, envoy_us[base]):
        print(f"{kb + ' KB':>7} {'x' + str(p.num_replicas):>11} replicas {p.replicas_us:.0f} + Envoy {p.envoy_us:.0f} "
              f"us/request: a core per replica {p.rps_core_each:.0f} req/s (x{p.rps_core_each / alone:.2f} one "
              f"replica's), Envoy then {p.envoy_cores:.1f} cores; {p.rps_per_core:.0f} req/s per core in all, "
              f"{p.cores_at_1k_rps:.1f} cores at 1,000 req/s")


def _measure_prompt_size(s: OverheadBenchSettings, kb: str, configs: dict[str, int], pids: dict[str, list[int]],
                         first: str, envoy_pids: dict[str, int]) -> None:
    """Latency (rounds alternating every configuration) and req/s of each configuration at a `kb` KiB prompt,
    printed with what routing adds to the baseline (and GIE mode beside `first`, the first routed one), and the
    CPU per request of each configuration's ext_proc processes and Envoy (in the latency rounds)."""
    req = build_request("/v1/chat/completions", _body(int(kb) * 1024, s.stream_tokens))
    n = s.num_rounds * s.num_requests  # requests per configuration over the latency rounds
    lat: dict[str, list[float]] = {name: [] for name in configs}
    cpu_s = {name: 0.0 for name in pids}
    envoy_cpu_s = {name: 0.0 for name in envoy_pids}
    for _ in range(s.num_rounds):
        for name, port in configs.items():
            c0 = sum(_cpu_s(p) for p in pids.get(name, ()))
            e0 = _cpu_s(envoy_pids[name]) if name in envoy_pids else 0.0
            lat[name] += latency_ms(port, req, s.num_requests, num_warmup=0)
            if name in pids:
                cpu_s[name] += sum(_cpu_s(p) for p in pids[name]) - c0
            if name in envoy_pids:
                envoy_cpu_s[name] += _cpu_s(envoy_pids[name]) - e0
    rates = {name: max_rate(port, req, s.num_connections, s.rate_duration_s) for name, port in configs.items()}
    fig = {name: (_pct(v, 0.5), _pct(v, 0.99), rates[name][0]) for name, v in lat.items()}
    for name in configs:
        p50, p99, rps = fig[name]
        errors = rates[name][1]
        print(f"{kb + ' KB':>7} {name:>11} {p50:8.3f} {p99:8.3f} {rps:8.0f}"
              + (f"  ({errors} non-200)" if errors else ""))
    b50, b99, brps = fig["baseline"]
    for name in pids:
        r50, r99, rrps = fig[name]
        vs_first = f", req/s x{rrps / fig[first][2]:.2f} vs {first}" if name != first else ""
        print(f"{kb + ' KB':>7} {'added':>11} {r50 - b50:8.3f} {r99 - b99:8.3f}   {name}: "
              f"ratio p50 x{r50 / b50:.1f}, p99 x{r99 / b99:.1f}, req/s x{rrps / brps:.2f}{vs_first}; "
              f"mean {statistics.fmean(lat[name]):.3f} ms; "
              f"ext_proc CPU {cpu_s[name] / n * 1e6:.0f} us/request"
              + (f", Envoy CPU {envoy_cpu_s[name] / n * 1e6:.0f} us/request"
                 f" (baseline {envoy_cpu_s['baseline'] / n * 1e6:.0f})"
                 if name in envoy_cpu_s else ""))
    for name in pids:
        if name != first and name in envoy_pids and first in envoy_pids:
            added50 = (fig[name][0] - b50) / max(fig[first][0] - b50, 1e-6)
            added99 = (fig[name][1] - b99) / max(fig[first][1] - b99, 1e-6)
            print(f"{kb + ' KB':>7} {name + '/' + first:>11} added p50 x{added50:.2f}, added p99 x{added99:.2f}, "
                  f"ext_proc CPU x{cpu_s[name] / max(cpu_s[first], 1e-9):.2f}, "
                  f"Envoy CPU x{envoy_cpu_s[name] / max(envoy_cpu_s[first], 1e-9):.2f} "
                  f"({(envoy_cpu_s[name] - envoy_cpu_s[first]) / n * 1e6:+.0f} us/request)")
    if FLOOR_VARIANT in pids and "facts" in pids:
        own = (cpu_s["facts"] - cpu_s[FLOOR_VARIANT]) / n * 1e6
        print(f"{kb + ' KB':>7} {'facts-floor':>11} the router's own work: added p50 "
              f"{fig['facts'][0] - fig[FLOOR_VARIANT][0]:+.3f} ms, added p99 {fig['facts'][1] - fig[FLOOR_VARIANT][1]:+.3f} "
              f"ms, ext_proc CPU {own:+.0f} us/request (the floor's {cpu_s[FLOOR_VARIANT] / n * 1e6:.0f})")
    _print_projection(kb, [int(c) for c in s.replicas], {k: v / n * 1e6 for k, v in cpu_s.items()},
                      {k: v / n * 1e6 for k, v in envoy_cpu_s.items()})
    for gname in ("gie", "gie-plain"):
        if gname in fig:
            f50, f99, frps = fig[first]
            g50, g99, grps = fig[gname]
            print(f"{kb + ' KB':>7} {gname + '/' + first:>11} added p50 "
                  f"x{(g50 - b50) / max(f50 - b50, 1e-6):.2f}, added p99 "
                  f"x{(g99 - b99) / max(f99 - b99, 1e-6):.2f}, req/s x{grps / frps:.2f}")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, OverheadBenchSettings)


def main(args: argparse.Namespace) -> int:
    try:
        return run(settings.from_namespace(OverheadBenchSettings, args))
    except ValueError as exc:
        print(f"prefixroute overhead-bench: {exc}", file=sys.stderr)
        return 2
