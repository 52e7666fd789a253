"""The configuration reference: every setting of every command, rendered from the code.

`python -m prefixroute.config_reference` prints the Markdown that docs/configuration.md (`DOC`) holds between
the ``<!-- config-reference:start -->`` and ``<!-- config-reference:end -->`` markers;
``--write docs/configuration.md`` replaces that block in place. A unit test fails when that page is stale.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from prefixroute.settings import MAX_DEFAULT_HELP_FLAGS, REFERENCE_DOC, Settings, render_markdown

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
DOC = REFERENCE_DOC
"""Where the reference lives, relative to the repository root (the README and docs/ link it)."""

# (module, settings class), in the order a user meets them. The commands in each heading are found from the
# real command-line parsers (`commands_taking`), so a heading names exactly the commands that take those flags.
SECTIONS: list[tuple[str, str]] = [
    ("prefixroute.stack.cli", "StackSettings"),
    ("prefixroute.extproc.gateway", "GatewaySettings"),
    ("prefixroute.extproc.server", "ExtprocSettings"),
    ("prefixroute.extproc.routing.settings", "RoutingSettings"),
    ("prefixroute.extproc.flow.settings", "FlowSettings"),
    ("prefixroute.extproc.tenants", "TenantSettings"),
    ("prefixroute.extproc.endpoints.settings", "PoolSettings"),
    ("prefixroute.telemetry.router", "RouterTelemetrySettings"),
    ("prefixroute.extproc.peers.settings", "PeerSettings"),
    ("prefixroute.extproc.envoy_config", "EnvoySettings"),
    ("prefixroute.model_servers.server", "ServerSettings"),
    ("prefixroute.telemetry.cli", "ReceiverSettings"),
    ("prefixroute.dashboard.cli", "DashboardSettings"),
    ("prefixroute.dashboard.screenshot", "ScreenshotSettings"),
    ("prefixroute.stack.traffic", "TrafficSettings"),
    ("prefixroute.bench.settings", "BenchSettings"),
    ("prefixroute.bench.overhead", "OverheadBenchSettings"),
]


def _command_parser(command: str) -> argparse.ArgumentParser:
    from prefixroute import cli

    parser = cli.build_parser(command)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def default_help_flags() -> dict[str, tuple[list[str], int]]:
    """Command -> (the flags its default --help lists, how many more --help-all adds), for every command whose
    default help leaves some out (`settings.essential_help`)."""
    from prefixroute import cli

    out: dict[str, tuple[list[str], int]] = {}
    for command in cli.COMMANDS:
        options = [a for a in _command_parser(command)._actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)]
        hidden = [a for a in options if a.help is argparse.SUPPRESS]
        if hidden:
            out[command] = ([a.option_strings[0] for a in options if a.help is not argparse.SUPPRESS
                             and a.option_strings[0] != "--help-all"], len(hidden))
    return out


def render_default_help() -> str:
    """The table of what each command's default --help lists."""
    lines = ["### What `--help` lists\n",
             f"A command's `--help` lists at most {MAX_DEFAULT_HELP_FLAGS} flags: for the commands below, the ones "
             "its users need first; `--help-all` lists every one, grouped as in the tables that follow (every "
             "other command's `--help` lists all of its flags).\n",
             "| command | `--help` lists | `--help-all` adds |", "| --- | --- | --- |"]
    for command, (flags, num_hidden) in default_help_flags().items():
        lines.append(f"| `prefixroute {command}` | {', '.join(f'`{f}`' for f in flags)} | {num_hidden} more |")
    return "\n".join(lines) + "\n\n"


def command_groups() -> dict[str, list[str]]:
    """Command -> titles of the settings groups its parser has (`settings.add_arguments` adds one group per
    settings class, titled with its TITLE), for every `prefixroute` command."""
    from prefixroute import cli

    out: dict[str, list[str]] = {}
    for command in cli.COMMANDS:
        out[command] = [g.title for g in _command_parser(command)._action_groups if g.title]
    return out


def commands_taking(cls: type[Settings], groups: dict[str, list[str]] | None = None) -> list[str]:
    """The commands whose parser takes `cls`'s flags, in the order `prefixroute --help` lists them."""
    groups = command_groups() if groups is None else groups
    return [c for c, titles in groups.items() if cls.TITLE in titles]


def settings_classes() -> list[tuple[str, type[Settings]]]:
    """(heading, class) per section: the heading names every command that takes the class's flags
    ("prefixroute gateway, up"); a class no command takes is an error (its section would describe nothing)."""
    groups = command_groups()
    out = []
    for module, name in SECTIONS:
        cls = getattr(importlib.import_module(module), name)
        commands = commands_taking(cls, groups)
        if not commands:
            raise LookupError(f"no prefixroute command takes {module}.{name}'s flags (group {cls.TITLE!r})")
        out.append(("prefixroute " + ", ".join(commands), cls))
    return out


def render() -> str:
    intro = ("Every flag has an environment variable; precedence is flag > environment > default. "
             "Generated by `python -m prefixroute.config_reference` from the settings classes.\n\n")
    return intro + render_default_help() + render_markdown(settings_classes())


def replace_block(text: str, block: str) -> str:
    start, end = text.index(START), text.index(END)
    return text[: start + len(START)] + "\n" + block.rstrip() + "\n" + text[end:]


def main(argv: list[str]) -> int:
    block = render()
    if len(argv) == 2 and argv[0] == "--write":
        path = Path(argv[1])
        path.write_text(replace_block(path.read_text(), block))
        return 0
    sys.stdout.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
