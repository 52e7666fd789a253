"""Prompt tokenization as the servers do it (routing/tokenizers.py, the registry of tokenizers by name), cached
token-block hashes (routing/tokens.py), and token mode in request parsing (routing/request.py). The Hugging Face
tokenizers here are trained by the tests themselves (tokenizers library, tiny vocabularies, Llama-3-like
pre-tokenizer and chat template): nothing is downloaded."""

from __future__ import annotations

import importlib.metadata
import json

import numpy as np
import orjson
import pytest
from hypothesis import given, settings as hsettings, strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from prefixroute.extproc.routing.hashing import hash_blocks, hash_token_blocks, seed_for, token_seed_for
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing import tokenizers
from prefixroute.extproc.routing.tokenizers import HFTokenizer, load_tokenizer
from prefixroute.extproc.routing.tokens import PromptHasher
from prefixroute.model_servers import protocol
from prefixroute.model_servers.tokenizer import SimTokenizer
from prefixroute.prompt_tokenizer import TokenizationError, TokenizerLoadError, special_token_pattern

BS = 16
SEED = token_seed_for(None, None)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Meta-Llama-3-8B-Instruct's chat template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CORPUS = [
    "You are a helpful assistant. Answer briefly and cite your sources.",
    "The quick brown fox jumps over the lazy dog 1234567890 times!",
    "def main():\n    return 42  # the answer\n\n",
    "Prefix caching cuts time to first token; KV blocks of 16 tokens are hashed in a chain.",
    "Ünïcödé tëxt, emoji 🙂 and tabs\tand  double  spaces.",
] * 20


def build_tokenizer(folder, *, template=LLAMA3_TEMPLATE, pre_tokenizer=None, config_extra=None, vocab_size=600):
    """Train a tiny byte-level BPE with Llama 3's special tokens and BOS post-processor; save it as a folder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    if template is not None:
        config["chat_template"] = template
    config.update(config_extra or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "llama3ish")


@pytest.fixture(scope="module")
def hf(hf_folder):
    return HFTokenizer(hf_folder)


def chat_body(messages, **extra):
    return {"model": "m", "messages": messages, **extra}


SYSTEM = "You are a meticulous assistant. " * 30
CHATS = [
    chat_body([{"role": "user", "content": "hi"}]),
    chat_body([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why is the sky blue?"}]),
    chat_body([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"},
               {"role": "assistant", "content": "b"}, {"role": "user", "content": "c " * 50}],
              add_generation_prompt=False),
    chat_body([{"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "text", "text": "here"}]}]),
]
SIM_ONLY_CHATS = [
    chat_body([{"role": "user", "content": [{"type": "text", "text": "see"},
                                            {"type": "image_url", "image_url": {"url": "http://x/1.png"}}]}]),
    chat_body([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "result " * 20}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
]


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    neq = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(neq[0]) if len(neq) else n


# --- the simulated servers' tokenization ---------------------------------------------------------------------
@pytest.mark.parametrize("body", CHATS + SIM_ONLY_CHATS)
def test_sim_chat_ids_are_the_servers_prompt_ids(body):
    expected = protocol.prompt_ids_of(body, True)
    sim = SimTokenizer()
    assert np.array_equal(sim.chat_ids(body), expected)
    blocks = PromptHasher(sim, block_size=BS, max_blocks=None).chat_blocks(body)
    assert blocks.num_prompt_tokens == len(expected)
    assert blocks.block_hashes == hash_token_blocks(expected.astype(np.uint32), BS, SEED)


@pytest.mark.parametrize("prompt", ["Once upon a time " * 40, ["Once upon a time " * 3], list(range(100)),
                                    [list(range(40))], "x<|eot_id|>y"])
def test_sim_completion_ids_are_the_servers_prompt_ids(prompt):
    body = {"model": "m", "prompt": prompt}
    expected = protocol.prompt_ids_of(body, False)
    sim = SimTokenizer()
    assert np.array_equal(sim.completion_ids(body), expected)
    blocks = PromptHasher(sim, block_size=BS, max_blocks=None).completion_blocks(body)
    assert blocks.num_prompt_tokens == len(expected)
    assert blocks.block_hashes == hash_token_blocks(expected.astype(np.uint32), BS, SEED)


def test_sim_template_errors_are_tokenization_errors():
    with pytest.raises(TokenizationError):
        SimTokenizer().render_chat({"messages": [{"role": "wizard", "content": "x"}]})


# --- caching: identical to uncached, prefix-stable ------------------------------------------------------------
_words = st.sampled_from(["hello", " world", "\n\n", "  ", "ü", "🙂", "<|eot_id|>", "<|start_header_id|>", "12",
                          "tab\t", "The", " the", "!"])
_content = st.lists(_words, max_size=40).map("".join)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _content})
_chat = st.lists(_message, min_size=1, max_size=6)


@hsettings(max_examples=60, deadline=None)
@given(chats=st.lists(_chat, min_size=1, max_size=8), salt=st.sampled_from([None, "s1"]),
       cache_entries=st.sampled_from([1, 3, 1000]), max_blocks=st.sampled_from([None, 2, 256]))
def test_cached_results_equal_uncached_sim(chats, salt, cache_entries, max_blocks):
    sim = SimTokenizer()
    hasher = PromptHasher(sim, block_size=4, max_blocks=max_blocks, cache_entries=cache_entries)
    seed = token_seed_for(None, salt)
    for messages in chats + chats:  # every body twice: the second pass is served from the caches
        body = {"messages": messages}
        ids = protocol.prompt_ids_of(body, True).astype(np.uint32)
        got = hasher.chat_blocks(body, cache_salt=salt)
        assert got.num_prompt_tokens == len(ids)
        assert got.block_hashes == hash_token_blocks(ids, 4, seed, max_blocks)


@hsettings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(_content, _content), min_size=2, max_size=5), system=_content)
def test_a_chat_extended_by_turns_shares_its_leading_blocks(turns, system):
    hasher = PromptHasher(SimTokenizer(), block_size=4, max_blocks=None)
    messages = [{"role": "system", "content": system + "x"}]
    previous_ids = previous = None
    for user, reply in turns:
        messages = messages + [{"role": "user", "content": user}]
        body = {"messages": messages}
        ids = protocol.prompt_ids_of(body, True)
        blocks = hasher.chat_blocks(body).block_hashes
        if previous is not None:
            # turn N's prompt (with its generation prompt) is a text prefix of turn N+1's; the tokens agree up to
            # at most the last one, and the hashes agree on exactly the blocks of the common tokens
            common = common_prefix(previous_ids, ids)
            assert common >= len(previous_ids) - 1
            shared = common_prefix(previous, blocks)
            assert shared == common // 4
        previous_ids, previous = ids, blocks
        messages = messages + [{"role": "assistant", "content": reply}]


def test_a_seen_prefix_costs_no_tokenization_of_it():
    sim = SimTokenizer()
    hasher = PromptHasher(sim, block_size=BS)
    hasher.chat_blocks(CHATS[1])
    misses = hasher.num_piece_misses
    other = chat_body([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Another question"}])
    hasher.chat_blocks(other)
    assert hasher.num_piece_misses == misses + 1  # only the new user message was tokenized


def test_seeds_separate_adapters_and_salts():
    hasher = PromptHasher(SimTokenizer(), block_size=BS)
    a = hasher.chat_blocks(CHATS[1]).block_hashes
    b = hasher.chat_blocks(CHATS[1], cache_salt="t").block_hashes
    c = hasher.chat_blocks(CHATS[1], lora_name="lora").block_hashes
    assert a and not (set(a) & set(b)) and not (set(a) & set(c)) and not (set(b) & set(c))


# --- Hugging Face tokenizer folders ----------------------------------------------------------------------------
def test_hf_chat_renders_the_llama3_template_and_adds_no_second_bos(hf):
    body = chat_body([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}])
    text, add = hf.render_chat(body)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert add is False  # vLLM's chat default: the template wrote the BOS
    ids = hf.chat_ids(body)
    bos = hf._tok.token_to_id("<|begin_of_text|>")
    assert ids[0] == bos and ids[1] != bos
    assert np.array_equal(ids, hf._tok.encode(text, add_special_tokens=False).ids)


def test_hf_completion_adds_special_tokens_as_vllm(hf):
    bos = hf._tok.token_to_id("<|begin_of_text|>")
    ids = hf.completion_ids({"prompt": "The quick brown fox"})
    assert ids[0] == bos and np.array_equal(ids[1:], hf._tok.encode("The quick brown fox",
                                                                    add_special_tokens=False).ids)
    no_bos = hf.completion_ids({"prompt": "The quick brown fox", "add_special_tokens": False})
    assert np.array_equal(no_bos, ids[1:])
    assert np.array_equal(hf.completion_ids({"prompt": [5, 6, 7]}), [5, 6, 7])  # ids pass through


def test_hf_splitting_is_exact_and_the_fast_path_is_on(hf):
    assert hf.segment_exact
    assert hf.fast_path  # byte-level BPE + one regex split: tiktoken, verified at load


_hf_text = st.lists(st.one_of(_words, st.sampled_from(SPECIALS), st.text(max_size=8)), max_size=30).map("".join)


@hsettings(max_examples=150, deadline=None)
@given(text=_hf_text, add=st.booleans())
def test_hf_piecewise_encoding_equals_whole_encoding(hf, text, add):
    whole = np.array(hf._tok.encode(text, add_special_tokens=add).ids, np.uint32)
    assert np.array_equal(hf.pieces_ids(text, add), whole)


@hsettings(max_examples=40, deadline=None)
@given(chats=st.lists(_chat, min_size=1, max_size=6))
def test_hf_cached_results_equal_uncached(hf, chats):
    hasher = PromptHasher(hf, block_size=4, max_blocks=None, cache_entries=5)
    for messages in chats + chats:
        body = {"messages": messages}
        ids = hf.chat_ids(body)
        got = hasher.chat_blocks(body)
        assert got.num_prompt_tokens == len(ids)
        assert got.block_hashes == hash_token_blocks(ids, 4, SEED)


def test_hf_without_tiktoken_pieces_are_the_same(hf_folder, hf, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tiktoken(name, *args, **kwargs):
        if name == "tiktoken":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tiktoken)
    slow = HFTokenizer(hf_folder)
    assert not slow.fast_path and slow.segment_exact
    texts = ["Hello world  \n\n", "Ünïcödé 🙂 tabs\t", " the The 123456 !!"]
    assert [list(a) for a in slow.encode_pieces(texts)] == [list(a) for a in hf.encode_pieces(texts)]


def test_hf_named_templates_pick_tool_use_with_tools(tmp_path):
    templates = [{"name": "default", "template": "D{{ messages[0]['content'] }}"},
                 {"name": "tool_use", "template": "T{{ tools | tojson }}{{ messages[0]['content'] }}"}]
    tok = HFTokenizer(build_tokenizer(tmp_path / "t", template=templates))
    assert tok.render_chat({"messages": [{"role": "user", "content": "x"}]})[0] == "Dx"
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>bold</b> & ü"}}]
    text = tok.render_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools})[0]
    # transformers' tojson: no HTML escaping, no ASCII escaping
    assert text == "T" + json.dumps(tools, ensure_ascii=False) + "x"


def test_hf_template_globals_and_generation_tag(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                "{% endfor %}|{{ strftime_now('%Y') | length }}|{{ eos_token }}")
    tok = HFTokenizer(build_tokenizer(tmp_path / "g", template=template))
    assert tok.render_chat({"messages": [{"role": "user", "content": "hi"}]})[0] == "<|begin_of_text|>hi|4|<|eot_id|>"


def test_hf_openai_content_format_when_the_template_loops_over_parts(tmp_path):
    template = ("{% for m in messages %}{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}"
                "{% endfor %}")
    tok = HFTokenizer(build_tokenizer(tmp_path / "o", template=template))
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "user", "content": "c"}]}
    assert tok.render_chat(body)[0] == "[a][b][c]"


def test_hf_string_content_format_joins_text_parts(hf):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert "\n\na\nb<|eot_id|>" in hf.render_chat(body)[0]


def test_hf_a_raising_template_is_a_tokenization_error(tmp_path):
    tok = HFTokenizer(build_tokenizer(tmp_path / "r", template="{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(TokenizationError, match="roles must alternate"):
        tok.render_chat({"messages": [{"role": "user", "content": "x"}]})


def test_hf_sandbox_refuses_unsafe_templates(tmp_path):
    tok = HFTokenizer(build_tokenizer(tmp_path / "s", template="{{ messages.__class__.__mro__ }}"))
    with pytest.raises(TokenizationError):
        tok.render_chat({"messages": [{"role": "user", "content": "x"}]})


def test_hf_metaspace_first_falls_back_to_whole_prompt_encoding(tmp_path):
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    folder = build_tokenizer(tmp_path / "m", pre_tokenizer=pre)
    tok = HFTokenizer(folder)
    assert not tok.segment_exact
    text = "<|begin_of_text|>hello world<|eot_id|>again here"
    assert tok.split(text) == [text]
    hasher = PromptHasher(tok, block_size=2, max_blocks=None)
    body = {"messages": [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "again"}]}
    assert hasher.chat_blocks(body).block_hashes == hash_token_blocks(tok.chat_ids(body), 2, SEED)


@pytest.mark.parametrize("make,match", [
    (lambda p: p / "nope", "does not exist"),
    (lambda p: p, "tokenizer.json"),
])
def test_load_errors_name_what_is_missing(tmp_path, make, match):
    with pytest.raises(TokenizerLoadError, match=match):
        load_tokenizer(str(make(tmp_path)))


def test_load_tokenizer_sim_and_folder(hf_folder):
    assert isinstance(load_tokenizer("sim"), SimTokenizer)
    assert isinstance(load_tokenizer(str(hf_folder)), HFTokenizer)
    with pytest.raises(TokenizerLoadError):
        load_tokenizer("")


def test_sim_is_registered_through_the_entry_point_group():
    # pyproject's [project.entry-points."prefixroute.tokenizers"]: the installed metadata names the factory, so the
    # router loads it by name without importing model_servers (tests/unit/core/test_core_layering.py).
    (ep,) = importlib.metadata.entry_points(group=tokenizers.ENTRY_POINT_GROUP, name="sim")
    assert ep.load() is SimTokenizer
    assert "sim" in tokenizers.registered_tokenizers()


def _install_entry_points(root, dist: str, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution under `root` (on sys.path) declaring `entry_points` in the group."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{tokenizers.ENTRY_POINT_GROUP}]\n{lines}")


def test_another_package_registers_a_tokenizer_by_entry_point(tmp_path, monkeypatch):
    (tmp_path / "third_party_tok.py").write_text(
        "from prefixroute.model_servers.tokenizer import SimTokenizer\n"
        "class Renamed(SimTokenizer):\n    name = 'third-party'\n"
        "def broken():\n    raise RuntimeError('no')\n")
    _install_entry_points(tmp_path, "third_party_tok", {"third-party": "third_party_tok:Renamed",
                                                        "missing": "no_such_module_here:Factory",
                                                        "broken": "third_party_tok:broken"})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"sim", "third-party", "missing"} <= set(tokenizers.registered_tokenizers())
    tok = load_tokenizer("third-party")
    assert tok.name == "third-party" and isinstance(tok, SimTokenizer)
    with pytest.raises(TokenizerLoadError, match="no_such_module_here"):
        load_tokenizer("missing")
    with pytest.raises(TokenizerLoadError, match="'broken' failed to load: RuntimeError: no"):
        load_tokenizer("broken")


def test_in_process_registration_wins_and_unknown_names_list_the_registered(monkeypatch):
    monkeypatch.setattr(tokenizers, "_registered", {})
    made = []

    def factory():
        made.append(SimTokenizer())
        return made[-1]

    tokenizers.register_tokenizer("sim", factory)
    assert load_tokenizer("sim") is made[0]
    with pytest.raises(ValueError):
        tokenizers.register_tokenizer("", factory)
    with pytest.raises(TokenizerLoadError, match=r"does not exist.*registered \(prefixroute.tokenizers: sim\)"):
        load_tokenizer("no-such-tokenizer")


def test_missing_chat_template_is_a_tokenization_error(tmp_path):
    tok = HFTokenizer(build_tokenizer(tmp_path / "n", template=None))
    with pytest.raises(TokenizationError, match="no chat template"):
        tok.render_chat({"messages": [{"role": "user", "content": "x"}]})
    assert len(tok.completion_ids({"prompt": "still works"})) > 1


def test_special_token_pattern_is_leftmost_longest():
    p = special_token_pattern(["<|a|>", "<|ab|>", "<|a", "[INST]"])
    assert p.split("x<|ab|>y<|a|>z<|azq[INST]") == ["x", "<|ab|>", "y", "<|a|>", "z", "<|a", "zq", "[INST]", ""]
    assert special_token_pattern([]) is None


# --- token mode in request parsing -----------------------------------------------------------------------------
S = RoutingSettings()
TS = RoutingSettings(tokenizer="sim")


def parse(body, hasher, headers=None, adapters=None, path="/v1/chat/completions"):
    return parse_request("POST", path, headers or {}, orjson.dumps(body), S, hasher, adapters)


def test_from_settings():
    assert PromptHasher.from_settings(S) is None
    h = PromptHasher.from_settings(RoutingSettings(tokenizer="sim", kv_block_tokens=32, max_token_blocks=7,
                                                   tokenizer_cache_entries=3))
    assert isinstance(h.tokenizer, SimTokenizer) and (h.block_size, h.max_blocks) == (32, 7)
    with pytest.raises(TokenizerLoadError):
        PromptHasher.from_settings(RoutingSettings(tokenizer="/no/such/folder"))


@pytest.mark.parametrize("body,path", [(CHATS[1], "/v1/chat/completions"),
                                       ({"model": "m", "prompt": SYSTEM}, "/v1/completions"),
                                       ({"model": "m", "prompt": list(range(300))}, "/v1/completions")])
def test_token_mode_hashes_the_servers_tokens(body, path):
    hasher = PromptHasher.from_settings(TS)
    req = parse(body, hasher, path=path)
    ids = protocol.prompt_ids_of(body, path.endswith("chat/completions")).astype(np.uint32)
    assert req.num_prompt_tokens == len(ids)
    assert req.block_hashes == hash_token_blocks(ids, TS.kv_block_tokens, SEED, TS.max_token_blocks)


def test_token_mode_seed_is_adapter_and_cache_salt_not_tenant():
    hasher = PromptHasher.from_settings(TS)
    ids = protocol.prompt_ids_of(CHATS[1], True).astype(np.uint32)
    salted = parse({**CHATS[1], "cache_salt": "s"}, hasher)
    cap = TS.max_token_blocks
    assert salted.block_hashes == hash_token_blocks(ids, BS, token_seed_for(None, "s"), cap)
    adapter = parse(CHATS[1], hasher, adapters={"m"})
    assert adapter.block_hashes == hash_token_blocks(ids, BS, token_seed_for("m", None), cap)
    tenant = parse({**CHATS[1], "prompt_cache_key": "k"}, hasher, headers={"x-prefixroute-tenant": "t"})
    assert tenant.tenant == "t\x1fk"
    assert tenant.block_hashes == hash_token_blocks(ids, BS, SEED, cap)  # the server's blocks are not tenant-salted


def test_text_mode_is_unchanged_without_a_tokenizer():
    req = parse(CHATS[1], None)
    assert req.num_prompt_tokens is None
    assert req.block_hashes and req.block_hashes == parse_request(
        "POST", "/v1/chat/completions", {}, orjson.dumps(CHATS[1]), S).block_hashes


def test_a_template_that_raises_routes_by_text(tmp_path):
    tok = HFTokenizer(build_tokenizer(tmp_path / "r", template="{{ raise_exception('no system role') }}"))
    req = parse(CHATS[1], PromptHasher(tok))
    assert req.num_prompt_tokens is None
    assert req.block_hashes == parse(CHATS[1], None).block_hashes


def test_token_mode_keeps_validation_errors():
    from prefixroute.openai_errors import OpenAIError

    with pytest.raises(OpenAIError) as exc:
        parse({"model": "m", "messages": [{"role": "user", "content": 5}]}, PromptHasher.from_settings(TS))
    assert exc.value.status == 400


def test_token_and_text_hashes_never_coincide():
    hasher = PromptHasher.from_settings(TS)
    token = set(parse(CHATS[1], hasher).block_hashes)
    text = set(hash_blocks("".join("x"), seed_for("m", None), 64, 256)) | set(parse(CHATS[1], None).block_hashes)
    assert token and not token & text
