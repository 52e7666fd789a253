"""The settings framework: one declaration -> flags, env vars, defaults and docs."""

from __future__ import annotations

import argparse
import dataclasses
from typing import ClassVar

import pytest

from prefixroute import settings
from prefixroute.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class DemoSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "DEMO_"
    TITLE: ClassVar[str] = "Demo"
    port: int = setting(8000, "Port.")
    ratio: float = setting(0.5, "A ratio.")
    name: str = setting("x", "A name.")
    enabled: bool = setting(False, "A switch.")
    limit: int | None = setting(None, "Optional limit.")
    endpoints: tuple[str, ...] = setting((), "Endpoints.")


def _parse(argv: list[str], env: dict[str, str]) -> DemoSettings:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, DemoSettings)
    return settings.from_namespace(DemoSettings, parser.parse_args(argv), environ=env)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, {"port": 8000, "ratio": 0.5, "enabled": False, "limit": None, "endpoints": ()}),
        (["--port", "9"], {"DEMO_PORT": "7"}, {"port": 9}),  # flag beats env
        ([], {"DEMO_PORT": "7"}, {"port": 7}),  # env beats default
        (["--enabled"], {}, {"enabled": True}),
        ([], {"DEMO_ENABLED": "yes"}, {"enabled": True}),
        (["--no-enabled"], {"DEMO_ENABLED": "1"}, {"enabled": False}),
        (["--limit", "5"], {}, {"limit": 5}),
        ([], {"DEMO_LIMIT": "none"}, {"limit": None}),
        (["--endpoints", "a:1, b:2,"], {}, {"endpoints": ("a:1", "b:2")}),
        ([], {"DEMO_RATIO": "0.25"}, {"ratio": 0.25}),
    ],
)
def test_precedence_and_types(argv, env, expected):
    got = _parse(argv, env)
    for key, value in expected.items():
        assert getattr(got, key) == value


@pytest.mark.parametrize(("env", "var"), [({"DEMO_PORT": "eighty"}, "DEMO_PORT"), ({"DEMO_ENABLED": "maybe"}, "DEMO_ENABLED")])
def test_bad_env_value_names_the_variable(env, var):
    with pytest.raises(ValueError, match=var):
        _parse([], env)


def test_bad_flag_value_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        _parse(["--port", "x"], {})
    assert "--port" in capsys.readouterr().err


def test_markdown_lists_every_field_with_env_and_default():
    md = settings.render_markdown([("demo", DemoSettings)])
    for f in dataclasses.fields(DemoSettings):
        assert f"`--{f.name.replace('_', '-')}`" in md
        assert f"`DEMO_{f.name.upper()}`" in md
    assert "| `--port` | `DEMO_PORT` | `8000` | Port. |" in md


def _demo_parser(essential: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo")
    settings.add_arguments(parser, DemoSettings)
    settings.essential_help(parser, essential)
    return parser


def _listed_flags(help_text: str) -> list[str]:
    """The flags a help text lists, one per option line (`--x, --no-x` counts once), -h aside."""
    return [line.split()[0].rstrip(",") for line in help_text.splitlines() if line.startswith("  --")]


def test_essential_help_lists_the_essentials_and_says_how_many_more():
    text = _demo_parser(("port", "enabled")).format_help()
    assert _listed_flags(text) == ["--help-all", "--port", "--enabled"]
    assert "--ratio" not in text and "DEMO_RATIO" not in text  # hidden: neither in the options nor in usage
    assert text.rstrip().splitlines()[-1] == "4 more settings: --help-all; all of them: docs/configuration.md"


def test_help_all_lists_every_flag_and_the_default_help_stays_short(capsys):
    parser = _demo_parser(("port",))
    every = ["--help-all"] + [settings.flag_name(f) for f, _tp in settings.fields(DemoSettings)]
    assert _listed_flags(settings.format_help_all(parser)) == every
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--help-all"])
    assert exc.value.code == 0
    out = capsys.readouterr().out  # on stdout, as --help
    assert _listed_flags(out) == every and "[env DEMO_LIMIT; default (unset)]" in out
    assert "more settings" not in out
    assert _listed_flags(parser.format_help()) == ["--help-all", "--port"]  # hidden again afterwards


def test_hidden_flags_still_parse_and_their_env_vars_still_apply():
    parser = _demo_parser(("port",))
    ns = parser.parse_args(["--ratio", "0.25", "--enabled", "--limit", "3", "--endpoints", "a,b"])
    s = settings.from_namespace(DemoSettings, ns, environ={"DEMO_NAME": "y"})
    assert (s.ratio, s.enabled, s.limit, s.endpoints, s.name, s.port) == (0.25, True, 3, ("a", "b"), "y", 8000)


def test_essential_help_refuses_unknown_names_and_too_many():
    with pytest.raises(ValueError, match="no argument nme"):
        _demo_parser(("port", "nme"))
    parser = argparse.ArgumentParser(prog="many")
    for i in range(settings.MAX_DEFAULT_HELP_FLAGS + 5):
        parser.add_argument(f"--flag-{i}", help="A flag.")
    fits = tuple(f"flag_{i}" for i in range(settings.MAX_DEFAULT_HELP_FLAGS - 1))  # --help-all is the last one
    settings.essential_help(parser, fits)
    assert len(_listed_flags(parser.format_help())) == settings.MAX_DEFAULT_HELP_FLAGS
    parser = argparse.ArgumentParser(prog="many")
    for i in range(settings.MAX_DEFAULT_HELP_FLAGS + 5):
        parser.add_argument(f"--flag-{i}", help="A flag.")
    with pytest.raises(ValueError, match="over 25"):
        settings.essential_help(parser, fits + ("flag_26",))
