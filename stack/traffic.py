"""`prefixroute traffic`: a steady demo load through the gateway, until stopped.

Builds a workload with the benchmark's generators (`prefixroute.bench.workloads`), sends it with
Poisson arrivals at `--rate-rps` using the benchmark's streaming client, and starts over with the next
seed when it is done (so new prefixes keep arriving while old ones keep being reused). One status line
per round on stdout. Used by `prefixroute up --traffic WORKLOAD` and by the compose `traffic` service.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time
import urllib.request
from typing import ClassVar

from prefixroute import settings
from prefixroute.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class TrafficSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_TRAFFIC_"
    TITLE: ClassVar[str] = "Demo traffic (`prefixroute traffic`)"

    gateway: str = setting("http://127.0.0.1:8080", "Base URL of the gateway to send requests to.")
    workload: str = setting("shared-prompts", "Workload: shared-prompts, multi-turn, documents, mix, or agents "
                            "(tool-calling agents over the Responses API: follow-ups with previous_response_id).")
    rate_rps: float = setting(4.0, "Requests per second (Poisson arrivals).")
    requests_per_round: int = setting(400, "Requests per round; each round uses the next seed (agents: this many "
                                      "turns, in conversations of the bench's --num-turns).")
    output_tokens: int = setting(32, "Tokens generated per request (short answers keep the demo about TTFT).")
    model: str = setting("", "Model name to request (empty: the first model the gateway's /v1/models lists).")
    rounds: int = setting(0, "Stop after this many rounds (0 = run until stopped).")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, TrafficSettings)


def _first_model(base_url: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=2.0) as r:
                return str(json.loads(r.read())["data"][0]["id"])
        except (OSError, ValueError, KeyError, IndexError) as exc:
            last = exc
            time.sleep(0.5)
    raise RuntimeError(f"could not list models at {base_url}/v1/models: {last}")


async def _run(st: TrafficSettings) -> int:
    from prefixroute.bench import client, workloads
    from prefixroute.bench.settings import BenchSettings

    model = st.model or _first_model(st.gateway)
    d = BenchSettings()
    print(f"prefixroute traffic: {st.workload} at {st.rate_rps:g} req/s to {st.gateway} (model {model}), "
          f"{st.requests_per_round} requests per round", flush=True)
    round_no = 0
    while not st.rounds or round_no < st.rounds:
        wl = workloads.make_workload(
            st.workload, num_requests=st.requests_per_round, seed=round_no, output_tokens=st.output_tokens,
            prefix_tokens=d.prefix_tokens, num_groups=d.num_groups, question_tokens=d.question_tokens,
            num_sessions=d.num_sessions, num_turns=d.num_turns, document_tokens=d.document_tokens,
            num_documents=d.num_documents, num_agents=max(1, st.requests_per_round // d.num_turns))
        wl = workloads.apply_arrivals(wl, "poisson", rate_rps=st.rate_rps, seed=round_no)
        t0 = time.monotonic()
        results = await client.run_workload(st.gateway, wl.requests, model=model,
                                            api="responses" if st.workload == "agents" else "chat")
        ok = [r for r in results if r.ok]
        prompt = sum(r.prompt_tokens or 0 for r in ok)
        cached = sum(r.cached_tokens or 0 for r in ok)
        print(f"traffic round {round_no}: {len(ok)}/{len(results)} ok in {time.monotonic() - t0:.0f} s, "
              f"hit ratio {cached / prompt if prompt else 0:.2f}", flush=True)
        round_no += 1
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        st = settings.from_namespace(TrafficSettings, args)
    except ValueError as exc:
        print(f"prefixroute traffic: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return asyncio.run(_run(st))
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, ValueError) as exc:
        print(f"prefixroute traffic: {exc}", file=sys.stderr)
        return 1
