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
