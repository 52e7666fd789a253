"""Typed settings: one declaration gives the default, the CLI flag, the env var and the docs.

Every component declares its settings as a frozen dataclass subclassing `Settings`, with each
field's help text in ``field(metadata={"help": ...})``. From that single declaration:

- `add_arguments` adds ``--field-name`` flags to an argparse parser,
- `from_namespace` builds the instance with precedence CLI flag > env var > default,
- `render_markdown` writes the configuration reference (docs/configuration.md) so docs cannot drift,
- `essential_help` keeps a command's default ``--help`` to the flags its user needs first; ``--help-all`` lists
  every one.

The env var of a field is ``{ENV_PREFIX}{FIELD_NAME}`` upper-cased, e.g. ``PREFIXROUTE_EXTPROC_PORT``.
Supported field types: str, int, float, bool, Optional[...] of those, tuple[str, ...] (comma-separated).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="Settings")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base class for a component's settings. Subclasses set ENV_PREFIX and TITLE."""

    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_"
    TITLE: ClassVar[str] = "Settings"


def setting(default: Any, help: str, *, flag: str | None = None) -> Any:  # noqa: A002
    """Declare a settings field: `help` says what it does and why the default is sized so."""
    md = {"help": help}
    if flag:
        md["flag"] = flag
    if isinstance(default, (list, dict, set)):
        raise TypeError("use tuples for sequence defaults")
    return dataclasses.field(default=default, metadata=md)


def _resolved_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """Return (scalar type, optional) for a field annotation."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def parse_value(tp: Any, raw: str) -> Any:
    """Parse a string (flag or env var) into the field's type; raises ValueError with a clear message."""
    base, optional = _base_type(tp)
    if optional and raw.strip().lower() in ("", "none", "null"):
        return None
    if base is bool:
        v = raw.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise ValueError(f"expected a boolean (true/false), got {raw!r}")
    if base is int:
        return int(raw)
    if base is float:
        return float(raw)
    if base is str:
        return raw
    if typing.get_origin(base) is tuple:
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    raise TypeError(f"unsupported settings type {tp!r}")


def fields(cls: type[Settings]) -> list[tuple[dataclasses.Field, Any]]:
    hints = _resolved_types(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def env_name(cls: type[Settings], f: dataclasses.Field) -> str:
    return (cls.ENV_PREFIX + f.name).upper()


def add_arguments(parser: argparse.ArgumentParser, cls: type[Settings]) -> None:
    """Add one flag per field. Flags default to None so env vars and defaults can apply after."""
    group = parser.add_argument_group(cls.TITLE)
    for f, tp in fields(cls):
        base, _ = _base_type(tp)
        help_text = f"{f.metadata.get('help', '')} [env {env_name(cls, f)}; default {_fmt_default(f.default)}]"
        help_text = help_text.replace("%", "%%")
        if base is bool:
            group.add_argument(flag_name(f), dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                               help=help_text)
        else:
            group.add_argument(flag_name(f), dest=f.name, default=None, metavar=f.name.upper(),
                               type=lambda s, _tp=tp, _n=flag_name(f): _argparse_value(_tp, s, _n), help=help_text)


MAX_DEFAULT_HELP_FLAGS = 25
"""Most flags a command's default ``--help`` lists, ``--help-all`` included (``-h`` aside): about one screen, what
a person reads through before starting a command. The rest are one ``--help-all`` away."""

HELP_ALL = "--help-all"
REFERENCE_DOC = "docs/configuration.md"
"""The configuration reference, every setting of every command (relative to the repository root)."""


class _HelpAll(argparse.Action):
    """``--help-all``: print the help with every flag, grouped by settings class, and exit. Holds the help texts
    `essential_help` took out of the default help (`hidden`) and the parser's own epilog."""

    def __init__(self, option_strings: list[str], dest: str, hidden: dict[argparse.Action, str],
                 epilog: str | None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)
        self.hidden = hidden
        self.epilog = epilog

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser._print_message(format_help_all(parser), sys.stdout)
        parser.exit()


def essential_help(parser: argparse.ArgumentParser, essential: Collection[str]) -> None:
    """List only the `essential` arguments (by dest: a settings field's name, or another argument's dest) in the
    parser's default ``--help``, ending with a line that says how many more there are and where; add
    ``--help-all``, which lists every flag grouped by settings class. Call it last in a `configure_parser`.

    Invariants: every flag still parses, with its env var and default (only the help listing changes); the
    default help lists at most MAX_DEFAULT_HELP_FLAGS flags. Raises ValueError for a name the parser has no
    argument for, or a set too large for that bound."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS
               and not isinstance(a, argparse._HelpAction)}
    unknown = sorted(set(essential) - set(actions))
    if unknown:
        raise ValueError(f"essential_help: {parser.prog} has no argument {', '.join(unknown)}")
    if len(set(essential)) + 1 > MAX_DEFAULT_HELP_FLAGS:
        raise ValueError(f"essential_help: {parser.prog} would list {len(set(essential)) + 1} flags by default "
                         f"(--help-all included), over {MAX_DEFAULT_HELP_FLAGS}")
    hidden = {a: a.help for name, a in actions.items() if name not in essential}
    epilog = parser.epilog
    parser.add_argument(HELP_ALL, action=_HelpAll, hidden=hidden, epilog=epilog,
                        help="show every setting, grouped by settings class, and exit")
    for a in hidden:
        a.help = argparse.SUPPRESS
    more = f"{len(hidden)} more setting" + ("" if len(hidden) == 1 else "s")
    hint = f"{more}: {HELP_ALL}; all of them: {REFERENCE_DOC}"
    parser.epilog = f"{epilog} {hint}" if epilog else hint


def format_help_all(parser: argparse.ArgumentParser) -> str:
    """The parser's help with every flag, as ``--help-all`` prints it (its default help where `essential_help`
    hid nothing)."""
    help_all = next((a for a in parser._actions if isinstance(a, _HelpAll)), None)
    if help_all is None:
        return parser.format_help()
    epilog = parser.epilog
    try:
        for a, text in help_all.hidden.items():
            a.help = text
        parser.epilog = help_all.epilog
        return parser.format_help()
    finally:
        for a in help_all.hidden:
            a.help = argparse.SUPPRESS
        parser.epilog = epilog


def _argparse_value(tp: Any, raw: str, name: str) -> Any:
    try:
        return parse_value(tp, raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{name}: {exc}") from exc


def from_namespace(cls: type[S], ns: argparse.Namespace | None = None,
                   environ: Mapping[str, str] | None = None, **overrides: Any) -> S:
    """Build settings: explicit overrides > CLI flags > env vars > defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f, tp in fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        v = getattr(ns, f.name, None) if ns is not None else None
        if v is not None:
            values[f.name] = v
            continue
        raw = environ.get(env_name(cls, f))
        if raw is not None:
            try:
                values[f.name] = parse_value(tp, raw)
            except ValueError as exc:
                raise ValueError(f"{env_name(cls, f)}: {exc}") from exc
    return cls(**values)


def _fmt_default(v: Any) -> str:
    if isinstance(v, tuple):
        return ",".join(map(str, v)) or "(empty)"
    if v is None:
        return "(unset)"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v) if v != "" else "(empty)"


def render_markdown(classes: list[tuple[str, type[Settings]]]) -> str:
    """Render the configuration reference: one table per (command, settings class)."""
    out: list[str] = []
    for command, cls in classes:
        out.append(f"### `{command}`: {cls.TITLE}\n")
        out.append("| flag | env var | default | meaning |")
        out.append("| --- | --- | --- | --- |")
        for f, _tp in fields(cls):
            help_text = f.metadata.get("help", "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{flag_name(f)}` | `{env_name(cls, f)}` | `{_fmt_default(f.default)}` | {help_text} |")
        out.append("")
    return "\n".join(out)
