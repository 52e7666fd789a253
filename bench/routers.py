"""The routers a benchmark compares, by name: `parse_router` turns ``prefixroute:POLICY[@SOURCE][#N][+flow|-flow][+extproc|+authz|+authz-http]``,
``sglang-router[:POLICY]``, ``vllm-router[:POLICY]`` (``kv_aware``: fed the servers' KV events) or
``smg[:POLICY]`` (each with an optional ``/chat`` or ``/responses`` suffix) into a `RouterSpec`.

Shared by the real bench (bench/runner.py starts the router a spec names) and the virtual one
(bench/virtual_run.py runs its policy on the virtual fleet); it imports neither, so they do not import each
other. `PRIOR_ENV` names the environment variables that set our gateway's time-model prior: when one is set,
both benches leave the prior to it (the operator's wins).
"""

from __future__ import annotations

import dataclasses

from prefixroute.extproc.routing.settings import INDEX_SOURCES, POLICIES

PEER_POLICIES = {"sglang-router": ("cache_aware", "round_robin", "random", "power_of_two"),
                 "vllm-router": ("cache_aware", "kv_aware", "round_robin", "random", "power_of_two",
                                 "consistent_hash"),
                 "smg": ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "prefix_hash")}
PEER_RELEASES = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17", "smg": "smg==1.13.0"}
"""The release of each peer router the bench runs (and the report names): sglang-router and vllm-router from
the ``[peers]`` extra; smg (the SGLang Model Gateway, which installs an ``smg`` script of its own that clashes
with sglang-router's) in a venv of its own (bench/runner.py `peer_script`)."""

PRIOR_ENV = ("PREFIXROUTE_TTFT_PRIOR_TOKENS_PER_S", "PREFIXROUTE_TTFT_PRIOR_BASE_S")


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """A router to benchmark: ``kind`` prefixroute / sglang-router / vllm-router / smg, its policy and, for our gateway,
    the prefix index's source (``--index-source``; "" = the gateway's default)."""

    name: str
    kind: str
    policy: str
    index_source: str = ""
    replicas: int = 1
    """Our gateway's ext_proc replicas (``#N`` in the name; 1 by default, whatever the machine's cores, so runs on
    different machines compare)."""
    flow: bool | None = None
    """Our gateway's flow control: ``+flow`` on, ``-flow`` off, None (no suffix) the gateway's
    default (on)."""
    routing_filter: str = ""
    """Our gateway's routing filter (``--routing-filter``): "ext_proc" (``+extproc``), "ext_authz" (``+authz``:
    Envoy's ext_authz filter, one unary gRPC Check per request), "ext_authz_http" (``+authz-http``: the same over
    HTTP), "" = the gateway's default (auto: ext_proc)."""
    api: str = ""
    """The API a workload with a Responses form (agents) is sent in: "responses" or "chat"; "" = the router's
    default (`default_api`)."""

    @property
    def workload_api(self) -> str:
        """"responses" or "chat": what the client sends requests that have both forms in."""
        return self.api or default_api(self.kind)


API_SUFFIXES = ("chat", "responses")


def default_api(kind: str) -> str:
    """Our gateway routes Responses requests (affinity to the endpoint holding the previous response); peers
    forward /v1/responses without knowing it (sglang-router 0.3.2, vllm-router 0.1.17, smg 1.13.0), so by default they get the
    chat equivalent of the same conversations, which they do route on."""
    return "responses" if kind == "prefixroute" else "chat"


def parse_router(name: str) -> RouterSpec:
    """``prefixroute:POLICY[@SOURCE][#REPLICAS][+flow|-flow][+extproc|+authz|+authz-http]`` (SOURCE one of INDEX_SOURCES; REPLICAS 1-16
    ext_proc replicas sharing their picks through an embedded NATS; +flow / -flow: flow control on / off, else the
    gateway's default; +extproc / +authz / +authz-http: routed by Envoy's ext_proc filter, or its ext_authz filter over gRPC / HTTP, instead of the gateway's default, auto), ``sglang-router[:POLICY]``,
    ``vllm-router[:POLICY]``, each with an optional ``/chat`` or ``/responses`` suffix (the API of the agents
    workload, `RouterSpec.api`; the suffix stays in the name); ValueError otherwise."""
    base, slash, api = name.strip().partition("/")
    if slash and api not in API_SUFFIXES:
        raise ValueError(f"router {name!r}: the suffix after / must be one of {', '.join(API_SUFFIXES)}")
    spec = _parse_router_base(base)
    return dataclasses.replace(spec, name=f"{spec.name}/{api}" if slash else spec.name, api=api)


def _parse_router_base(name: str) -> RouterSpec:
    kind, _, policy = name.strip().partition(":")
    if kind == "prefixroute":
        flow = None
        routing_filter = ""
        for suffix, filt in (("+authz-http", "ext_authz_http"), ("+authz", "ext_authz"), ("+extproc", "ext_proc")):
            if policy.endswith(suffix):
                policy, routing_filter = policy.removesuffix(suffix), filt
                break
        for suffix, on in (("+flow", True), ("-flow", False)):
            if policy.endswith(suffix):
                policy, flow = policy.removesuffix(suffix), on
        policy, hash_, replicas = policy.partition("#")
        if hash_ and not (replicas.isdigit() and 1 <= int(replicas) <= 16):
            raise ValueError(f"router {name!r}: replicas (after #) must be a count 1-16")
        policy, at, source = policy.partition("@")
        if policy not in POLICIES:
            raise ValueError(f"router {name!r}: policy must be one of {', '.join(POLICIES)}")
        if at and source not in INDEX_SOURCES:
            raise ValueError(f"router {name!r}: index source (after @) must be one of {', '.join(INDEX_SOURCES)}")
        return RouterSpec(name.strip(), kind, policy, source, replicas=int(replicas) if hash_ else 1, flow=flow,
                          routing_filter=routing_filter)
    if kind in PEER_POLICIES:
        policy = policy or "cache_aware"
        if policy not in PEER_POLICIES[kind]:
            raise ValueError(f"router {name!r}: policy must be one of {', '.join(PEER_POLICIES[kind])}")
        return RouterSpec(name if ":" in name else kind, kind, policy)
    raise ValueError(f"unknown router {name!r}; use prefixroute:POLICY[@SOURCE][+flow|-flow][+extproc|+authz|+authz-http], sglang-router[:POLICY], "
                     f"vllm-router[:POLICY] or smg[:POLICY]")
