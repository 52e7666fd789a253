"""scripts/profile_router_path.py runs the ext_proc's own objects the way Envoy drives them: it measures, and
every facts record it feeds finds its pick (the script refuses to print figures otherwise), so a change to the
objects it builds cannot leave it measuring less than the router's path without this test failing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def test_the_router_path_script_measures_every_request_with_its_facts() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_router_path.py"), "--prompt-kb", "4,64",
                          "--num-requests", "60", "--num-rounds", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = re.findall(r"^\s*(\d+) KB: CPU per request best ([\d.]+) us, median ([\d.]+) us$", out.stdout, re.M)
    assert [kb for kb, *_ in figures] == ["4", "64"], out.stdout
    assert all(0 < float(best) <= float(median) for _, best, median in figures)
