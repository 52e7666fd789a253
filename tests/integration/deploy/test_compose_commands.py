"""Each compose service's own command, run directly (no Docker engine here), passes its own healthcheck.

Ports are remapped to free ones; host names of other containers cannot resolve here, so the services
that only talk to their peers (extproc, envoy, traffic) are covered by the config and `prefixroute up`
tests instead."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[3]
SERVICES = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
PORTS = {"model-server-0": [8000], "telemetry": [4317, 4320], "dashboard": [8501]}


def _remap(items: list[str], mapping: dict[int, int]) -> list[str]:
    out = []
    for item in items:
        for old, new in mapping.items():
            item = item.replace(str(old), str(new))
        out.append(item)
    return out


@pytest.mark.parametrize("name", sorted(PORTS))
def test_service_command_passes_its_healthcheck(name, tmp_path):
    svc = SERVICES[name]
    mapping = dict(zip(PORTS[name], free_ports(len(PORTS[name]))))
    argv = _remap(list(svc["command"]), mapping)
    argv = [a.replace("/data/telemetry.db", str(tmp_path / "t.db")) for a in argv]
    argv = [a.replace("http://telemetry:", "http://127.0.0.1:") for a in argv]
    check = _remap(list(svc["healthcheck"]["test"]), mapping)
    assert check[0] == "CMD" and check[1] == "python"
    log = open(tmp_path / "log.txt", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefixroute", *argv], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            rc = subprocess.run([sys.executable, *check[2:]], capture_output=True, timeout=30).returncode
            if rc == 0:
                break
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()
            assert time.monotonic() < deadline, "healthcheck never passed:\n" + (tmp_path / "log.txt").read_text()
            time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
