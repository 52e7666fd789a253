"""Block hashes depend on nothing in the process: fresh interpreters with other hash seeds give the same."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixroute.extproc.routing.hashing import hash_blocks, seed_for

pytestmark = pytest.mark.integration


def test_deterministic_across_processes():
    code = ("from prefixroute.extproc.routing.hashing import hash_blocks, seed_for;"
            "print(hash_blocks('x' * 200 + 'é' * 70, seed_for('llama', 'acme'), 64, 256))")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": str(i)}).stdout for i in (1, 2)}
    assert out == {str(hash_blocks("x" * 200 + "é" * 70, seed_for("llama", "acme"), 64, 256)) + "\n"}
