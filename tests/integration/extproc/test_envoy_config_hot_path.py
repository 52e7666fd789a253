"""The ext_proc service process never loads envoy-data-plane (slow to import, costly in memory): only the
gateway launcher and `prefixroute envoy-config` render the typed Envoy configuration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

HOT_PATH_MODULES = ("prefixroute.extproc.cli", "prefixroute.extproc.server", "prefixroute.extproc.servicer",
                    "prefixroute.extproc.service", "prefixroute.extproc.tracking", "prefixroute.extproc.headers")

# Imports the modules, and configures `prefixroute extproc` as the console script does (that imports the
# command's module and adds its flags), then lists any envoy_data_plane module that got loaded.
_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from prefixroute.cli import build_parser
build_parser("extproc")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "envoy_data_plane")))
"""


def _loaded(*modules: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_ext_proc_service_modules_do_not_load_envoy_data_plane() -> None:
    assert _loaded(*HOT_PATH_MODULES) == []


@pytest.mark.parametrize("module", ["prefixroute.extproc.envoy_config", "prefixroute.extproc.gateway"])
def test_the_probe_sees_envoy_data_plane_where_it_is_used(module: str) -> None:
    # The control: the same probe run on the modules that do render the configuration finds it.
    assert "envoy_data_plane.envoy.config.bootstrap.v3" in _loaded(module)
