"""A tiny deterministic YAML emitter for the rendered Envoy configuration.

Why not PyYAML's dumper: the committed `envoy/envoy.yaml` must be byte-identical to the rendering, so
the output must not change with the library's version or its quoting heuristics (PyYAML only checks
the output, in the tests). The input is
plain data (dict/list/str/int/float/bool/None) built by `envoy_config`; dict order is preserved.
Strings are always double-quoted JSON strings (valid YAML), so no value can be misread as another type.
"""

from __future__ import annotations

import json
import re
from typing import Any


_NON_PRINTABLE = re.compile(r"[^\x20-\x7e]")


def _quote(v: str) -> str:
    """A double-quoted YAML string: JSON escapes for control characters, YAML's \\UXXXXXXXX for every other
    non-ASCII character (JSON's surrogate pairs would not be joined by YAML parsers)."""
    return _NON_PRINTABLE.sub(lambda m: f"\\U{ord(m.group()):08x}", json.dumps(v, ensure_ascii=False))


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return repr(v)
    if isinstance(v, float):
        text = repr(v)
        # YAML 1.1 resolvers need a "." in the mantissa of an exponent form ("1e-05" would read as a string).
        if "e" in text and "." not in text:
            mantissa, exp = text.split("e")
            text = f"{mantissa}.0e{exp}"
        return text
    if isinstance(v, str):
        return _quote(v)
    raise TypeError(f"cannot emit {type(v).__name__}")


_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
# Words YAML 1.1 parsers read as booleans or null: such keys must be quoted to stay strings.
_RESERVED = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def _key(k: str) -> str:
    # Bare keys when they are plain identifiers, quoted otherwise ("@type", "0", "on").
    if not isinstance(k, str):
        raise TypeError(f"keys must be strings, got {type(k).__name__}")
    return k if _BARE_KEY.match(k) and k.lower() not in _RESERVED else _quote(k)


def _emit(v: Any, indent: int, out: list[str]) -> None:
    pad = "  " * indent
    if isinstance(v, dict):
        for k, item in v.items():
            if isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{_key(k)}:")
                _emit(item, indent + 1, out)
            else:
                out.append(f"{pad}{_key(k)}: {_empty_or_scalar(item)}")
    elif isinstance(v, list):
        for item in v:
            if isinstance(item, (dict, list)) and item:
                sub: list[str] = []
                _emit(item, indent + 1, sub)
                first = sub[0].lstrip()
                out.append(f"{pad}- {first}")
                out.extend(sub[1:])
            else:
                out.append(f"{pad}- {_empty_or_scalar(item)}")
    else:
        out.append(pad + _scalar(v))


def _empty_or_scalar(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return _scalar(v)


def dump(data: dict[str, Any], header: str = "") -> str:
    """YAML text for `data`, with `header` emitted as leading `#` comment lines."""
    out = [("# " + line).rstrip() for line in header.splitlines()] if header else []
    _emit(data, 0, out)
    return "\n".join(out) + "\n"
