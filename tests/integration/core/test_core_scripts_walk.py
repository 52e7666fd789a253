"""scripts/walk_modules.py traces the real router (as `prefixroute extproc` builds it, in front of a simulated
server): one streamed chat through the ext_proc routing stream enters the router's core, not only the servicer, so
the instrument cannot silently measure nothing; and the command prints its table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "walk_modules.py"
CORE = ("prefixroute.extproc.servicer", "prefixroute.extproc.service", "prefixroute.extproc.routing.request",
        "prefixroute.extproc.routing.hashing", "prefixroute.extproc.routing.router",
        "prefixroute.extproc.routing.prefix_index", "prefixroute.extproc.lifecycle", "prefixroute.extproc.tracking",
        "prefixroute.extproc.endpoints.pool")
"""What one routed request must pass through: the transport, parse, hash, decide, the prefix index, the pick's
record and release."""


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("walk_modules", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_the_walk_of_an_ext_proc_stream_enters_the_router_core() -> None:
    wm = _load_script()
    result = await wm.walk(("ext_proc", "facts"))
    walk = result["walks"]["ext_proc"]
    assert result["ready_line"].startswith("prefixroute extproc ready on ")
    assert set(CORE) <= set(walk.modules), walk.modules
    assert walk.entries[0].module == "prefixroute.extproc.servicer" and walk.entries[0].caller is None
    assert walk.num_modules >= len(CORE) and walk.num_entries > walk.num_modules
    assert walk.num_reentries == walk.num_entries - walk.num_modules > 0
    assert walk.num_windows == 1 and walk.num_calls >= walk.num_entries
    # On the facts path the stream ends before its facts record, which releases the pick: the pool's release is in
    # the facts' walk, after the stream's acquire.
    assert [e.function for e in walk.entries if e.module == "prefixroute.extproc.endpoints.pool"][-1] == "acquire"
    facts = result["walks"]["facts"]
    assert [e.function for e in facts.entries if e.module == "prefixroute.extproc.endpoints.pool"][-1] == "release"


def test_the_command_prints_json_per_transport() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--transport", "ext_proc", "--transport", "facts", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    walks = json.loads(out.stdout)["walks"]
    assert list(walks) == ["ext_proc", "facts", "default path"]
    for name, w in walks.items():
        assert w["num_modules"] > 0 and w["num_entries"] == len(w["sequence"]), name
    assert "extproc.servicer" in walks["ext_proc"]["modules"]
    assert "extproc.envoy_facts" in walks["facts"]["modules"]
    both = walks["default path"]
    assert both["num_entries"] == walks["ext_proc"]["num_entries"] + walks["facts"]["num_entries"]
