"""Runs a released engine's own KV-event code (vLLM's or SGLang's, extracted from its wheel) in a child process.

Usage (from `helpers.engines`, which extracts the files and starts this script)::

    python engine_driver.py --release vllm-0.33.0 --src DIR [--bytes-hashes] capture
    python engine_driver.py --release vllm-0.33.0 --src DIR serve --endpoint tcp://127.0.0.1:P --replay tcp://127.0.0.1:Q
    python engine_driver.py --release vllm-0.33.0 --src DIR bridge --from tcp://127.0.0.1:S --endpoint ... --replay ...
    python engine_driver.py --release vllm-0.33.0 --src DIR surface      (or validate, reading JSON lines)

A loopback ``--endpoint`` is bound where the release can be told to bind it (SGLang 0.5.2x ``bind=True``); the
others bind only wildcard endpoints, so theirs becomes ``tcp://*:P`` (vLLM's documented form).

What runs is the release's code, unchanged: its event classes (``BlockStored`` ...), its batch class and its
``ZmqEventPublisher`` (threads, sockets, replay buffer: the bytes on the wire are the release's), and for vLLM
>= 0.33 its offloading connector's ``OffloadingEventsTracker`` (0.34: also a Mamba group's state checkpoint),
for SGLang 0.5.23 its ``KVCacheEventRecorder`` (radix-cache events, one per page). Its other imports (torch,
vllm.config, the logger, network helpers) are replaced by the smallest stubs; where a module also holds functions
the events need (``kv_cache_utils``, ``kv_offload/base.py``, SGLang's ``mem_cache/utils.py``) those functions are
*sliced* out of the release's own file (`slice_module`: its top-level definitions by name, executed as written)
rather than rewritten.

Modes:
- ``capture``: publish the scenario (`scenario`) to an ``inproc://`` socket, read every live frame and two
  replays (from 0 and from the middle), print one JSON object: frames (base64), the release's module digests
  and the expected outcome (what the engine holds on the GPU afterwards, and the prompts the router must match).
- ``serve``: bind the publisher, publish the scenario at once (nobody listening: a late joiner must replay) or
  when a line ``publish`` arrives on stdin; print ``READY`` and the expected outcome as JSON; run until stdin
  closes.
- ``bridge``: subscribe to a simulated server's publisher (prefixroute's format) and republish every batch
  through the release's classes and publisher (hashes as the release would send them), so a router faces the
  release's bytes for a real server's cache. Prints ``READY``; runs until stdin closes.
- ``surface``: the release's own metrics code (vLLM's ``PrometheusStatLogger`` and, from 0.33, its offloading
  connector's ``OffloadPromMetrics`` with the CPU spec's labels; SGLang's
  ``SchedulerMetricsCollector``) records known figures; prints its /metrics text and (vLLM) the JSON schemas
  of its ``ErrorResponse`` and ``ResponsesResponse`` models. ``validate``: validates JSON bodies by those
  models.
"""

from __future__ import annotations

import argparse
import ast
import base64
import dataclasses
import enum
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import msgspec
import zmq

BS = 16  # tokens per block in every scenario (the router's default)
PAGE_SIZE = BS  # SGLang's tokens per page (--page-size: smaller than BS in the page scenario)


# --- loading a release's modules --------------------------------------------------------------------------
def stub(name: str, **attrs: Any) -> types.ModuleType:
    """A stub module (a package, so submodules may follow), linked to its parent package."""
    mod = types.ModuleType(name)
    mod.__path__ = []  # type: ignore[attr-defined]
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent:
        if parent not in sys.modules:
            stub(parent)
        setattr(sys.modules[parent], leaf, mod)
    return mod


def load_real(name: str, path: Path) -> types.ModuleType:
    """Import the release's file `path` as module `name` (its parents must exist: stubs or real)."""
    parent, _, leaf = name.rpartition(".")
    if parent and parent not in sys.modules:
        stub(parent)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    if parent:
        setattr(sys.modules[parent], leaf, mod)
    return mod


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _Any(metaclass=_AnyMeta):
    """A stand-in for a name the release imports from a module not run here: constructible with anything,
    every attribute and call another stand-in, false, empty. Only reached by code paths the checks do not use
    (a connector's metrics, a spec-decoding logger ...)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Any()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())

    def __getitem__(self, key: Any) -> Any:
        return _Any()


def _names_used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        and n.value.isidentifier()}  # string annotations ("StatLoggerBase")


def _defined(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def slice_module(name: str, path: Path, keep: set[str], inject: dict[str, Any] | None = None, *,
                 optional: bool = False, closure: bool = False, exclude: set[str] = frozenset()) -> types.ModuleType:
    """Module `name` holding only the top-level definitions of `path` named in `keep` (functions, classes,
    assignments; with `closure`, also every top-level definition of the file they use, transitively),
    executed as the release wrote them, after those of its imports that resolve here. A name an import that
    does not resolve (torch, the rest of vLLM) would have given is `inject`ed, or else an `_Any` stand-in; so
    is a name in `exclude` (a definition the closure would pull in through a method the checks never call). A
    name of `keep` the file lacks raises, unless `optional`."""
    tree = ast.parse(path.read_text(), str(path))
    mod = stub(name)
    mod.__file__ = str(path)
    ns = mod.__dict__
    ns.update(inject or {})
    for x in exclude:
        ns.setdefault(x, type(x, (_Any,), {}))
    future = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    flags = 0
    for n in future:
        for a in n.names:
            import __future__
            flags |= getattr(__future__, a.name).compiler_flag
    defs = {d: node for node in tree.body for d in _defined(node)}
    want = set(keep)
    if closure:
        todo = list(want & defs.keys())
        while todo:
            for used in _names_used(defs[todo.pop()]):
                if used in defs and used not in want and used not in exclude:
                    want.add(used)
                    todo.append(used)
    body = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in future:
            try:
                exec(compile(ast.Module([node], []), str(path), "exec", flags=flags, dont_inherit=True), ns)
            except Exception:  # noqa: BLE001 - an import this process cannot satisfy (torch, ...)
                for a in node.names:
                    alias = a.asname or a.name.split(".")[0]
                    ns.setdefault(alias, type(alias, (_Any,), {}))
            continue
        if _defined(node) & want:
            body.append(node)
    missing = keep - {d for node in body for d in _defined(node)}
    if missing and not optional:
        raise RuntimeError(f"{path} has no top-level {', '.join(sorted(missing))}")
    exec(compile(ast.Module(body, []), str(path), "exec", flags=flags, dont_inherit=True), ns)
    return mod


class _Logger(logging.LoggerAdapter):
    """vLLM's logger API (``warning_once`` ...) over a plain logger."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})
        self._once: set = set()

    def _once_(self, level: int, msg: str, *args: Any, **_: Any) -> None:
        if msg not in self._once:
            self._once.add(msg)
            self.log(level, msg, *args)

    def warning_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once_(logging.WARNING, msg, *args, **kw)

    def info_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once_(logging.INFO, msg, *args, **kw)

    def debug_once(self, msg: str, *args: Any, **kw: Any) -> None:
        self._once_(logging.DEBUG, msg, *args, **kw)


def _config_decorator(cls: Any = None, **_: Any) -> Any:
    """Stub of ``vllm.config.utils.config``: a plain dataclass (validation is not what runs here)."""
    if cls is None:
        return lambda c: dataclasses.dataclass(c)
    return dataclasses.dataclass(cls)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclasses.dataclass
class Engine:
    """The release's classes, as loaded: `mod` is its kv_events module."""

    release: str
    kind: str  # "vllm" | "sglang"
    version: tuple[int, ...]
    mod: types.ModuleType
    files: dict[str, str]  # wheel path -> sha256 of each real file run
    bytes_hashes: bool = False
    offloading: Any = None  # vLLM 0.33: (tracker module, base module)
    recorder: Any = None  # SGLang 0.5.23: the mem_cache.events module
    utils: Any = None  # SGLang: the sliced mem_cache.utils

    def fields(self, cls: type) -> tuple[str, ...]:
        return tuple(getattr(cls, "__struct_fields__", ()))

    def make(self, cls_name: str, **kw: Any) -> Any:
        """An instance of the release's event class, with the fields it has (others dropped)."""
        cls = getattr(self.mod, cls_name)
        have = self.fields(cls)
        return cls(**{k: v for k, v in kw.items() if k in have})

    def batch(self, events: list, ts: float | None = None) -> Any:
        cls = self.mod.KVEventBatch
        return cls(ts=time.time() if ts is None else ts, events=events)

    def publisher(self, endpoint: str, replay: str | None, topic: str) -> Any:
        cls = self.mod.ZmqEventPublisher
        params = inspect.signature(cls.__init__).parameters
        kw: dict[str, Any] = {"endpoint": endpoint, "replay_endpoint": replay, "topic": topic}
        if "data_parallel_rank" in params:
            kw["data_parallel_rank"] = 0
        if "attn_dp_rank" in params:
            kw["attn_dp_rank"] = 0
        if endpoint.startswith("tcp://127."):
            if "bind" in params:
                kw["bind"] = True  # SGLang >= 0.5.2x binds a concrete address when told
            else:  # the releases' rule binds only wildcard endpoints (a concrete one is dialled)
                kw["endpoint"] = "tcp://*:" + endpoint.rsplit(":", 1)[1]
        return cls(**kw)

    def block_hash(self, parent: bytes | None, tokens: list[int], extra: Any = None) -> tuple[bytes, Any]:
        """(the 32 raw hash bytes, the hash as this release publishes it)."""
        raw = hashlib.sha256((parent or b"root") + msgspec.msgpack.encode([tokens, extra])).digest()
        return raw, self.external(raw)

    def external(self, raw: bytes) -> Any:
        if self.kind == "sglang":
            return int.from_bytes(raw[:8], "big", signed=True)  # hash_str_to_int64 of the hex digest
        if self.version < (0, 10):
            return int.from_bytes(raw[:8], "big", signed=True)  # Python's hash(): a signed 64-bit int
        if self.bytes_hashes:
            return raw  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
        return int.from_bytes(raw, "big") & ((1 << 64) - 1)  # maybe_convert_block_hash


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split("-", 1)[1].split("."))


def load_engine(release: str, src: Path, *, bytes_hashes: bool = False) -> Engine:
    """Stub what the release's event modules import, then load them from `src` (the extracted wheel files)."""
    kind = release.split("-", 1)[0]
    version = _version(release)
    files: dict[str, str] = {}

    def real(name: str, rel: str) -> types.ModuleType:
        files[rel] = digest(src / rel)
        return load_real(name, src / rel)

    logging.basicConfig(level=logging.WARNING)
    if kind == "vllm":
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0" if bytes_hashes else "1"
        stub("vllm")
        stub("vllm.logger", init_logger=_Logger)
        stub("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=not bytes_hashes)
        stub("vllm.distributed")
        if (src / "vllm/config/kv_events.py").exists():
            stub("vllm.config")
            stub("vllm.config.utils", config=_config_decorator)
            real("vllm.config.kv_events", "vllm/config/kv_events.py")
        else:  # 0.9: KVEventsConfig lives in the 5,000-line vllm/config.py; only its name is needed
            stub("vllm.config", KVEventsConfig=type("KVEventsConfig", (), {}))

        def _no_tcp_zero(*_: Any, **__: Any) -> Any:
            raise NotImplementedError("tcp://*:0 endpoints are not used here")

        stub("vllm.utils")
        stub("vllm.utils.network_utils", get_ip=_no_tcp_zero, get_tcp_uri=_no_tcp_zero,
             is_valid_ipv6_address=lambda ip: ":" in ip, split_zmq_path=_no_tcp_zero)
        stub("vllm.v1")
        stub("vllm.v1.core")
        utils_path = src / "vllm/v1/core/kv_cache_utils.py"
        if "kv_cache_utils" in (src / "vllm/distributed/kv_events.py").read_text():  # 0.10.2+: ExternalBlockHash
            files["vllm/v1/core/kv_cache_utils.py"] = digest(utils_path)
            slice_module("vllm.v1.core.kv_cache_utils", utils_path, {
                "BlockHash", "ExternalBlockHash", "maybe_convert_block_hash", "to_event_extra_keys",
                "BlockHashListWithBlockSize", "BlockHashList", "resolve_block_hashes"},
                {"envs": sys.modules["vllm.envs"], "logger": _Logger("kv_cache_utils")}, optional=True)
        else:
            stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=int)
        mod = real("vllm.distributed.kv_events", "vllm/distributed/kv_events.py")
        eng = Engine(release, kind, version, mod, files, bytes_hashes=bytes_hashes)
        tracker_rel = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py"
        if version >= (0, 33) and (src / tracker_rel).exists():  # the tracker API the scenario drives
            base_rel = "vllm/v1/kv_offload/base.py"
            files[base_rel] = digest(src / base_rel)
            base = slice_module("vllm.v1.kv_offload.base", src / base_rel, {
                "OffloadKey", "make_offload_key", "get_offload_block_hash", "get_offload_group_idx", "Medium",
                "Locality", "OffloadingEvent", "OffloadingKVEventsConfig"},
                exclude={"ReqContext"})  # 0.34: OffloadingEvent.req_context (None here: stores from snapshots)
            stub("vllm.v1.kv_cache_interface", KVCacheGroupSpec=object, MambaSpec=type("MambaSpec", (), {}),
                 get_kv_cache_spec_kind=lambda spec: None, get_kv_cache_spec_sliding_window=lambda spec: None)
            stub("vllm.v1.request", Request=object)
            tracker = real("vllm.distributed.kv_transfer.kv_connector.v1.offloading.events", tracker_rel)
            eng.offloading = (tracker, base)
        return eng
    if kind == "sglang":
        stub("sglang")
        stub("sglang.srt")
        stub("sglang.srt.runtime_context", get_parallel=lambda: None)

        class NetworkAddress:  # only the endpoint-describing helpers use it
            @staticmethod
            def parse(text: str) -> Any:
                raise ValueError(text)

        stub("sglang.srt.utils")
        stub("sglang.srt.utils.network", NetworkAddress=NetworkAddress)
        stub("sglang.srt.disaggregation")
        mod = real("sglang.srt.disaggregation.kv_events", "sglang/srt/disaggregation/kv_events.py")
        eng = Engine(release, kind, version, mod, files)
        events_rel = "sglang/srt/mem_cache/events.py"
        if (src / events_rel).exists():
            utils_rel = "sglang/srt/mem_cache/utils.py"
            files[utils_rel] = digest(src / utils_rel)

            def get_hash_str(key: Any, prior_hash: str | None = None, page_size: int | None = None) -> Any:
                """Stand-in for SGLang's native (C++) page hash: sha256 chained over each page's tokens, hex
                strings, one per page (the shape `compute_node_hash_values` expects)."""
                ids = list(key.token_ids if hasattr(key, "token_ids") else key)
                out, prior = [], prior_hash
                for s in range(0, len(ids), page_size or len(ids) or 1):
                    h = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
                    h.update(msgspec.msgpack.encode(ids[s:s + (page_size or len(ids))]))
                    prior = h.hexdigest()
                    out.append(prior)
                return out

            stub("sglang.srt.mem_cache")
            utils = slice_module("sglang.srt.mem_cache.utils", src / utils_rel, {
                "storage_namespace_seed", "get_storage_hash_str", "hash_str_to_int64", "compute_node_hash_values",
                "compute_node_event_hash_values", "split_node_hash_value"}, {"get_hash_str": get_hash_str})
            utils.get_hash_str = get_hash_str
            eng.recorder = real("sglang.srt.mem_cache.events", events_rel)
            eng.utils = utils
        return eng
    raise ValueError(f"unknown release {release!r}")


# --- the scenario -----------------------------------------------------------------------------------------
def _tokens(seed: int, n_blocks: int) -> list[int]:
    """Deterministic token ids (< 2**17: fits any vocabulary the router hashes)."""
    out, x = [], seed * 2654435761 % (1 << 32)
    for _ in range(n_blocks * BS):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(x % 120_000)
    return out


class _Script:
    """The scenario's batches, and what the engine holds on the GPU after each (hash -> references) with the
    prompts the router must then match: an independent model of the engine's cache, written from the
    scenario's own operations (not from the router's index)."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.refs: dict[int, int] = {}
        self.prompts: dict[str, dict[str, Any]] = {}  # name -> {"tokens", "lora_name", "cache_salt", "blocks"}
        self.checkpoints: list[dict[str, Any]] = []

    @staticmethod
    def key(h: Any) -> int:
        if isinstance(h, bytes):
            return int.from_bytes(h[-8:], "big")
        return h & ((1 << 64) - 1)

    def store(self, hashes: list) -> None:
        for h in hashes:
            k = self.key(h)
            self.refs[k] = self.refs.get(k, 0) + 1

    def remove(self, hashes: list) -> None:
        for h in hashes:
            k = self.key(h)
            if k in self.refs:
                self.refs[k] -= 1
                if not self.refs[k]:
                    del self.refs[k]

    def clear(self) -> None:
        self.refs.clear()
        for p in self.prompts.values():
            p["blocks"] = 0

    def prompt(self, name: str, tokens: list[int], blocks: int, *, lora_name: str | None = None,
               cache_salt: str | None = None) -> None:
        self.prompts[name] = {"tokens": tokens, "blocks": blocks, "lora_name": lora_name, "cache_salt": cache_salt}

    def batch(self, events: list) -> None:
        """One published batch; the expected state after it is what store/remove/prompt said so far."""
        self.batches.append(events)
        self.checkpoints.append({"gpu_blocks": sorted(self.refs),
                                 "prompts": {n: p["blocks"] for n, p in self.prompts.items()}})

    def expected(self) -> dict[str, Any]:
        return {"num_batches": len(self.batches), "gpu_blocks": sorted(self.refs),
                "prompts": {n: dict(p) for n, p in self.prompts.items()}, "checkpoints": self.checkpoints}


def _chain(eng: Engine, tokens: list[int], parent_raw: bytes | None = None,
           extras: list | None = None) -> tuple[list[bytes], list]:
    raws, ext = [], []
    prev = parent_raw
    for i in range(len(tokens) // BS):
        raw, e = eng.block_hash(prev, tokens[i * BS:(i + 1) * BS], (extras or [None] * 99)[i])
        raws.append(raw)
        ext.append(e)
        prev = raw
    return raws, ext


def scenario(eng: Engine) -> tuple[list[list], dict[str, Any]]:
    """The batches (lists of the release's events) and the expected outcome (`_Script.expected`). Covers what
    the release can say: chains and their continuation, a cache salt (extra_keys or SGLang's cache_salt), a
    LoRA adapter, a tail eviction, duplicate physical blocks (stored twice, removed once: still held),
    AllBlocksCleared, and for the releases that have them: a second KV-cache group, non-GPU media
    (offloading), locality/ownership/session ids, lookahead token ids, placeholders."""
    if eng.kind == "sglang" and eng.recorder is not None:
        return _sglang_page_scenario(eng) if PAGE_SIZE < BS else _sglang_recorder_scenario(eng)
    sc = _Script()
    have = set(eng.fields(eng.mod.BlockStored))
    gpu = "GPU"
    session = {"session_id": "sess-1"} if "session_id" in have else {}

    def stored(tokens: list[int], chain: tuple[list, list], parent: Any, *, lora: str | None = None,
               lora_id: int | None = None, extra_keys: list | None = None, medium: str | None = gpu,
               group_idx: int | None = None, **kw: Any) -> Any:
        return eng.make("BlockStored", block_hashes=list(chain[1]), parent_block_hash=parent,
                        token_ids=list(tokens), block_size=BS, lora_id=lora_id, medium=medium, lora_name=lora,
                        extra_keys=extra_keys, group_idx=group_idx, **session, **kw)

    def removed(ext: list, medium: str | None = gpu, **kw: Any) -> Any:
        return eng.make("BlockRemoved", block_hashes=list(ext), medium=medium, **kw)

    # 1. A prompt of 3 blocks; a salted prompt (vLLM: the salt is the last extra key of block 0; SGLang: its
    #    cache_salt field); a LoRA prompt (a release without lora_name says only lora_id: never matched).
    a_tok = _tokens(1, 5)
    a = _chain(eng, a_tok[:3 * BS])
    ev = [stored(a_tok[:3 * BS], a, None)]
    sc.store(a[1])
    sc.prompt("a", a_tok, 3)
    salt = "tenant-7"
    if "extra_keys" in have or "cache_salt" in have:
        s_tok = _tokens(2, 2)
        s = _chain(eng, s_tok, extras=[(salt,), None])
        ev.append(stored(s_tok, s, None, extra_keys=[[salt], None] if "extra_keys" in have else None,
                         cache_salt=salt))
        sc.store(s[1])
        sc.prompt("salted", s_tok, 2, cache_salt=salt)
        sc.prompt("salted-without-salt", s_tok, 0)
    l_tok = _tokens(3, 2)
    lo = _chain(eng, l_tok, extras=[("sql-lora",), ("sql-lora",)])
    ev.append(stored(l_tok, lo, None, lora="sql-lora", lora_id=1,
                     extra_keys=[["sql-lora"], ["sql-lora"]] if "extra_keys" in have else None))
    sc.store(lo[1])
    sc.prompt("lora", l_tok, 2 if "lora_name" in have else 0, lora_name="sql-lora")
    sc.prompt("lora-as-base", l_tok, 0)
    sc.batch(ev)
    # 2. The first prompt continues (parent = its last block), then its tail block is evicted.
    a2 = _chain(eng, a_tok[3 * BS:], parent_raw=a[0][-1])
    sc.store(a2[1])
    sc.prompt("a", a_tok, 5)
    sc.batch([stored(a_tok[3 * BS:], a2, a[1][-1])])
    sc.remove([a2[1][-1]])
    sc.prompt("a", a_tok, 4)
    sc.batch([removed([a2[1][-1]])])
    # 3. Duplicates: one block computed by two requests at once (two physical blocks, two stores), one evicted.
    d_tok = _tokens(4, 2)
    d = _chain(eng, d_tok)
    sc.store(d[1])
    sc.store([d[1][0]])
    sc.prompt("dup", d_tok, 2)
    sc.batch([stored(d_tok, d, None), stored(d_tok[:BS], ([d[0][0]], [d[1][0]]), None)])
    sc.remove([d[1][0]])
    sc.batch([removed([d[1][0]])])
    # 4. A second KV-cache group (a sliding-window layer group): not the router's blocks.
    if "group_idx" in have:
        g = _chain(eng, d_tok, extras=[("g1",), ("g1",)])
        sc.batch([stored(d_tok, g, None, group_idx=1, kv_cache_spec_kind="sliding_window",
                         kv_cache_spec_sliding_window=4096)])
    # 5. The cache is reset; new prompts after it (one with lookahead token ids where the release has them).
    sc.clear()
    sc.batch([eng.make("AllBlocksCleared")])
    e_tok = _tokens(5, 6)
    e = _chain(eng, e_tok)
    kw = {"lookahead_token_ids": [e_tok[(i + 1) * BS:(i + 1) * BS + 4] for i in range(6)]} \
        if "lookahead_token_ids" in have else {}
    sc.store(e[1])
    sc.prompt("e", e_tok, 6)
    sc.batch([stored(e_tok, e, None, **kw)])
    # 6. Other media: vLLM 0.33's offloading connector (its own tracker), or a CPU store and removal in the
    #    release's classes, with locality where the release has it. None of it is on the GPU: when the GPU
    #    then evicts offloaded blocks, they are gone from the router's (GPU) index although a CPU copy lives.
    if eng.offloading is not None:
        for events in _offloading_batches(eng, e_tok, e):  # chunks of blocks 0-1 and 2-3 offloaded, 4-5 too
            sc.batch(events)
        sc.remove(e[1][2:4])
        sc.prompt("e", e_tok, 2)
        sc.batch([removed(e[1][2:4])])
    elif "medium" in have:
        extra = {"locality": "LOCAL"} if "locality" in have else {}
        cpu = "CPU" if eng.kind == "vllm" else "CPU_PINNED"
        sc.batch([stored(e_tok[:2 * BS], (e[0][:2], e[1][:2]), None, medium=cpu, **extra),
                  removed(e[1][:1], medium=cpu, **extra)])
        sc.remove(e[1][1:2])
        sc.prompt("e", e_tok, 1)
        sc.batch([removed(e[1][1:2])])
    f_tok = _tokens(6, 3)
    f = _chain(eng, f_tok)
    sc.store(f[1])
    sc.prompt("f", f_tok, 3)
    sc.batch([stored(f_tok, f, None)])
    return sc.batches, sc.expected()


def _offloading_batches(eng: Engine, tokens: list[int], chain: tuple[list[bytes], list]) -> list[list]:
    """vLLM 0.33's offloading connector: its own `OffloadingEventsTracker` turns raw offloading events into KV
    events. Self-describing CPU stores (chunks of 2 blocks, with token ids), a placeholder store (the tracker
    without a snapshot: empty token ids, block_size 0), a STORAGE-tier store with locality/ownership, and the
    removals that fan out to the same hashes."""
    tracker_mod, base = eng.offloading
    raws = chain[0]
    specs = {0: tracker_mod.OffloadingEventGroupSpec("full_attention", None)}
    cfg = base.OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True)
    tracker = tracker_mod.OffloadingEventsTracker(cfg, specs)
    group = types.SimpleNamespace(hashes_per_chunk=2, tokens_per_chunk=2 * BS, tokens_per_block=BS,
                                  sliding_window_size_in_chunks=None, group_idx=0,
                                  kv_event_group_spec=specs[0], kv_cache_spec=None)  # 0.34: read for Mamba
    req = types.SimpleNamespace(block_hashes=list(raws), all_token_ids=list(tokens), lora_request=None)
    keys = [base.make_offload_key(raws[2 * c + 1], 0) for c in range(3)]
    tracker.record_store(req, group, 0, keys[0])
    tracker.record_store(req, group, 1, keys[1])
    loc = base.Locality.LOCAL
    stores = list(tracker.take_events([
        base.OffloadingEvent(keys=[keys[0], keys[1]], medium=base.Medium.CPU, removed=False, locality=loc,
                             removal_expected=True),
        base.OffloadingEvent(keys=[keys[2]], medium=base.Medium.CPU, removed=False),  # no snapshot: placeholder
        base.OffloadingEvent(keys=[keys[0]], medium=base.Medium.STORAGE, removed=False,
                             locality=base.Locality.REMOTE, ownership="tier-2", removal_expected=True)]))
    # The legacy (not self-describing) tracker: every store a placeholder.
    legacy = tracker_mod.OffloadingEventsTracker(
        base.OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False))
    placeholders = list(legacy.take_events([base.OffloadingEvent(keys=[keys[1]], medium=base.Medium.CPU,
                                                                 removed=False)]))
    removals = list(tracker.take_events([
        base.OffloadingEvent(keys=[keys[0]], medium=base.Medium.CPU, removed=True, locality=loc),
        base.OffloadingEvent(keys=[keys[2]], medium=base.Medium.CPU, removed=True)]))
    if not hasattr(tracker_mod, "describes_group"):
        return [stores, placeholders, removals]
    # vLLM 0.34: a recurrent (Mamba) group's chunk is a state checkpoint: its last hash only, chained to the hash
    # before, no token ids, kv_cache_spec_kind "mamba" (group 1 here: not the router's attention blocks).
    mamba_spec = tracker_mod.OffloadingEventGroupSpec("mamba", None)
    mamba = types.SimpleNamespace(hashes_per_chunk=2, tokens_per_chunk=2 * BS, tokens_per_block=BS,
                                  sliding_window_size_in_chunks=1, group_idx=1, kv_event_group_spec=mamba_spec,
                                  kv_cache_spec=sys.modules["vllm.v1.kv_cache_interface"].MambaSpec())
    mamba_tracker = tracker_mod.OffloadingEventsTracker(cfg, {0: specs[0], 1: mamba_spec})
    mamba_key = base.make_offload_key(raws[1], 1)
    mamba_tracker.record_store(req, mamba, 0, mamba_key)
    checkpoints = list(mamba_tracker.take_events([
        base.OffloadingEvent(keys=[mamba_key], medium=base.Medium.CPU, removed=False)]))
    return [stores, placeholders, removals, checkpoints]


class _Key:  # the parts of SGLang's RadixKey its recorder reads
    def __init__(self, tokens: list[int], cache_salt: str | None = None) -> None:
        self.token_ids, self.cache_salt, self.extra_key, self.is_bigram = tokens, cache_salt, None, False

    def __len__(self) -> int:
        return len(self.token_ids)


class _Node:  # the parts of SGLang's TreeNode its recorder and its node split read
    def __init__(self, key: _Key, parent: _Node | None) -> None:
        self.key, self.parent, self.hash_value, self.event_hash_value = key, parent, None, None


class _SglangTree:
    """SGLang's own `KVCacheEventRecorder` at `page_size`, a tree root, and store/remove of a node that also tell
    the scenario's `_Script` (GPU only) the hashes the recorder publishes for it."""

    def __init__(self, eng: Engine, page_size: int) -> None:
        self.eng = eng
        self.recorder = eng.recorder.KVCacheEventRecorder(enabled=True, page_size=page_size)
        self.medium_cls = eng.mod.StorageMedium
        self.sc = _Script()
        self.root = _Node(_Key([]), None)
        self.root.hash_value = []

    def published(self, node: _Node) -> list[int]:
        seed = self.recorder._namespace_seed(node)
        to_int = self.eng.utils.hash_str_to_int64
        return [self.eng.mod.namespaced_block_hash(to_int(v), namespace_seed=seed)
                for v in self.recorder._node_event_hash_values(node)]

    def store(self, node: _Node, medium: Any = None) -> None:
        self.recorder.record_store(node, medium, session_id="sess-1")
        if medium is None:
            self.sc.store(self.published(node))

    def remove(self, node: _Node, medium: Any = None) -> None:
        self.recorder.record_remove(node, medium)
        if medium is None:
            self.sc.remove(self.published(node))


def _sglang_recorder_scenario(eng: Engine) -> tuple[list[list], dict[str, Any]]:
    """SGLang 0.5.23's own `KVCacheEventRecorder` on radix-tree nodes (key, parent, hash values): one
    BlockStored per 16-token page, coalesced along a node; signed int64 hashes; ``cache_salt`` namespacing;
    host-memory (CPU_PINNED) stores; removals per node; AllBlocksCleared."""
    tree = _SglangTree(eng, BS)
    recorder, medium_cls, sc, root, store, remove = (tree.recorder, tree.medium_cls, tree.sc, tree.root,
                                                     tree.store, tree.remove)

    a_tok = _tokens(11, 5)
    a = _Node(_Key(a_tok[:3 * BS]), root)
    store(a)
    s_tok = _tokens(12, 2)
    store(_Node(_Key(s_tok, cache_salt="tenant-7"), root))
    sc.prompt("a", a_tok, 3)
    sc.prompt("salted", s_tok, 2, cache_salt="tenant-7")
    sc.prompt("salted-without-salt", s_tok, 0)
    sc.batch(recorder.take())
    store(_Node(_Key(a_tok[3 * BS:]), a))
    sc.prompt("a", a_tok, 5)
    sc.batch(recorder.take())
    b_tok = a_tok[:3 * BS] + _tokens(13, 1)
    b = _Node(_Key(b_tok[3 * BS:]), a)  # a sibling branch under a: stored, then evicted
    store(b)
    sc.prompt("branch", b_tok, 4)
    sc.batch(recorder.take())
    remove(b)
    sc.prompt("branch", b_tok, 3)
    sc.batch(recorder.take())
    store(a, medium_cls.CPU)  # HiCache host copy of a, then a leaves the GPU (its host copy stays), then the host
    sc.batch(recorder.take())
    remove(a)
    sc.prompt("a", a_tok, 0)
    sc.prompt("branch", b_tok, 0)
    sc.batch(recorder.take())
    remove(a, medium_cls.CPU)
    sc.batch(recorder.take())
    recorder.record_all_cleared()
    sc.clear()
    sc.batch(recorder.take())
    f_tok = _tokens(14, 3)
    store(_Node(_Key(f_tok), root))
    sc.prompt("f", f_tok, 3)
    sc.batch(recorder.take())
    return sc.batches, sc.expected()


def _sglang_page_scenario(eng: Engine) -> tuple[list[list], dict[str, Any]]:
    """SGLang 0.5.23's own `KVCacheEventRecorder` at pages of `PAGE_SIZE` tokens, smaller than the router's `BS`
    (SGLang's default page is 1 token): a radix node's pages coalesced into one BlockStored; a branch forking
    inside a router block, its node split by the release's own ``split_node_hash_value`` (a split publishes
    nothing: the branch's parent is a page in the middle of an earlier event); a chain extended across nodes;
    leaf-first removals per node; a salted prompt; a host (CPU_PINNED) copy; AllBlocksCleared. The expected
    prompts are in router blocks: the complete `BS`-token blocks of the longest prefix the tree holds."""
    page = PAGE_SIZE
    tree = _SglangTree(eng, page)
    recorder, medium_cls, sc, root, store, remove = (tree.recorder, tree.medium_cls, tree.sc, tree.root,
                                                     tree.store, tree.remove)

    def split(child: _Node, split_len: int) -> _Node:
        """RadixCache._split_node's tree surgery, its hash values split by the release's function."""
        top = _Node(_Key(child.key.token_ids[:split_len], child.key.cache_salt), child.parent)
        child.key = _Key(child.key.token_ids[split_len:], child.key.cache_salt)
        child.parent = top
        top.hash_value, child.hash_value = eng.utils.split_node_hash_value(child.hash_value, split_len, page)
        top.event_hash_value, child.event_hash_value = eng.utils.split_node_hash_value(
            child.event_hash_value, split_len, page)
        return top

    a_tok = _tokens(21, 4)[:52]  # 3 router blocks and 4 tokens
    a = _Node(_Key(a_tok), root)
    store(a)
    s_tok = _tokens(22, 3)[:40]
    salted = _Node(_Key(s_tok, cache_salt="tenant-7"), root)
    store(salted)
    sc.prompt("a", a_tok, 3)
    sc.prompt("salted", s_tok, 2, cache_salt="tenant-7")
    sc.prompt("salted-without-salt", s_tok, 0)
    sc.batch(recorder.take())
    b_tok = a_tok[:20] + _tokens(23, 2)[:30]  # forks from a at token 20: inside the second router block
    top = split(a, 20)
    b = _Node(_Key(b_tok[20:]), top)
    store(b)
    sc.prompt("branch", b_tok, 3)
    sc.batch(recorder.take())
    c_tok = a_tok + _tokens(24, 1)  # extends a: its fourth router block spans a's last 4 tokens and c's first 12
    c = _Node(_Key(c_tok[len(a_tok):]), a)
    store(c)
    sc.prompt("a-long", c_tok, 4)
    sc.batch(recorder.take())
    remove(b)
    sc.prompt("branch", b_tok, 1)
    sc.batch(recorder.take())
    store(a, medium_cls.CPU)  # a host copy of a, then a leaves the GPU, leaf first
    remove(c)
    remove(a)
    sc.prompt("a", a_tok, 1)
    sc.prompt("a-long", c_tok, 1)
    sc.batch(recorder.take())
    remove(top)
    sc.prompt("a", a_tok, 0)
    sc.prompt("a-long", c_tok, 0)
    sc.prompt("branch", b_tok, 0)
    sc.batch(recorder.take())
    recorder.record_all_cleared()
    sc.clear()
    sc.batch(recorder.take())
    f_tok = _tokens(25, 3)[:33]
    store(_Node(_Key(f_tok), root))
    sc.prompt("f", f_tok, 2)
    sc.batch(recorder.take())
    return sc.batches, sc.expected()


# --- the rest of the engine's surface: /metrics, error and Responses models ---------------------------------
class _LaxModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _NoneNS(types.SimpleNamespace):
    """A config namespace whose unset attributes are None (the release reads a few optional settings)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


RECORDED = {"running": 3, "waiting": 2, "kv_usage": 0.42, "block_size": 16, "num_gpu_blocks": 1234,
            "prefix_queries": 100, "prefix_hits": 40,
            # the native offloading's CPU tier, per engine (vLLM >= 0.33: vllm:kv_offload_config_info): engine 1
            # with 4 blocks per chunk and max_model_len unknown (its size in tokens reads "None")
            "offload": [{"engine": 0, "num_chunks": 2048, "blocks_per_chunk": 1, "max_model_len": 4096},
                        {"engine": 1, "num_chunks": 500, "blocks_per_chunk": 4, "max_model_len": 0}],
            "num_cpu_blocks": 2048 * 1 + 500 * 4}
"""What `surface` makes the release's metrics code record (a test checks the router's scraper reads it back)."""


def _vllm_metrics(src: Path, files: dict[str, str]) -> str:
    """vLLM's own ``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py) recording `RECORDED` as the engine
    core would (``SchedulerStats``, ``log_engine_initialized`` for ``vllm:cache_config_info``, its labels from
    the release's own ``CacheConfig.metrics_info`` over the release's ``CacheConfig`` fields): its exposition."""
    from prometheus_client import REGISTRY, generate_latest

    m = "vllm/v1/metrics/"
    for rel in (m + "cache_hit_source.py", m + "buckets.py", m + "utils.py", m + "prometheus.py"):
        files[rel] = digest(src / rel)
        load_real(rel[:-3].replace("/", "."), src / rel)
    for rel in (m + "stats.py", m + "loggers.py", "vllm/v1/engine/__init__.py", "vllm/config/cache.py"):
        files[rel] = digest(src / rel)
    stats = slice_module("vllm.v1.metrics.stats", src / m / "stats.py", {"SchedulerStats", "PrefixCacheStats"},
                         closure=True)
    slice_module("vllm.v1.engine", src / "vllm/v1/engine/__init__.py", {"FinishReason"}, closure=True)
    loggers = slice_module("vllm.v1.metrics.loggers", src / m / "loggers.py", {"PrometheusStatLogger"}, closure=True)
    tree = ast.parse((src / "vllm/config/cache.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheConfig")
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
              and not n.target.id.isupper()]
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "metrics_info")
    ns: dict[str, Any] = {}
    exec(compile(ast.Module([method], []), str(src / "vllm/config/cache.py"), "exec"), ns)
    cache = type("CacheConfig", (), {"metrics_info": ns["metrics_info"]})()
    for f in fields:
        setattr(cache, f, None)
    cache.block_size = cache.hash_block_size = RECORDED["block_size"]
    cache.num_gpu_blocks = RECORDED["num_gpu_blocks"]
    cache.enable_prefix_caching = True
    cfg = _NoneNS(observability_config=_NoneNS(show_hidden_metrics=False, kv_cache_metrics=False),
                  model_config=_NoneNS(served_model_name="m", max_model_len=4096, is_diffusion=False),
                  cache_config=cache)
    logger = loggers.PrometheusStatLogger(cfg, [0])
    logger.log_engine_initialized()
    st = stats.SchedulerStats(num_running_reqs=RECORDED["running"], num_waiting_reqs=RECORDED["waiting"],
                              kv_cache_usage=RECORDED["kv_usage"])
    st.prefix_cache_stats.queries = RECORDED["prefix_queries"]
    st.prefix_cache_stats.hits = RECORDED["prefix_hits"]
    logger.record(st, None)
    if (src / OFFLOAD_METRICS).exists():
        _vllm_offload_metrics(src, files)
    return generate_latest(REGISTRY).decode()


OFFLOAD_METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py"


def _vllm_offload_metrics(src: Path, files: dict[str, str]) -> None:
    """vLLM's own offloading connector metrics (``OffloadPromMetrics``, with the CPU spec's label names and
    metric definitions, ``CPUOffloadingSpec``) observing what each engine's scheduler sends once: its
    ``OffloadingConnectorStats.set_info`` of the CPU manager's config info, ``CPUOffloadingInfo.from_config``
    over the release's ``OffloadingConfig`` (`RECORDED` ``offload``). Registers into prometheus_client's
    default registry, as vLLM does."""
    from prometheus_client import Counter, Gauge, Histogram

    rels = {"math": "vllm/utils/math_utils.py", "base": "vllm/v1/kv_offload/base.py",
            "config": "vllm/v1/kv_offload/config.py", "common": "vllm/v1/kv_offload/cpu/common.py",
            "spec": "vllm/v1/kv_offload/cpu/spec.py", "conn": "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",
            "metrics": OFFLOAD_METRICS}
    for rel in rels.values():
        files[rel] = digest(src / rel)
    slice_module("vllm.utils.math_utils", src / rels["math"], {"cdiv", "round_up"})
    config = load_real("vllm.v1.kv_offload.config", src / rels["config"])
    base = slice_module("vllm.v1.kv_offload.base", src / rels["base"], {
        "ConfigInfoMapping", "ConfigInfo", "OffloadingMetricMetadata", "OffloadingCounterMetadata",
        "OffloadingGaugeMetadata", "OffloadingHistogramMetadata"})
    for name in ("OffloadingSpec", "OffloadingManager", "OffloadingWorker", "CanonicalKVCaches",
                 "BlockIDsLoadStoreSpec"):  # what the spec and common import beside them; not run here
        setattr(base, name, type(name, (), {}))
    common = slice_module("vllm.v1.kv_offload.cpu.common", src / rels["common"],
                          {"CPUOffloadingInfo", "CPUOffloadingMetrics", "_kv_cache_size_tokens"})
    spec = slice_module("vllm.v1.kv_offload.cpu.spec", src / rels["spec"], {"CPUOffloadingSpec"})
    stub("vllm.v1.kv_offload.factory", OffloadingSpecFactory=types.SimpleNamespace(
        get_spec_cls=lambda extra_config: spec.CPUOffloadingSpec))
    slice_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics", src / rels["conn"],
                 {"KVConnectorStats", "KVConnectorPromMetrics", "PromMetric", "PromMetricT"})
    mod = slice_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics", src / rels["metrics"],
                       {"OffloadPromMetrics", "OffloadingConnectorStats"}, closure=True)
    extra = {"cpu_bytes_to_use": 8 << 30}
    engines = RECORDED["offload"]
    prom = mod.OffloadPromMetrics(_NoneNS(kv_transfer_config=_NoneNS(kv_connector_extra_config=extra)),
                                  {Gauge: Gauge, Counter: Counter, Histogram: Histogram}, ["model_name", "engine"],
                                  {e["engine"]: ["m", str(e["engine"])] for e in engines})
    bs = RECORDED["block_size"]
    for e in engines:
        cfg = config.OffloadingConfig(
            groups=(config.OffloadingGroupConfig(tokens_per_block=bs, layer_names=("layer.0",), group_id=0),),
            worker_kv_bytes_per_block=bs * 128 * 1024, enable_kv_cache_events=False, extra_config=extra,
            engine_id=f"engine-{e['engine']}",
            model=config.OffloadingModelConfig(name="m", dtype="bfloat16", max_model_len=e["max_model_len"]),
            cache=config.OffloadingCacheConfig(tokens_per_hash=bs, blocks_per_chunk=e["blocks_per_chunk"]),
            parallel=_NoneNS(rank=0, world_size=1))
        info = common.CPUOffloadingInfo.from_config(cfg, e["num_chunks"], bs * 128 * 1024 * e["blocks_per_chunk"])
        stats = mod.OffloadingConnectorStats()
        stats.set_info([info.as_config_info()])  # CPUOffloadingManager.config_info(): [its info's mapping]
        names = mod._TransferMetricName  # one load and one store of 8 blocks, as the worker reports them
        for name, value in ((names.LOAD_BYTES, 16 << 20), (names.LOAD_TIME, 0.0003), (names.STORE_BYTES, 16 << 20),
                            (names.STORE_TIME, 0.0003)):
            stats.increase_counter(name, value)
        for name in (names.LOAD_SIZE, names.STORE_SIZE):
            stats.observe_histogram(name, 16 << 20)
        prom.observe(stats.data, engine_idx=e["engine"])


def _vllm_models(src: Path, files: dict[str, str]) -> dict[str, Any]:
    """vLLM's own pydantic models of an error body and a Responses object (their import of the rest of vLLM,
    openai-harmony and the renderers stubbed; the openai types they build on are the real package)."""
    import uuid

    stub("vllm.utils", random_uuid=lambda: uuid.uuid4().hex)
    rels = {"serve": "vllm/entrypoints/serve/engine/protocol.py", "gen": "vllm/entrypoints/generate/base/protocol.py",
            "resp": "vllm/entrypoints/openai/responses/protocol.py"}
    for rel in rels.values():
        files[rel] = digest(src / rel)
    base = slice_module("vllm.entrypoints.serve.engine.protocol", src / rels["serve"],
                        {"OpenAIBaseModel", "ErrorInfo", "ErrorResponse"}, closure=True)
    slice_module("vllm.entrypoints.generate.base.protocol", src / rels["gen"], {
        "PerRequestMetrics", "MMPayload", "StopParam", "TopLogprobsParam", "resolve_return_mm_kwargs_alias",
        "validate_cache_salt"}, closure=True, optional=True)
    resp = slice_module("vllm.entrypoints.openai.responses.protocol", src / rels["resp"], {"ResponsesResponse"},
                        {"ChatCompletionMessageParam": dict, "OpenAIHarmonyMessage": dict}, closure=True,
                        exclude={"ResponsesRequest"})
    return {"ErrorResponse": base.ErrorResponse, "ResponsesResponse": resp.ResponsesResponse}


def _sglang_metrics(src: Path, files: dict[str, str]) -> str:
    """SGLang's own ``SchedulerMetricsCollector`` (sglang/srt/observability/metrics_collector.py) logging
    `RECORDED` with priority scheduling on (totals under priority="", per-priority samples beside them) and its
    constants (``sglang:page_size``, ``sglang:num_pages``): its exposition."""
    from prometheus_client import REGISTRY, generate_latest

    stub("sglang")
    stub("sglang.srt")
    stub("sglang.srt.runtime_context", get_schedule=lambda: _NoneNS(prefill_delayer_max_delay_passes=30),
         exports_expert_balancedness_to_prometheus=lambda: False, get_context=_Any, get_disagg=_Any,
         get_observability=_Any, get_parallel=_Any, get_serving=_Any)
    stub("sglang.srt.utils", get_bool_env_var=lambda name, default="false": False)
    o = "sglang/srt/observability/"
    for rel, name in ((o + "utils.py", "sglang.srt.observability.utils"),
                      ("sglang/srt/utils/gauge_histogram.py", "sglang.srt.utils.gauge_histogram")):
        files[rel] = digest(src / rel)
        load_real(name, src / rel)
    for rel in (o + "scheduler_stage_metrics.py", o + "metrics_collector.py"):
        files[rel] = digest(src / rel)
    slice_module("sglang.srt.observability.scheduler_stage_metrics", src / o / "scheduler_stage_metrics.py",
                 {"FORWARD_OVERLAP_CATEGORIES", "FORWARD_OVERLAP_NONE", "SCHEDULER_STAGE_CATEGORIES"}, closure=True)
    mc = slice_module("sglang.srt.observability.metrics_collector", src / o / "metrics_collector.py",
                      {"SchedulerMetricsCollector", "SchedulerStats", "QueueCount"}, closure=True)
    labels = {"model_name": "m", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0,
              "priority": ""}
    c = mc.SchedulerMetricsCollector(labels, _Any())
    r = RECORDED
    c.log_stats(mc.SchedulerStats(num_running_reqs=mc.QueueCount(r["running"], {0: r["running"] - 1, 1: 1}),
                                  num_queue_reqs=mc.QueueCount(r["waiting"], {0: r["waiting"]}),
                                  token_usage=r["kv_usage"]))
    c.emit_constants(max_total_num_tokens=r["num_gpu_blocks"] * r["block_size"], max_total_num_tokens_swa=None,
                     weight_memory_usage_gb=1.0, kv_cache_memory_usage_gb=2.0, graph_memory_usage_gb={},
                     max_running_requests_under_SLO=None, page_size=r["block_size"], num_pages=r["num_gpu_blocks"],
                     context_len=4096, startup_available_gpu_memory_gb=10.0)
    return generate_latest(REGISTRY).decode()


def surface(release: str, src: Path) -> dict[str, Any]:
    files: dict[str, str] = {}
    out: dict[str, Any] = {"release": release, "recorded": RECORDED}
    if release.startswith("vllm"):
        stub("vllm")
        stub("vllm.logger", init_logger=_Logger)
        envs = stub("vllm.envs", VLLM_COMPUTE_NANS_IN_LOGITS=False)
        envs.__class__ = _LaxModule  # every other VLLM_* setting None: the release's default path
        stub("vllm.v1")
        stub("vllm.v1.metrics")
        out["metrics_text"] = _vllm_metrics(src, files)
        out["schemas"] = {name: model.model_json_schema() for name, model in _vllm_models(src, files).items()}
    else:
        out["metrics_text"] = _sglang_metrics(src, files)
    # The release's families only (not prometheus_client's process_/python_ ones), without the *_created
    # timestamps: regenerating changes no byte.
    prefix = "vllm:" if release.startswith("vllm") else "sglang:"
    out["metrics_text"] = "".join(
        line + "\n" for line in out["metrics_text"].splitlines()
        if (line.startswith(prefix) or line.startswith(("# HELP " + prefix, "# TYPE " + prefix)))
        and not (line.split()[2] if line.startswith("#") else line.split("{")[0].split()[0]).endswith("_created"))
    out["files"] = files
    return out


def validate(release: str, src: Path) -> None:
    """Each stdin line ``{"model": NAME, "body": {...}}`` validated by the release's own model: one line out,
    ``{"ok": true}`` or ``{"ok": false, "error": ...}``."""
    stub("vllm")
    stub("vllm.logger", init_logger=_Logger)
    stub("vllm.envs").__class__ = _LaxModule
    models = _vllm_models(src, {})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            models[req["model"]].model_validate(req["body"])
            print(json.dumps({"ok": True}), flush=True)
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, reported
            print(json.dumps({"ok": False, "error": str(exc)}), flush=True)


# --- modes ------------------------------------------------------------------------------------------------
def _b64(frames: list[bytes]) -> list[str]:
    return [base64.b64encode(f).decode() for f in frames]


def _replay(ctx: zmq.Context, address: str, start: int, timeout_ms: int = 3000) -> list[list[bytes]]:
    """Every message the release's replay socket sends for a request from `start`, end marker included."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            out.append(frames)
            if len(frames) >= 2 and frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
    finally:
        sock.close(linger=0)
    return out


def capture(eng: Engine) -> dict[str, Any]:
    ctx = zmq.Context.instance()  # the release's publisher uses the instance: inproc needs the same context
    topic = "kv@pod-0@model"
    pub = eng.publisher("inproc://kv-events", "inproc://kv-events-replay", topic)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://kv-events")
    time.sleep(0.2)  # on purpose: ZMQ says nothing when a subscription has reached a PUB socket (slow joiner)
    batches, expected = scenario(eng)
    for k, events in enumerate(batches):
        pub.publish(eng.batch(events, ts=1_764_000_000.0 + k / 100))  # fixed: regenerating changes no byte
    live = []
    while len(live) < len(batches) and sub.poll(3000):
        live.append(sub.recv_multipart())
    if len(live) != len(batches):
        raise RuntimeError(f"{len(live)} of {len(batches)} live messages arrived")
    replay_all = _replay(ctx, "inproc://kv-events-replay", 0)
    replay_mid = _replay(ctx, "inproc://kv-events-replay", len(batches) // 2)
    pub.shutdown()
    sub.close(linger=0)
    return {"release": eng.release, "kind": eng.kind, "bytes_hashes": eng.bytes_hashes, "topic": topic,
            "block_size": BS, **({"page_size": PAGE_SIZE} if PAGE_SIZE != BS else {}), "files": eng.files,
            "expected": expected,
            "live": [_b64(f) for f in live], "replay_from_0": [_b64(f) for f in replay_all],
            "replay_from_mid": {"start": len(batches) // 2, "messages": [_b64(f) for f in replay_mid]}}


def serve(eng: Engine, endpoint: str, replay: str, topic: str) -> None:
    pub = eng.publisher(endpoint, replay, topic)
    batches, expected = scenario(eng)
    print(json.dumps({"ready": True, "expected": expected}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "publish":
            for events in batches:
                pub.publish(eng.batch(events))
            print(json.dumps({"published": len(batches)}), flush=True)
        elif cmd == "quit":
            break
    pub.shutdown()


def bridge(eng: Engine, source: str, endpoint: str, replay: str, topic: str) -> None:
    """Republish a simulated server's batches through the release (module docstring). Hashes: the simulator's
    int hashes as this release's external form (bytes: 24 zero bytes + the 8 big-endian bytes, so the low 64
    bits are the simulator's hash)."""
    pub = eng.publisher(endpoint, replay, topic)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(source)
    decoder = msgspec.msgpack.Decoder()
    stop = threading.Event()

    def conv(h: Any) -> Any:
        if h is None:
            return None
        h &= (1 << 64) - 1
        return (b"\0" * 24 + h.to_bytes(8, "big")) if eng.bytes_hashes else h

    def run() -> None:
        while not stop.is_set():
            if not sub.poll(100):
                continue
            _, _, payload = sub.recv_multipart()
            obj = decoder.decode(payload)
            events = obj[1] if isinstance(obj, list) else obj["events"]
            out = []
            for e in events:
                tag = e["type"] if isinstance(e, dict) else e[0]
                if tag == "BlockStored":
                    out.append(eng.make("BlockStored", block_hashes=[conv(h) for h in e["block_hashes"]],
                                        parent_block_hash=conv(e.get("parent_block_hash")),
                                        token_ids=list(e["token_ids"]), block_size=e["block_size"],
                                        lora_id=e.get("lora_id"), medium=e.get("medium"),
                                        lora_name=e.get("lora_name"), extra_keys=e.get("extra_keys"),
                                        group_idx=0))
                elif tag == "BlockRemoved":
                    out.append(eng.make("BlockRemoved", block_hashes=[conv(h) for h in e["block_hashes"]],
                                        medium=e.get("medium"), group_idx=0))
                elif tag == "AllBlocksCleared":
                    out.append(eng.make("AllBlocksCleared"))
            if out:
                pub.publish(eng.batch(out))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.2)  # on purpose: the release's publisher thread binds its sockets; it exposes no ready signal
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    stop.set()
    t.join(2)
    pub.shutdown()
    sub.close(linger=0)


def _set_block_size(n: int, page_size: int = 0) -> None:
    global BS, PAGE_SIZE
    BS = n
    PAGE_SIZE = page_size or n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release", required=True, help="e.g. vllm-0.33.0, sglang-0.5.23")
    ap.add_argument("--src", required=True, type=Path, help="the release's extracted files")
    ap.add_argument("--bytes-hashes", action="store_true", help="vLLM: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0")
    ap.add_argument("--topic", default="kv@pod-0@model")
    ap.add_argument("mode", choices=["capture", "serve", "bridge", "surface", "validate"])
    ap.add_argument("--endpoint", default="")
    ap.add_argument("--replay", default="")
    ap.add_argument("--from", dest="source", default="")
    ap.add_argument("--block-size", type=int, default=BS, help="capture: tokens per block (vLLM 0.34's default: 64)")
    ap.add_argument("--page-size", type=int, default=0,
                    help="capture, SGLang: tokens per page when smaller than --block-size (SGLang's default: 1)")
    args = ap.parse_args()
    _set_block_size(args.block_size, args.page_size)
    if args.mode == "surface":
        print(json.dumps(surface(args.release, args.src)))
        os._exit(0)
    if args.mode == "validate":
        validate(args.release, args.src)
        os._exit(0)
    eng = load_engine(args.release, args.src, bytes_hashes=args.bytes_hashes)
    if args.mode == "capture":
        print(json.dumps(capture(eng)))
    elif args.mode == "serve":
        serve(eng, args.endpoint, args.replay, args.topic)
    else:
        bridge(eng, args.source, args.endpoint, args.replay, args.topic)
    os._exit(0)  # the releases' publishers register atexit hooks and daemon threads: leave at once


if __name__ == "__main__":
    sys.exit(main())
