"""The workloads' text depends on nothing in the process: a fresh interpreter (another hash seed) makes the same."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prefixroute.bench.synthetic_text import block_text

pytestmark = pytest.mark.integration


def test_block_text_is_identical_in_another_process():
    # No dependency on hash randomisation or process state: a fresh interpreter yields the same text.
    code = "from prefixroute.bench.synthetic_text import block_text; print(block_text(7, 'h', 42, 100), end='')"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out == block_text(7, "h", 42, 100)
