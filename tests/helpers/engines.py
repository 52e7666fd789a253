"""Released engines' own KV-event code, for tests and for regenerating the golden payloads.

`RELEASES` names each release whose publisher we check and why (the form or field it introduced). A release's
wheel is found (`find_wheel`) in, in order: the folders in ``$PREFIXROUTE_ENGINE_WHEELS`` (os.pathsep-
separated), ``<repo>/.cache/engine-wheels`` (where ``tests/data/kv_events/generate.py --download`` puts them),
pip's find-links folders (``$PIP_FIND_LINKS``), and pip's HTTP cache (a wheel pip downloaded before: its cached
bodies are the wheel files). Wheels are never committed (vLLM's is ~350 MB); CI runs without them and the
tests that need one say they skipped. `extract` copies only the few modules the driver runs into a folder;
`run_driver` / `EngineProcess` run ``engine_driver.py`` (the release's code, in a child process) on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("engine_driver.py")
DEFAULT_WHEEL_DIR = REPO / ".cache" / "engine-wheels"
DATA_DIR = REPO / "tests" / "data" / "kv_events"


@dataclass(frozen=True)
class Release:
    name: str  # "vllm-0.33.0": also the folder of its golden payloads
    dist: str
    version: str
    why: str  # what this release's form adds

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


RELEASES: tuple[Release, ...] = (
    Release("vllm-0.9.0", "vllm", "0.9.0", "first release with KV events: all-array batch [ts, events] (no rank), "
            "BlockStored of 5 fields, signed int hashes, (seq, payload) replay"),
    Release("vllm-0.11.0", "vllm", "0.11.0", "array form with data_parallel_rank and medium"),
    Release("vllm-0.17.0", "vllm", "0.17.0", "array form with lora_name and extra_keys (cache_salt, LoRA keys)"),
    Release("vllm-0.23.0", "vllm", "0.23.0", "last all-array release: group_idx, kv_cache_spec_kind/_sliding_window"),
    Release("vllm-0.24.0", "vllm", "0.24.0", "first mixed form: array batch, events as tagged maps"),
    Release("vllm-0.26.0", "vllm", "0.26.0", "locality; replay frames (topic, seq, payload), end (b'', END, b'')"),
    Release("vllm-0.33.0", "vllm", "0.33.0", "ownership, session_id, lookahead_token_ids; the offloading "
            "connector's per-medium events and placeholders; also captured with bytes hashes"),
    Release("vllm-0.34.0", "vllm", "0.34.0", "newest checked: same KV-event, metrics and model forms as 0.33 "
            "(docs/engines.md); its offloading connector's vllm:kv_offload_config_info in the surface"),
    Release("sglang-0.5.10", "sglang", "0.5.10", "SGLang all-array form with attn_dp_rank and medium"),
    Release("sglang-0.5.23", "sglang", "0.5.23", "SGLang mixed form: signed int64 hashes, cache_salt, session_id, "
            "lora_name, one event per page from its KVCacheEventRecorder, CPU_PINNED medium"),
)
BY_NAME = {r.name: r for r in RELEASES}

# The release files the driver runs or slices (those a release lacks are skipped).
FILES = (
    "vllm/distributed/kv_events.py", "vllm/config/kv_events.py", "vllm/v1/core/kv_cache_utils.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py", "vllm/v1/kv_offload/base.py",
    "sglang/srt/disaggregation/kv_events.py", "sglang/srt/mem_cache/events.py", "sglang/srt/mem_cache/utils.py",
    # the rest of the surface (engine_driver.py surface / validate)
    "vllm/v1/metrics/loggers.py", "vllm/v1/metrics/utils.py", "vllm/v1/metrics/buckets.py",
    "vllm/v1/metrics/prometheus.py", "vllm/v1/metrics/stats.py", "vllm/v1/metrics/cache_hit_source.py",
    "vllm/v1/engine/__init__.py", "vllm/config/cache.py", "vllm/entrypoints/serve/engine/protocol.py",
    "vllm/entrypoints/generate/base/protocol.py", "vllm/entrypoints/openai/responses/protocol.py",
    "vllm/utils/math_utils.py", "vllm/v1/kv_offload/config.py", "vllm/v1/kv_offload/cpu/common.py",
    "vllm/v1/kv_offload/cpu/spec.py", "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
    "sglang/srt/observability/metrics_collector.py", "sglang/srt/observability/utils.py",
    "sglang/srt/observability/scheduler_stage_metrics.py", "sglang/srt/utils/gauge_histogram.py",
)
SURFACE_RELEASES = ("vllm-0.33.0", "vllm-0.34.0", "sglang-0.5.23")
"""The releases whose /metrics (and, vLLM, error and Responses models) `surface` checks."""
SURFACE_DIR = REPO / "tests" / "data" / "engines"


def _pip_cache_dir() -> Path:
    env = os.environ.get("PIP_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pip"


def _wheel_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("PREFIXROUTE_ENGINE_WHEELS", "").split(os.pathsep) if p]
    dirs.append(DEFAULT_WHEEL_DIR)
    dirs += [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if p and "://" not in p]
    return dirs


def _is_release_zip(path: Path, release: Release) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(n == f"{release.dist}-{release.version}.dist-info/METADATA" for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def find_wheel(release: Release, *, search_pip_cache: bool = True) -> Path | None:
    """The release's wheel here (module docstring), or None."""
    prefix = f"{release.dist}-{release.version}-"
    for d in _wheel_dirs():
        if d.is_dir():
            for p in sorted(d.glob(f"{prefix}*.whl")):
                return p
    if search_pip_cache:
        cache = _pip_cache_dir()
        for sub in ("http-v2", "http"):
            root = cache / sub
            if not root.is_dir():
                continue
            for p in root.rglob("*"):
                # Wheels are the big cached bodies; a release's is > 1 MB (SGLang's ~40 MB, vLLM's ~350 MB).
                if p.is_file() and p.stat().st_size > 1_000_000 and _is_release_zip(p, release):
                    return p
    return None


def download_wheel(release: Release, dest: Path = DEFAULT_WHEEL_DIR) -> Path:
    """``pip download --no-deps`` the release into `dest` (what generate.py --download does)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
                    release.requirement], check=True)
    found = find_wheel(release, search_pip_cache=False)
    if found is None:
        raise FileNotFoundError(f"pip downloaded {release.requirement} but no wheel is in {dest}")
    return found


def extract(wheel: Path, dest: Path) -> Path:
    """Copy the `FILES` the wheel has into `dest` (same relative paths); returns `dest`."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for rel in FILES:
            if rel in names:
                out = dest / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(rel))
    return dest


def driver_argv(release: Release, src: Path, mode: str, *args: str, bytes_hashes: bool = False) -> list[str]:
    return [sys.executable, str(DRIVER), "--release", release.name, "--src", str(src),
            *(["--bytes-hashes"] if bytes_hashes else []), mode, *args]


def capture(release: Release, src: Path, *, bytes_hashes: bool = False, block_size: int = 16, page_size: int = 0,
            timeout_s: float = 60.0) -> dict:
    """Run the scenario through the release's own publisher, its blocks `block_size` tokens long (SGLang: its pages
    `page_size`, when smaller); its frames and the expected outcome."""
    out = subprocess.run(driver_argv(release, src, "capture", "--block-size", str(block_size),
                                     *(["--page-size", str(page_size)] if page_size else []),
                                     bytes_hashes=bytes_hashes), capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{release.name} driver failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def surface(release: Release, src: Path, timeout_s: float = 60.0) -> dict:
    """The release's own /metrics exposition (and vLLM's model schemas): engine_driver.py surface."""
    out = subprocess.run(driver_argv(release, src, "surface"), capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{release.name} surface failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


class EngineProcess:
    """The driver in ``serve`` or ``bridge`` mode (see engine_driver.py): the release's publisher, bound at
    `endpoint` (``tcp://*:P``: how vLLM binds) with its replay socket at `replay`. `start()` returns once it
    printed its ready line (its `info`: the expected outcome in serve mode); `send("publish")` commands it;
    `close()` ends it."""

    def __init__(self, release: Release, src: Path, mode: str, *args: str, bytes_hashes: bool = False,
                 log_path: Path | None = None) -> None:
        self.argv = driver_argv(release, src, mode, *args, bytes_hashes=bytes_hashes)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self, timeout_s: float = 30.0) -> EngineProcess:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True)
        self.info = self._line(timeout_s)
        return self

    def _line(self, timeout_s: float) -> dict:
        import selectors

        assert self.proc is not None and self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise TimeoutError(f"engine driver silent for {timeout_s} s: {self.argv}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine driver exited ({self.proc.wait()}): {self.argv}")
        return json.loads(line)

    def send(self, command: str, timeout_s: float = 30.0) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line(timeout_s)

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
