"""deploy/kubernetes as the tests read it: every document, and lookups of one object, container, flag or port."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


FILES = sorted(DEPLOY.glob("*.yaml"))
DOCS = [(f.name, i, d) for f in FILES for i, d in enumerate(load(f))]
"""(file name, index in the file, document) for every document of every manifest."""


def one(kind: str, name: str) -> dict:
    found = [d for _, _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} documents"
    return found[0]


def workload(name: str) -> dict:
    """The Deployment or StatefulSet called `name` (exactly one)."""
    found = [d for _, _, d in DOCS if d["kind"] in WORKLOAD_KINDS and d["metadata"]["name"] == name]
    assert len(found) == 1, f"workload {name}: {len(found)} documents"
    return found[0]


def container(workload_name: str, name: str, init: bool = False) -> dict:
    pod = workload(workload_name)["spec"]["template"]["spec"]
    return next(c for c in pod["initContainers" if init else "containers"] if c["name"] == name)


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def port(service: dict, name: str) -> int:
    return next(p["port"] for p in service["spec"]["ports"] if p["name"] == name)


def num_replicas() -> int:
    return one("StatefulSet", "prefixroute-extproc")["spec"]["replicas"]


def replica_addresses() -> list[str]:
    return one("ConfigMap", "prefixroute-gateway")["data"]["PREFIXROUTE_ENVOY_EXTPROC_REPLICA_ADDRESSES"].split(",")


def nats_conf() -> dict[str, str]:
    """The top-level `key: value` lines of the NATS ConfigMap's nats.conf (blocks' bodies not parsed)."""
    text = one("ConfigMap", "prefixroute-nats")["data"]["nats.conf"]
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip() and not line.startswith(" ") and "{" not in value:
            out[key.strip()] = value.strip().strip('"')
    return out
