"""`./scripts/test --help` prints the script's own help at once, installing nothing (it used to reinstall for half a
minute, then print pytest's generic help)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_scripts_test_help_installs_nothing(tmp_path, flag):
    venv = tmp_path / "venv"  # what it would create and install into
    t0 = time.monotonic()
    done = subprocess.run([str(REPO / "scripts" / "test"), flag], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "PREFIXROUTE_VENV": str(venv)})
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 5
    assert not venv.exists()
    assert done.stdout.startswith("Test it: installs prefixroute") and "./scripts/test tests/unit" in done.stdout
    assert "pytest" in done.stdout and "usage:" not in done.stdout  # its own help, not pytest's
