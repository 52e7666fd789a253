"""The README's configuration reference is generated from the settings classes and must not drift."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from prefixroute import config_reference, settings

ROOT = Path(__file__).resolve().parents[3]


def test_readme_reference_is_current():
    text = (ROOT / "README.md").read_text()
    start = text.index(config_reference.START) + len(config_reference.START)
    end = text.index(config_reference.END)
    assert text[start:end].strip() == config_reference.render().strip(), (
        "README.md configuration reference is stale: run `python -m prefixroute.config_reference --write README.md`")


def test_env_vars_do_not_collide_between_settings():
    owners: dict[str, set[str]] = defaultdict(set)
    for _command, cls in config_reference.settings_classes():
        for f, _tp in settings.fields(cls):
            owners[settings.env_name(cls, f)].add(cls.__name__)
    clashes = {env: names for env, names in owners.items() if len(names) > 1}
    assert clashes == {}


def test_every_setting_has_help():
    for _command, cls in config_reference.settings_classes():
        for f, _tp in settings.fields(cls):
            assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name} has no real help text"
