"""The YAML emitter behind envoy/envoy.yaml: whatever plain data goes in, a YAML parser reads the same back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.extproc.envoy_config import EnvoySettings, build_config, render
from prefixroute.extproc.yaml_emit import dump

import yaml  # noqa: E402 - PyYAML (a dependency) checks that our emitter writes valid YAML

_keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=12)
_scalars = (st.none() | st.booleans() | st.integers(-(2**53), 2**53)
            | st.floats(allow_nan=False, allow_infinity=False, width=32)
            | st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20))
_data = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
                     max_leaves=25)


@given(st.dictionaries(_keys, _data, max_size=5))
def test_dump_round_trips_through_a_yaml_parser(data: dict) -> None:
    assert yaml.safe_load(dump(data)) == (data or None)


@pytest.mark.parametrize("value", [1e-05, 1e20, -2.5e-300, 0.1, -0.0, 2**63, True, None, "0", "on", "null", "a: b",
                                   "#x", "\U0001F600", "\u2028", "line\nbreak"])
def test_tricky_scalars_keep_their_type(value: object) -> None:
    assert yaml.safe_load(dump({"k": value, str(value): 1})) == {"k": value, str(value): 1}


def test_rendered_config_parses_back_to_the_built_config() -> None:
    s = EnvoySettings(failure_mode="closed", num_fallbacks=3)
    assert yaml.safe_load(render(s)) == build_config(s)


def test_header_becomes_comment_lines() -> None:
    text = dump({"a": 1}, header="line one\nline two")
    assert text.splitlines()[:2] == ["# line one", "# line two"]
