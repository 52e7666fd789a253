"""Build a tiny Llama model with random weights and a byte-level BPE tokenizer, with no model hub.

Run by the vLLM environment's Python (it needs `torch`, `transformers` and `tokenizers`):
``python build_model.py FOLDER``. The folder then holds what vLLM loads (``config.json``, ``model.safetensors``,
``generation_config.json``) and what vLLM and the router tokenize with (``tokenizer.json``,
``tokenizer_config.json`` with a Llama-3-style chat template). The text the model writes is noise; prefix
caching, KV events, usage and metrics are real. Deterministic: the same seed gives the same folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Meta-Llama-3-8B-Instruct's chat template, verbatim.
TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
VOCAB = 8192


def corpus() -> list[str]:
    """Varied English-like lines (words, numbers, punctuation, code) so the BPE learns a few thousand merges."""
    import random
    rng = random.Random(7)
    syll = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "dor", "an", "el", "is", "on", "ur", "th",
            "st", "qu", "br", "gr", "pl", "ex", "in", "er", "ly", "ing", "ed", "tion", "ment", "ous"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    words += ("the of and to in is you that it he was for on are as with his they at be this have from or one "
              "had by word but not what all were we when your can said there use an each which she do how their "
              "if will up other about out many then them these so some her would make like him into time has "
              "look two more write go see number no way could people my than first water been call who oil its "
              "now find long down day did get come made may part question answer rule group assistant system "
              "user document summary report tool function result error").split()
    lines = []
    for i in range(30000):
        n = rng.randint(5, 30)
        line = " ".join(rng.choice(words) for _ in range(n))
        if i % 7 == 0:
            line += f" {rng.randint(0, 99999)}."
        if i % 11 == 0:
            line = line.capitalize() + "?"
        if i % 13 == 0:
            line = f"def f{i}(x):\n    return x * {i}  # {line[:20]}\n"
        lines.append(line)
    return lines


def build(folder: Path) -> None:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 64, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    eot = tok.token_to_id("<|eot_id|>")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>",
        "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATE}))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                         bos_token_id=bos, eos_token_id=eot, tie_word_embeddings=True, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eot}))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
