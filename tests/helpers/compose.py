"""docker-compose.yml as the tests read it: its services, and the `prefixroute` arguments each one runs."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def prefixroute_argv(service: dict) -> list[str]:
    """The prefixroute arguments a service runs (entrypoint `prefixroute`, or a `sh -c` line whose first
    `prefixroute` or `exec prefixroute` segment is the command)."""
    command = service["command"]
    if service.get("entrypoint") == ["sh", "-c"]:
        for part in command[0].replace("$$", "$").split("&&"):
            argv = shlex.split(part)
            if argv and argv[0] == "exec":
                argv = argv[1:]
            if argv and argv[0] == "prefixroute":
                return argv[1:]
        raise AssertionError(f"no prefixroute command in {command[0]!r}")
    return list(command)
