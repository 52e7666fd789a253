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
    if args.tokenizer == "sim":
        tok = SimTokenizer()
    else:
        folder = Path(args.tokenizer) if args.tokenizer else Path(tempfile.mkdtemp()) / "llama3ish"
        if not args.tokenizer:
            t0 = time.perf_counter()
            build_tokenizer(folder, corpus, args.vocab)
            print(f"trained a {args.vocab}-token byte-level BPE in {time.perf_counter() - t0:.1f} s: {folder}")
        tok = HFTokenizer(folder)
        print(f"segment_exact={tok.segment_exact} fast_path={tok.fast_path}")
    rng = random.Random(1)

    def doc(num_tokens: int) -> str:
        out, n = [], 0
        while n < num_tokens:
            chunk = " ".join(rng.choice(words) for _ in range(200)) + ".\n"
            out.append(chunk)
            n += len(tok.encode_pieces([chunk])[0])
        return "".join(out)

    def body(system: str, question: str) -> dict:
        return {"model": "m", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": question}]}

    shared = doc(args.tokens)
    settings = RoutingSettings()
    hasher = PromptHasher(tok, block_size=16, max_blocks=settings.max_token_blocks)
    n_tokens = hasher.chat_blocks(body(shared, "q")).num_prompt_tokens
    print(f"prompt: {n_tokens} tokens, {len(shared)} characters; max_token_blocks={settings.max_token_blocks}")
    cold_docs = [doc(args.tokens) for _ in range(max(20, args.n // 5))]

    cold, warm, cold_parse, warm_parse, text_parse, whole = [], [], [], [], [], []
    for d in cold_docs:
        b = body(d, "What does it say?")
        t = time.perf_counter()
        hasher.chat_blocks(b)
        cold.append(time.perf_counter() - t)
    for i in range(args.n):
        b = body(shared, f"Question {i}: " + " ".join(rng.choice(words) for _ in range(20)) + "?")
        t = time.perf_counter()
        hasher.chat_blocks(b)
        warm.append(time.perf_counter() - t)
    fresh = PromptHasher(tok, block_size=16, max_blocks=settings.max_token_blocks)
    for d in cold_docs:
        raw = orjson.dumps(body(d, "What does it say?"))
        t = time.perf_counter()
        parse_request("POST", "/v1/chat/completions", {}, raw, settings, fresh)
        cold_parse.append(time.perf_counter() - t)
    fresh.chat_blocks(body(shared, "q"))
    for i in range(args.n):
        raw = orjson.dumps(body(shared, f"Question {i}: " + " ".join(rng.choice(words) for _ in range(20)) + "?"))
        t = time.perf_counter()
        parse_request("POST", "/v1/chat/completions", {}, raw, settings, fresh)
        warm_parse.append(time.perf_counter() - t)
        t = time.perf_counter()
        parse_request("POST", "/v1/chat/completions", {}, raw, settings)
        text_parse.append(time.perf_counter() - t)
    if isinstance(tok, HFTokenizer):
        for d in cold_docs:
            text, add = tok.render_chat(body(d, "What does it say?"))
            t = time.perf_counter()
            tok.encode(text, add)
            whole.append(time.perf_counter() - t)
    print(f"hasher cold (new 8k prompt)        {pct(cold)}")
    print(f"hasher warm (seen prefix)          {pct(warm)}")
    print(f"parse_request cold, token mode     {pct(cold_parse)}")
    print(f"parse_request warm, token mode     {pct(warm_parse)}")
    print(f"parse_request, text mode           {pct(text_parse)}")
    if whole:
        print(f"HF tokenizers whole encode (ref)   {pct(whole)}")


if __name__ == "__main__":
    sys.exit(main())
