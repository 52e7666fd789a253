"""Pure parsing for the pool: Prometheus text of vLLM/SGLang, /v1/models bodies, endpoint specs.

`parse_metrics` does not tokenise the whole exposition (a vLLM /metrics payload is tens of KB of histograms):
it searches the payload (bytes.find, C speed) for the few metric names it needs at a line start and parses
only those lines. Several samples of one gauge (data-parallel engines, several models) are summed for counts
and averaged for ratios; a sample with a non-empty ``priority`` label is a per-priority breakdown beside the
total (SGLang 0.5.23 with priority scheduling: the total under ``priority=""``) and is not added in.

The names, checked against the releases' own metrics code (tests/data/engines/, docs/engines.md "Engine releases
checked"): vLLM 0.33 ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(``vllm:gpu_cache_usage_perc`` before 0.10), ``vllm:cache_config_info`` (labels ``block_size``,
``num_gpu_blocks``), ``vllm:kv_offload_config_info`` (the native offloading's host tier, ``--kv-offloading-size``:
labels ``cpu_num_chunks`` and ``cpu_blocks_per_chunk``, vLLM 0.33 and 0.34's ``CPUOffloadingInfo``; the tier holds
their product in GPU blocks), ``vllm:prefix_cache_queries`` / ``_hits`` and
``vllm:external_prefix_cache_hits`` (counters: the hit ratio by tier); SGLang 0.5.23 ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:token_usage``, and for the KV capacity (it has no cache_config_info) ``sglang:page_size`` and
``sglang:num_pages``.

Restart detection (`restart_reason`, pure; the pool compares each scrape with the endpoint's previous one,
however long ago, so a restart while the endpoint was unreachable is caught at its first scrape back):
the endpoint restarted when ``process_start_time_seconds`` (prometheus_client's process collector, which vLLM
exposes) changed, or when a cumulative counter (`COUNTER_NAMES`, summed over its samples) went backwards.
Either signal alone suffices: a server without the start time is still caught by its counters, as long as
the new process has not yet counted past the old one's last scrape (the first scrape back, 100 ms after it
answers, normally sees counters near 0).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import orjson

from prefixroute.types import EndpointId

RUNNING_NAMES = (b"vllm:num_requests_running", b"sglang:num_running_reqs")
WAITING_NAMES = (b"vllm:num_requests_waiting", b"sglang:num_queue_reqs")
KV_USAGE_NAMES = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc", b"sglang:token_usage")
CACHE_CONFIG_NAME = b"vllm:cache_config_info"
OFFLOAD_CONFIG_NAME = b"vllm:kv_offload_config_info"
OFFLOAD_NUM_CHUNKS_LABEL = b"cpu_num_chunks"
OFFLOAD_BLOCKS_PER_CHUNK_LABEL = b"cpu_blocks_per_chunk"
"""The labels of vLLM's CPU tier on `OFFLOAD_CONFIG_NAME` (``vllm/v1/kv_offload/cpu/common.py``
``CPUOffloadingInfo``): chunk slots, and GPU blocks per chunk. A series whose values are empty (a tiering
connector's secondary tier: the labels are declared for every tier, filled by the CPU one only) or ``"None"``
says nothing about a CPU tier and is skipped."""
PREFIX_CACHE_NAMES = (b"vllm:prefix_cache_queries_total", b"vllm:prefix_cache_hits_total",
                      b"vllm:external_prefix_cache_hits_total")
"""Prompt tokens looked up, found on the GPU, loaded from a connector's tier (the native offloading's CPU tier)."""
SGLANG_PAGE_SIZE_NAME = b"sglang:page_size"
SGLANG_NUM_PAGES_NAME = b"sglang:num_pages"
START_TIME_NAME = b"process_start_time_seconds"
COUNTER_NAMES = (b"vllm:prompt_tokens_total", b"vllm:generation_tokens_total", b"vllm:request_success_total",
                 b"vllm:prefix_cache_queries_total", b"sglang:prompt_tokens_total", b"sglang:generation_tokens_total")
"""Cumulative counters compared between scrapes (restart detection); any that the payload carries."""
START_TIME_TOLERANCE_S = 0.5
"""Start times closer than this are the same process (the value is fixed per process; the slack absorbs a
float printed with fewer digits)."""

_LABEL_RE = re.compile(rb'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True, slots=True)
class ScrapedMetrics:
    """What one scrape told us; None = the payload did not carry that signal."""

    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    kv_cache_usage_ratio: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    num_cpu_blocks: int | None = None  # the host KV tier in GPU blocks: cpu_num_chunks x cpu_blocks_per_chunk
    # (queried, GPU hit, CPU-tier hit) prompt tokens since the server started (`PREFIX_CACHE_NAMES`; a missing
    # tier counter counts 0); None without vllm:prefix_cache_queries
    prefix_cache_tokens: tuple[float, float, float] | None = None
    process_start_time_s: float | None = None  # process_start_time_seconds (Unix time), restart detection
    counter_totals: tuple[float | None, ...] = ()  # per COUNTER_NAMES (None: absent; () none), restart detection


def _samples(data: bytes, name: bytes) -> list[bytes]:
    """The lines of `data` whose metric name is exactly `name` (labels allowed), without the newline."""
    out: list[bytes] = []
    needle = b"\n" + name
    pos = 0 if data.startswith(name) else data.find(needle)
    if pos > 0:
        pos += 1
    while pos >= 0:
        end = data.find(b"\n", pos)
        if end < 0:
            end = len(data)
        nxt = data[pos + len(name):pos + len(name) + 1]
        if nxt in (b"{", b" ", b"\t"):
            out.append(data[pos:end])
        found = data.find(needle, end - 1 if end > 0 else 0)
        pos = found + 1 if found >= 0 else -1
    return out


def _value(line: bytes) -> float | None:
    rb = line.rfind(b"}")
    rest = line[rb + 1:] if rb >= 0 else line.split(None, 1)[1] if b" " in line else b""
    parts = rest.split()
    if not parts:
        return None
    try:
        v = float(parts[0])
    except ValueError:
        return None
    return v if v == v else None  # NaN = no value


def _is_breakdown(line: bytes) -> bool:
    """A per-priority sample (``priority="<n>"``) beside the total (``priority=""``, or no such label)."""
    i = line.find(b'priority="')
    return i >= 0 and line[i + 10:i + 11] != b'"' and (i == 0 or line[i - 1:i] in (b"{", b","))


def _gauge(data: bytes, names: Iterable[bytes]) -> list[float]:
    for name in names:
        vals = [v for v in (_value(line) for line in _samples(data, name) if not _is_breakdown(line))
                if v is not None]
        if vals:
            return vals
    return []


def _num_cpu_blocks(data: bytes) -> int | None:
    """The CPU tier's size in GPU blocks from ``vllm:kv_offload_config_info`` (`OFFLOAD_NUM_CHUNKS_LABEL` x
    `OFFLOAD_BLOCKS_PER_CHUNK_LABEL`), summed over the series (each engine of a data-parallel server reports
    its own tier); None when no series gives both as positive integers."""
    total = None
    for line in _samples(data, OFFLOAD_CONFIG_NAME):
        labels = dict(_LABEL_RE.findall(line))
        try:
            chunks = int(labels[OFFLOAD_NUM_CHUNKS_LABEL])
            per_chunk = int(labels[OFFLOAD_BLOCKS_PER_CHUNK_LABEL])
        except (KeyError, ValueError):  # absent, "" (not filled) or "None"
            continue
        if chunks > 0 and per_chunk > 0:
            total = (total or 0) + chunks * per_chunk
    return total


def parse_metrics(data: bytes) -> ScrapedMetrics:
    """Parse the needed vLLM or SGLang gauges out of a Prometheus text exposition (never raises on bad text)."""
    running = _gauge(data, RUNNING_NAMES)
    waiting = _gauge(data, WAITING_NAMES)
    kv = _gauge(data, KV_USAGE_NAMES)
    num_gpu_blocks = block_size = None
    for line in _samples(data, CACHE_CONFIG_NAME):
        labels = {k: v for k, v in _LABEL_RE.findall(line)}
        try:
            nb = int(float(labels[b"num_gpu_blocks"]))
            bs = int(float(labels[b"block_size"]))
        except (KeyError, ValueError):
            continue
        if nb > 0 and bs > 0:
            num_gpu_blocks = (num_gpu_blocks or 0) + nb  # several engines: capacities add up
            block_size = bs
    if block_size is None:  # SGLang: its page size and page count
        pages, size = _gauge(data, (SGLANG_NUM_PAGES_NAME,)), _gauge(data, (SGLANG_PAGE_SIZE_NAME,))
        if pages and size and size[0] > 0 and sum(pages) > 0:
            num_gpu_blocks, block_size = int(sum(pages)), int(size[0])
    num_cpu_blocks = _num_cpu_blocks(data)
    cache = [sum(_gauge(data, (name,))) for name in PREFIX_CACHE_NAMES]
    prefix_cache_tokens = (cache[0], cache[1], cache[2]) if _gauge(data, PREFIX_CACHE_NAMES[:1]) else None
    start = _gauge(data, (START_TIME_NAME,))
    totals = []
    for name in COUNTER_NAMES:
        vals = _gauge(data, (name,))
        totals.append(sum(vals) if vals else None)
    return ScrapedMetrics(
        num_requests_running=max(0, round(sum(running))) if running else None,
        num_requests_waiting=max(0, round(sum(waiting))) if waiting else None,
        kv_cache_usage_ratio=min(1.0, max(0.0, sum(kv) / len(kv))) if kv else None,
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        num_cpu_blocks=num_cpu_blocks,
        prefix_cache_tokens=prefix_cache_tokens,
        process_start_time_s=start[0] if start else None,
        counter_totals=tuple(totals) if any(t is not None for t in totals) else (),
    )


def restart_reason(prev: ScrapedMetrics, new: ScrapedMetrics) -> str | None:
    """Why `new` (a scrape) comes from another process than `prev` (the same endpoint's previous scrape), or
    None when nothing says so (module docstring). A signal missing from either scrape is no evidence."""
    a, b = prev.process_start_time_s, new.process_start_time_s
    if a is not None and b is not None and abs(a - b) > START_TIME_TOLERANCE_S:
        return f"process_start_time_seconds changed from {a:.3f} to {b:.3f}"
    for name, old, cur in zip(COUNTER_NAMES, prev.counter_totals, new.counter_totals):
        if old is not None and cur is not None and cur < old:
            return f"counter {name.decode()} went backwards from {old:g} to {cur:g}"
    return None


def _model_entries(body: bytes) -> list[dict]:
    """The model objects of an OpenAI ``GET /v1/models`` body (``{"data": [{"id": ...}, ...]}``); ValueError."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"/v1/models body is not JSON: {exc}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models body has no 'data' list")
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def parse_adapters(body: bytes) -> frozenset[str]:
    """The LoRA adapters among the models of a ``GET /v1/models`` body: entries with a non-null ``parent`` (vLLM
    lists an adapter with its base model as parent); ValueError as `parse_models`."""
    return frozenset(m["id"] for m in _model_entries(body) if m.get("parent"))


def parse_models(body: bytes) -> frozenset[str]:
    """Model ids in an OpenAI ``GET /v1/models`` body (``{"data": [{"id": ...}, ...]}``); raises ValueError."""
    return frozenset(m["id"] for m in _model_entries(body))


_HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                          r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
_IPV6_RE = re.compile(r"^\[[0-9A-Fa-f:.]+\]$")


def parse_endpoint(spec: str) -> EndpointId:
    """Validate one ``host:port`` (IPv6 as ``[::1]:port``); raises ValueError with a clear message."""
    s = spec.strip()
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"endpoint {spec!r} is not host:port")
    if "://" in s or "/" in s:
        raise ValueError(f"endpoint {spec!r} must be host:port without scheme or path")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {spec!r}: port must be a number in 1-65535")
    if not (_HOSTNAME_RE.match(host) or _IPV6_RE.match(host)):
        raise ValueError(f"endpoint {spec!r}: {host!r} is not a valid host name or address")
    return EndpointId(f"{host}:{int(port)}")


_ZMQ_TCP_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


def split_event_address(spec: str) -> tuple[str, str | None]:
    """``host:port@tcp://evhost:evport`` -> (``host:port``, ``tcp://evhost:evport``); without ``@``, (spec,
    None). The event address must be ``tcp://host:port`` (a ZMQ PUB socket to connect to); ValueError else."""
    head, sep, addr = spec.strip().partition("@")
    if not sep:
        return head, None
    m = _ZMQ_TCP_RE.match(addr.strip())
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"endpoint {spec!r}: the KV-event address after '@' must be tcp://host:port")
    return head, addr.strip()


def with_port_offset(address: str, offset: int) -> str:
    """``tcp://host:port`` with port + `offset` (ValueError past 65535)."""
    host, _, port = address.rpartition(":")
    p = int(port) + offset
    if not 0 < p < 65536:
        raise ValueError(f"{address} + {offset} is not a valid port")
    return f"{host}:{p}"


def parse_endpoint_list(specs: Iterable[str]) -> tuple[EndpointId, ...]:
    """Validate several endpoints, keeping order; duplicates are an error (they would skew balance). A KV-event
    address after ``@`` is validated and left out (`event_addresses` reads it)."""
    out: list[EndpointId] = []
    for spec in specs:
        if not spec.strip():
            continue
        ep = parse_endpoint(split_event_address(spec)[0])
        if ep in out:
            raise ValueError(f"endpoint {ep} is listed twice")
        out.append(ep)
    return tuple(out)


def event_addresses(specs: Iterable[str], port_offset: int = 0,
                    replay_port_offset: int = 1) -> dict[EndpointId, tuple[str, str | None]]:
    """Endpoint -> (PUB address, replay address or None) for the endpoints that publish KV events: those with
    ``@tcp://...`` and, when `port_offset` > 0, every other at ``tcp://HOST:PORT+port_offset``. Replay at the
    PUB port + `replay_port_offset` (0: None)."""
    out: dict[EndpointId, tuple[str, str | None]] = {}
    for spec in specs:
        if not spec.strip():
            continue
        head, addr = split_event_address(spec)
        ep = parse_endpoint(head)
        if addr is None and port_offset:
            host, _, port = ep.rpartition(":")
            addr = with_port_offset(f"tcp://{host}:{port}", port_offset)
        if addr is not None:
            out[ep] = (addr, with_port_offset(addr, replay_port_offset) if replay_port_offset else None)
    return out


def read_endpoints_file(text: str) -> list[str]:
    """Endpoint specs from a file's text. Accepted: a JSON list (``["h:1", "h:2"]``), a YAML block list
    (``- h:1`` lines) or flow list (``[h:1, h:2]``), or one ``host:port`` per line; ``#`` starts a comment.
    (No YAML library: these list forms are all an endpoints file needs.)"""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            doc = orjson.loads(stripped)
        except orjson.JSONDecodeError:
            if not stripped.endswith("]"):
                raise ValueError("endpoints file: unterminated list") from None
            doc = [x.strip().strip("\"'") for x in stripped[1:-1].split(",")]
        if not isinstance(doc, list) or not all(isinstance(x, str) for x in doc):
            raise ValueError("endpoints file: the list must hold host:port strings")
        return [x for x in doc if x.strip()]
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-"):
            line = line[1:].strip()
        line = line.strip("\"'")
        if line:
            out.append(line)
    return out
