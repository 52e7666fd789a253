"""Each compose service's own command, run directly (no Docker engine here), passes its own healthcheck.

The secrets service's own line draws the tokens first (into a temp dir standing for its volume). Ports are
remapped to free ones; host names of other containers cannot resolve here, so the services
that only talk to their peers (extproc, envoy, traffic) are covered by the config and `prefixroute up`
tests instead."""

from __future__ import annotations

import re
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import free_ports
from helpers.procs import stop_group
from helpers.waiting import until

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


def _shell_line(svc: dict, tmp_path: Path) -> str:
    """The service's command as one shell line runnable here: compose's `$$` unescaped, the volumes moved
    under tmp_path, peers' names resolved to loopback, `prefixroute`/`python` as this interpreter."""
    line = svc["command"][0] if svc.get("entrypoint") == ["sh", "-c"] else shlex.join(["prefixroute", *svc["command"]])
    line = line.replace("$$", "$").replace("/secrets/", f"{tmp_path}/secrets/")
    line = line.replace("/data/telemetry.db", str(tmp_path / "t.db")).replace("http://telemetry:", "http://127.0.0.1:")
    line = re.sub(r"(^|exec |&& )prefixroute ", rf"\g<1>{sys.executable} -m prefixroute ", line)
    return re.sub(r"(^|\|\| )python ", rf"\g<1>{sys.executable} ", line)


def _draw_secrets(tmp_path: Path) -> None:
    """Run the secrets service's own line: both tokens drawn, private to their owner, kept on a rerun."""
    (tmp_path / "secrets").mkdir()
    line = _shell_line(SERVICES["secrets"], tmp_path)
    subprocess.run(["sh", "-c", line], check=True, timeout=60)
    tokens = {f.name: f.read_text() for f in (tmp_path / "secrets").iterdir()}
    assert set(tokens) == {"extproc.token", "telemetry.token"} and len(set(tokens.values())) == 2
    assert all(len(t.strip()) >= 32 for t in tokens.values())
    for f in (tmp_path / "secrets").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    subprocess.run(["sh", "-c", line], check=True, timeout=60)
    assert {f.name: f.read_text() for f in (tmp_path / "secrets").iterdir()} == tokens


@pytest.mark.parametrize("name", sorted(PORTS))
def test_service_command_passes_its_healthcheck(name, tmp_path):
    svc = SERVICES[name]
    mapping = dict(zip(PORTS[name], free_ports(len(PORTS[name]))))
    _draw_secrets(tmp_path)
    line = _remap([_shell_line(svc, tmp_path)], mapping)[0]
    check = _remap(list(svc["healthcheck"]["test"]), mapping)
    assert check[0] == "CMD" and check[1] == "python"
    log = open(tmp_path / "log.txt", "wb")
    proc = subprocess.Popen(["sh", "-c", line], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()  # the service died: stop waiting
            return subprocess.run([sys.executable, *check[2:]], capture_output=True, timeout=30).returncode == 0

        until(healthy, 90, interval_s=0.5, message=lambda: "the healthcheck\n" + (tmp_path / "log.txt").read_text())
    finally:
        stop_group(proc, grace_s=15)  # the whole session: the shell and the service it started
        log.close()
