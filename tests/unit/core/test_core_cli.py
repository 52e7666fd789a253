"""Every registered command builds its parser (no flag clashes between the settings it combines), and its default
--help lists what its user needs first: at most 25 flags, the rest listed by --help-all."""

from __future__ import annotations

import argparse
import importlib

import pytest

from prefixroute import cli, config_reference, settings


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_works(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: prefixroute" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "model-server" in capsys.readouterr().out


def _help(command: str, flag: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([command, flag])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _listed_flags(help_text: str) -> list[str]:
    """The flags a help text lists, one per option line (`--x, --no-x` counts once), -h aside: what
    `prefixroute COMMAND --help | grep -c '^  --'` counts."""
    return [line.split()[0].rstrip(",") for line in help_text.splitlines() if line.startswith("  --")]


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser(command)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def _essentials(command: str) -> tuple[str, ...] | None:
    return getattr(importlib.import_module(cli.COMMANDS[command][0]), "HELP_ESSENTIALS", None)


def _accepted_flags(command: str) -> set[str]:
    return {opt for a in _subparser(command)._actions for opt in a.option_strings
            if opt.startswith("--") and opt != "--help"}


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_default_help_fits_a_person(command, capsys):
    assert len(_listed_flags(_help(command, "--help", capsys))) <= settings.MAX_DEFAULT_HELP_FLAGS


@pytest.mark.parametrize("command", sorted(c for c in cli.COMMANDS if _essentials(c) is not None))
def test_default_help_lists_the_essentials_and_help_all_every_flag(command, capsys):
    parser = _subparser(command)
    flag_of = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    text = _help(command, "--help", capsys)
    shown = _listed_flags(text)
    assert sorted(shown) == sorted(["--help-all"] + [flag_of[name] for name in _essentials(command)])
    every = _listed_flags(_help(command, "--help-all", capsys))
    assert set(every) | {f for f in _accepted_flags(command) if f.startswith("--no-")} == _accepted_flags(command)
    assert len(every) == len(set(every))
    hint = f"{len(every) - len(shown)} more settings: --help-all; all of them: docs/configuration.md"
    assert text.rstrip().splitlines()[-1] == hint


@pytest.mark.parametrize("command", sorted(c for c in cli.COMMANDS if _essentials(c) is not None))
def test_every_hidden_settings_flag_still_parses(command):
    """Every flag the default help leaves out still sets its value (one command line per flag)."""
    parser = cli.build_parser(command)
    hidden = {a.dest for a in _subparser(command)._actions if a.option_strings and a.help is argparse.SUPPRESS}
    checked = set()
    for heading, cls in config_reference.settings_classes():
        if command not in heading.removeprefix("prefixroute ").split(", "):
            continue
        for f, tp in settings.fields(cls):
            if f.name not in hidden:
                continue
            flag, (base, _optional) = settings.flag_name(f), settings._base_type(tp)
            if base is bool:
                argv, expected = [flag if not f.default else "--no-" + flag[2:]], not f.default
            else:
                raw = str((f.default or 0) + 1) if base is int else str((f.default or 0.0) + 0.5) \
                    if base is float else "a,b"
                argv, expected = [flag, raw], settings.parse_value(tp, raw)
            assert getattr(parser.parse_args([command, *argv]), f.name) == expected, argv
            checked.add(f.name)
    assert checked == hidden


def test_a_hidden_flag_reaches_its_settings():
    from prefixroute.extproc.endpoints.settings import PoolSettings

    ns = cli.build_parser("extproc").parse_args(["extproc", "--probe-interval-s", "2.5"])
    assert "--probe-interval-s" not in _subparser("extproc").format_help()
    assert settings.from_namespace(PoolSettings, ns, environ={}).probe_interval_s == 2.5
