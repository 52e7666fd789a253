"""The configuration reference (docs/configuration.md) is generated from the settings classes and must not drift."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from prefixroute import config_reference, settings

ROOT = Path(__file__).resolve().parents[3]


def test_the_configuration_reference_page_is_current():
    text = (ROOT / config_reference.DOC).read_text()
    start = text.index(config_reference.START) + len(config_reference.START)
    end = text.index(config_reference.END)
    assert text[start:end].strip() == config_reference.render().strip(), (
        f"{config_reference.DOC} is stale: run `python -m prefixroute.config_reference --write {config_reference.DOC}`")


def test_the_readme_holds_no_copy_of_the_reference():
    # One generated copy only: a second one in the README would drift from the page the test keeps current.
    assert config_reference.START not in (ROOT / "README.md").read_text()


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


def test_each_command_finds_each_of_its_flags_once_under_headings_naming_it():
    # A heading names exactly the commands whose parser takes those flags, so under the headings that include a
    # command each of its settings flags appears once, and every one it has appears.
    from prefixroute import cli

    sections = config_reference.settings_classes()
    groups = config_reference.command_groups()
    for command in cli.COMMANDS:
        listed = [settings.flag_name(f) for heading, cls in sections
                  if command in heading.removeprefix("prefixroute ").split(", ") for f, _tp in settings.fields(cls)]
        assert len(listed) == len(set(listed)), (command, sorted(f for f in listed if listed.count(f) > 1))
        parser = cli.build_parser(command)
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[command]
        titles = {cls.TITLE for _h, cls in sections}
        taken = {opt for g in sub._action_groups if g.title in titles for a in g._group_actions
                 for opt in a.option_strings if not opt.startswith("--no-")}
        assert set(listed) == taken, (command, set(listed) ^ taken)
        assert not set(groups[command]) - titles - {"positional arguments", "options"}, (command, groups[command])
