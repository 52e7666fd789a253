"""scripts/up installs only when the project changed (or on --reinstall) and says which. The script runs for real
(bash) on a copy of the checkout's build inputs; the venv is a stand-in whose python answers the script's three
questions (installed version, where `import prefixroute` reads from, the interpreter) and records `pip install`
instead of running it (a real install takes a minute), and whose `prefixroute` records how it was called."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]

FAKE_PYTHON = f"""#!{sys.executable}
import os, sys
from pathlib import Path
venv = Path(__file__).resolve().parent.parent
checkout = Path(os.environ["FAKE_CHECKOUT"])
marker = venv / "installed"  # "version origin", written by the stand-in pip
args = sys.argv[1:]
if args[:2] == ["-m", "pip"]:
    with open(venv / "pip.log", "a") as log:
        log.write(" ".join(args) + "\\n")
    if "-e" in args:
        version = [l for l in (checkout / "pyproject.toml").read_text().splitlines() if l.startswith("version")]
        marker.write_text(version[0].split('"')[1] + " " + str(checkout / "common" / "__init__.py"))
        (checkout / "extproc" / "wire.binpb").write_bytes(b"built")
    sys.exit(0)
code = args[1]
if "m.version" in code or "find_spec" in code:
    if not marker.exists():
        sys.exit(1)
    version, origin = marker.read_text().split()
    print(version if "m.version" in code else origin)
else:
    exec(code)
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    co = tmp_path / "checkout"
    for rel in ("scripts/up", "pyproject.toml", "setup.py", "MANIFEST.in", *(
            str(p.relative_to(ROOT)) for p in (ROOT / "extproc" / "proto").glob("*.proto"))):
        (co / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, co / rel)
    bin_dir = co / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "prefixroute").write_text(f"#!/bin/sh\necho \"$@\" > {co}/.venv/prefixroute.args\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return co


def up(co: Path, *args: str) -> tuple[str, list[str], str]:
    """(what scripts/up said on stderr, the pip commands it ran, the arguments prefixroute got)."""
    pip_log = co / ".venv" / "pip.log"
    pip_log.unlink(missing_ok=True)
    done = subprocess.run(["bash", str(co / "scripts" / "up"), *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "FAKE_CHECKOUT": str(co), "HOME": str(co)})
    assert done.returncode == 0, done.stderr
    pips = pip_log.read_text().splitlines() if pip_log.exists() else []
    return done.stderr, pips, (co / ".venv" / "prefixroute.args").read_text().strip()


def test_installs_once_then_starts_without_installing(checkout: Path) -> None:
    said, pips, ran = up(checkout)
    assert "installing prefixroute into .venv (prefixroute is not installed in .venv)" in said
    assert pips == ["-m pip install -q --upgrade pip", "-m pip install -q -e .[dashboard,bench]"]
    assert ran == "up --traffic shared-prompts"
    said, pips, ran = up(checkout, "--policy", "random")
    assert "is up to date" in said and "not reinstalling; ./scripts/up --reinstall forces it" in said
    assert pips == [] and ran == "up --traffic shared-prompts --policy random"


@pytest.mark.parametrize(("change", "reason"), [
    (lambda co: (co / "setup.py").write_text((co / "setup.py").read_text() + "\n# changed\n"),
     "changed since the last install"),
    (lambda co: next((co / "extproc" / "proto").glob("*.proto")).write_text("syntax = 'proto3';\n"),
     "changed since the last install"),
    (lambda co: (co / "extproc" / "wire.binpb").unlink(), "extproc/wire.binpb is missing"),
    (lambda co: (co / ".venv" / "installed").write_text(f"0.0.1 {co}/common/__init__.py"),
     "has prefixroute 0.0.1, the checkout is"),
    # A plain (non-editable) install of the same version: it would run a copy, not the checkout.
    (lambda co: (co / ".venv" / "installed").write_text(
        (co / ".venv" / "installed").read_text().split()[0] + " /elsewhere/site-packages/prefixroute/__init__.py"),
     "not from this checkout"),
])
def test_installs_again_when_what_it_is_built_from_changed(checkout: Path, change, reason: str) -> None:  # noqa: ANN001
    up(checkout)
    change(checkout)
    said, pips, _ = up(checkout)
    assert reason in said, said
    assert len(pips) == 2
    assert "is up to date" in up(checkout)[0]  # and only once


def test_reinstall_flag_forces_it_and_is_not_passed_on(checkout: Path) -> None:
    up(checkout)
    said, pips, ran = up(checkout, "--reinstall", "--servers", "2")
    assert "(--reinstall)" in said and len(pips) == 2
    assert ran == "up --traffic shared-prompts --servers 2"
