"""scripts/hop_ttft.py measures each hop of a streamed request: it starts a server, a bare Envoy and the gateway,
sends every request through each (the script fails on any failed request) and prints one line per round."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
def test_the_hop_script_measures_each_target_in_every_round(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "hop_ttft.py"), "--prompt-kb", "4",
                          "--num-requests", "8", "--num-rounds", "2", "--log-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    rounds = re.findall(r"round (\d): direct ([\d.]+), bare-envoy ([\d.]+), gateway ([\d.]+); Envoy's hop "
                        r"([+-][\d.]+), the router's ([+-][\d.]+)$", out.stdout, re.M)
    assert [r[0] for r in rounds] == ["0", "1"], out.stdout
    for _, direct, bare, gateway, envoy_hop, router_hop in rounds:
        assert all(float(x) > 0 for x in (direct, bare, gateway))
        assert float(envoy_hop) == pytest.approx(float(bare) - float(direct), abs=0.011)
        assert float(router_hop) == pytest.approx(float(gateway) - float(bare), abs=0.011)
    # The gateway really routed them: its router's log says it started in front of the server.
    assert any("ready on" in p.read_text() for p in tmp_path.rglob("extproc.log")), list(tmp_path.rglob("*.log"))


@pytest.mark.timeout(150)
def test_a_second_gateway_is_measured_in_the_same_rounds(tmp_path: Path) -> None:
    """--compare-gateway-args: the gateway routed by the HTTP check beside the default, its hop on the same line."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "hop_ttft.py"), "--prompt-kb", "4",
                          "--num-requests", "6", "--num-rounds", "1", "--log-dir", str(tmp_path),
                          "--compare-gateway-args=--routing-filter=ext_authz_http"],
                         capture_output=True, text=True, timeout=140)
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = re.findall(r"round 0: .*, gateway --routing-filter=ext_authz_http ([\d.]+); .*the router's "
                         r"([+-][\d.]+), the router's with --routing-filter=ext_authz_http ([+-][\d.]+)$",
                         out.stdout, re.M)
    bare = float(re.search(r"bare-envoy ([\d.]+)", out.stdout).group(1))  # type: ignore[union-attr]
    assert float(line[2]) == pytest.approx(float(line[0]) - bare, abs=0.011)
    # Two gateways started, each with its own router.
    assert sum("ready on" in p.read_text() for p in tmp_path.rglob("extproc.log")) == 2, list(tmp_path.rglob("*.log"))
