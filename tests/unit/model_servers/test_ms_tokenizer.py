"""Tokenizer determinism and prefix property; Llama-3-style chat template."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.model_servers import tokenizer as tk


def test_deterministic_and_about_four_chars_per_token():
    text = "The quick brown fox jumps over the lazy dog. " * 100
    a, b = tk.encode(text), tk.encode(text)
    assert a.tolist() == b.tolist()
    assert len(text) / len(a) == pytest.approx(4, rel=0.01)
    assert a.max() < tk.NUM_TEXT_TOKENS and a.min() >= 0
    assert len(set(a.tolist())) > 5  # not a constant map


@given(st.text(max_size=300), st.text(max_size=300))
def test_text_prefix_tokenizes_to_token_prefix(a, b):
    ta, tab = tk.encode(a).tolist(), tk.encode(a + b).tolist()
    assert tab[: max(len(ta) - 1, 0)] == ta[: max(len(ta) - 1, 0)]


@given(st.text(max_size=200))
def test_special_tokens_are_single_ids(text):
    ids = tk.encode("<|begin_of_text|>" + text + "<|eot_id|>").tolist()
    assert ids[0] == 128000 and ids[-1] == 128009
    assert ids[1:-1] == tk.encode(text).tolist()


CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_render_layout_and_generation_prompt():
    out = tk.render_chat(CONVERSATION)
    assert out == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not tk.render_chat(CONVERSATION, add_generation_prompt=False).endswith("\n\n")


def test_turn_n_plus_1_shares_turn_n_prefix():
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    turn1 = CONVERSATION
    turn2 = turn1 + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Paris. It is sunny."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "Spain?"}]},
    ]
    r1 = tk.render_chat(turn1, tools=tools)
    r2 = tk.render_chat(turn2, tools=tools)
    r1_no_gen = tk.render_chat(turn1, tools=tools, add_generation_prompt=False)
    assert r2.startswith(r1_no_gen)
    assert '"name":"weather"' in r2 and "<|python_tag|>" in r2 and "ipython" in r2 and "And Spain?" in r2
    t1, t2 = tk.encode(r1).tolist(), tk.encode(r2).tolist()
    assert t2[: len(t1) - 1] == t1[:-1]


def test_image_part_renders_placeholder():
    out = tk.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                        {"type": "text", "text": "what?"}]}])
    assert "<|image|>what?" in out


@pytest.mark.parametrize(("messages", "tools", "param"), [
    ([], None, "messages"),
    ("hello", None, "messages"),
    ([1], None, "messages[0]"),
    ([{"role": "robot", "content": "x"}], None, "messages[0].role"),
    ([{"content": "x"}], None, "messages[0].role"),
    ([{"role": "user", "content": 5}], None, "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], None, "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "hologram"}]}], None, "messages[0].content[0].type"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}], None, "messages[0].tool_calls[0]"),
    ([{"role": "user", "content": "x"}], "tools", "tools"),
    ([{"role": "user", "content": "x"}], [3], "tools[0]"),
])
def test_template_errors_name_the_param(messages, tools, param):
    with pytest.raises(tk.ChatTemplateError) as ei:
        tk.render_chat(messages, tools=tools)
    assert ei.value.param == param
