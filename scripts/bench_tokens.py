"""Micro-benchmark of the decision path's tokenization and hashing (routing/tokens.py), 8k-token chat prompts.

    .venv/bin/python scripts/bench_tokens.py [--tokenizer FOLDER] [--tokens 8000] [--n 200]

Without --tokenizer it trains a Llama-3-like byte-level BPE (32k vocabulary, Llama 3's pre-tokenizer regex,
special tokens and chat template) on the Python standard library's sources into a temporary folder, so nothing
is downloaded. Prints p50/p99 in microseconds of:

- cold: a new 8k-token system prompt per request (nothing cached);
- warm: the same system prompt, a new user question each time (the prefix was seen before);
for the hasher alone (`PromptHasher.chat_blocks`) and for all of `parse_request` (JSON parse, validation,
tokenization, hashing); plus HF tokenizers' own whole-prompt encode and text mode for reference.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.tokenizers import HFTokenizer
from prefixroute.extproc.routing.tokens import PromptHasher
from prefixroute.model_servers.tokenizer import SimTokenizer

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def build_tokenizer(folder: Path, corpus: list[str], vocab_size: int) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", bos)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}))


def pct(xs: list[float]) -> str:
    a = np.array(xs) * 1e6
    return f"p50 {np.percentile(a, 50):8.0f} us   p99 {np.percentile(a, 99):8.0f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="", help="a tokenizer folder ('sim' for the simulated servers')")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()

    lib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(f"{lib}/**/*.py", recursive=True))[:1500]
    corpus = [Path(f).read_text(errors="ignore") for f in files]
    words = sorted({w for text in corpus[:200] for w in text.split() if w.isalpha() and len(w) < 12})
    tok = load_tokenizer(args.tokenizer, corpus, args.vocab)
    prompts = Prompts(tok, words, random.Random(1))
    shared = prompts.doc(args.tokens)
    settings = RoutingSettings()
    hasher = PromptHasher(tok, block_size=16, max_blocks=settings.max_token_blocks)
    n_tokens = hasher.chat_blocks(body(shared, "q")).num_prompt_tokens
    print(f"prompt: {n_tokens} tokens, {len(shared)} characters; max_token_blocks={settings.max_token_blocks}")
    cold_docs = [prompts.doc(args.tokens) for _ in range(max(20, args.n // 5))]
    figures = {**time_hasher(hasher, cold_docs, shared, prompts, args.n),
               **time_parse(tok, settings, cold_docs, shared, prompts, args.n)}
    if isinstance(tok, HFTokenizer):
        figures["HF tokenizers whole encode (ref)"] = time_whole_encode(tok, cold_docs)
    for label, times in figures.items():
        print(f"{label:<35}{pct(times)}")


def load_tokenizer(folder: str, corpus: list[str], vocab: int) -> HFTokenizer | SimTokenizer:
    """`folder`'s tokenizer, the simulated servers' for "sim", or (empty) a Llama-3-like BPE trained on `corpus`."""
    if folder == "sim":
        return SimTokenizer()
    path = Path(folder) if folder else Path(tempfile.mkdtemp()) / "llama3ish"
    if not folder:
        t0 = time.perf_counter()
        build_tokenizer(path, corpus, vocab)
        print(f"trained a {vocab}-token byte-level BPE in {time.perf_counter() - t0:.1f} s: {path}")
    tok = HFTokenizer(path)
    print(f"segment_exact={tok.segment_exact} fast_path={tok.fast_path}")
    return tok


class Prompts:
    """Seeded prompt text: documents of about N tokens of `words`, and questions."""

    def __init__(self, tok: HFTokenizer | SimTokenizer, words: list[str], rng: random.Random) -> None:
        self.tok, self.words, self.rng = tok, words, rng

    def doc(self, num_tokens: int) -> str:
        out, n = [], 0
        while n < num_tokens:
            chunk = " ".join(self.rng.choice(self.words) for _ in range(200)) + ".\n"
            out.append(chunk)
            n += len(self.tok.encode_pieces([chunk])[0])
        return "".join(out)

    def question(self, i: int) -> str:
        return f"Question {i}: " + " ".join(self.rng.choice(self.words) for _ in range(20)) + "?"


def body(system: str, question: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def time_hasher(hasher: PromptHasher, cold_docs: list[str], shared: str, prompts: Prompts, n: int
                ) -> dict[str, list[float]]:
    """The hasher alone: a new prompt per request (cold), and the shared prompt with a new question (warm)."""
    cold, warm = [], []
    for d in cold_docs:
        b = body(d, "What does it say?")
        t = time.perf_counter()
        hasher.chat_blocks(b)
        cold.append(time.perf_counter() - t)
    for i in range(n):
        b = body(shared, prompts.question(i))
        t = time.perf_counter()
        hasher.chat_blocks(b)
        warm.append(time.perf_counter() - t)
    return {"hasher cold (new 8k prompt)": cold, "hasher warm (seen prefix)": warm}


def time_parse(tok: HFTokenizer | SimTokenizer, settings: RoutingSettings, cold_docs: list[str], shared: str,
               prompts: Prompts, n: int) -> dict[str, list[float]]:
    """All of `parse_request` (a fresh hasher): cold and warm in token mode, and text mode for reference."""
    cold_parse, warm_parse, text_parse = [], [], []
    fresh = PromptHasher(tok, block_size=16, max_blocks=settings.max_token_blocks)
    for d in cold_docs:
        raw = orjson.dumps(body(d, "What does it say?"))
        t = time.perf_counter()
        parse_request("POST", "/v1/chat/completions", {}, raw, settings, fresh)
        cold_parse.append(time.perf_counter() - t)
    fresh.chat_blocks(body(shared, "q"))
    for i in range(n):
        raw = orjson.dumps(body(shared, prompts.question(i)))
        t = time.perf_counter()
        parse_request("POST", "/v1/chat/completions", {}, raw, settings, fresh)
        warm_parse.append(time.perf_counter() - t)
        t = time.perf_counter()
        parse_request("POST", "/v1/chat/completions", {}, raw, settings)
        text_parse.append(time.perf_counter() - t)
    return {"parse_request cold, token mode": cold_parse, "parse_request warm, token mode": warm_parse,
            "parse_request, text mode": text_parse}


def time_whole_encode(tok: HFTokenizer, cold_docs: list[str]) -> list[float]:
    """HF tokenizers' own encode of each whole rendered prompt (the reference the hasher's per-block path beats)."""
    whole = []
    for d in cold_docs:
        text, add = tok.render_chat(body(d, "What does it say?"))
        t = time.perf_counter()
        tok.encode(text, add)
        whole.append(time.perf_counter() - t)
    return whole


if __name__ == "__main__":
    sys.exit(main())
