"""The compose envoy service's own `prefixroute envoy-config` line, run here, renders a configuration real Envoy
accepts, with its admin on loopback inside the container."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.compose import SERVICES, prefixroute_argv

pytestmark = pytest.mark.integration


def _render_envoy_service_config(tmp_path: Path) -> Path:
    """The envoy service's own envoy-config line, run here (its token file and output moved to tmp_path)."""
    argv = prefixroute_argv(SERVICES["envoy"])
    out = tmp_path / "envoy.yaml"
    token = tmp_path / "extproc.token"
    token.write_text("compose-test-token\n")
    argv[argv.index("--out") + 1] = str(out)
    argv[argv.index("--extproc-auth-token-file") + 1] = str(token)
    subprocess.run([sys.executable, "-m", "prefixroute", *argv], check=True, timeout=60)
    return out


def test_envoy_admin_stays_on_loopback_inside_its_container(tmp_path):
    out = _render_envoy_service_config(tmp_path)
    admin = yaml.safe_load(out.read_text())["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1" and admin["port_value"] == 9901


def test_envoy_service_config_is_accepted_by_envoy(tmp_path):
    """Render the envoy service's configuration with its own flags and let real Envoy validate it."""
    out = _render_envoy_service_config(tmp_path)
    assert "compose-test-token" in out.read_text()  # Envoy presents it to the ext_proc service
    from prefixroute.extproc.gateway import envoy_binary

    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
