"""Tests and benchmarks draw their ports: `prefixroute up` and `gateway` listen on fixed defaults (8080, 9002,
9464, 9901, 4222, ...), which a test run must never take (several test runs, or a user's stack, share a host).
Every GatewaySettings an integration test, a test helper or a benchmark builds says `ports=...` (normally
"random"), and every `up` / `gateway` command line it runs passes `--ports`. (Unit tests start nothing: they may
build default settings to check them.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _sources() -> list[Path]:
    return [p for d in ("tests/integration", "tests/helpers", "tests/browser", "bench")
            for p in sorted((ROOT / d).rglob("*.py"))]


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_every_gateway_a_test_starts_chooses_its_ports() -> None:
    missing = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name == "GatewaySettings" and not any(k.arg in ("ports", None) for k in node.keywords):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} GatewaySettings(...) without ports=")
            command_line = isinstance(node, ast.List) or (isinstance(node, ast.Call) and getattr(
                node.func, "id", "") in ("prefixroute_cmd", "prefixroute_argv"))
            if command_line:
                words = _strings(ast.List(elts=list(node.args), ctx=ast.Load())) if isinstance(node, ast.Call) \
                    else _strings(node)
                if {"up", "gateway"} & set(words[:4]) and "--port" in words and "--ports" not in words:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} a command line without --ports")
    assert not missing, "\n".join(missing)
