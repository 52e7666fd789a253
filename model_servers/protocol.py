"""OpenAI request parsing and response encoding for the simulated server (pure, no I/O).

`parse_generate` validates a /v1/chat/completions or /v1/completions body the way vLLM does and returns
a `GenerateRequest` or raises `OpenAIError` (400 malformed, 404 unknown model). `StreamEncoder`
pre-encodes the SSE chunk templates of one request so each streamed token costs one bytes join.

Chosen behaviours where vLLM's would depend on a real model:
- ``model`` may be omitted (vLLM serves the default model then); an unknown name is a 404;
- ``max_tokens``/``max_completion_tokens`` default to `default_max_tokens` (the simulated model never
  emits EOS, so exactly that many tokens are generated, like ``ignore_eos``);
- ``n`` other than 1 and ``prompt`` batches of more than one prompt are 400s;
- ``prompt`` may be a string, a list of token ids, or a one-element list of either.

Validated like vLLM (its pydantic request models + ``SamplingParams._verify_args``), each error a 400 naming
the field in ``param``: prompt token ids are ints in [0, vocab size); ``stop`` is a string or a list of
non-empty strings; ``logprobs`` is a boolean for chat and an int in [0, MAX_LOGPROBS] for completions;
``top_logprobs`` an int in [0, MAX_LOGPROBS] (and needs ``logprobs: true``); ``n`` >= 1 (only 1 served);
``max_tokens`` >= 1; ``temperature`` in [0, 2]; ``top_p`` in (0, 1]; presence/frequency penalties in [-2, 2];
``top_k`` -1, 0 or >= 1; ``min_p`` in [0, 1]; ``repetition_penalty`` > 0; ``seed`` an int. Unknown fields are
ignored (vLLM warns and ignores them). Client values echoed in messages are cut to `ECHO_CHARS` characters,
so a 1 MB field never becomes a 1 MB error.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import orjson

from prefixroute.model_servers import tokenizer
from prefixroute.openai_errors import OpenAIError


@dataclasses.dataclass(slots=True)
class GenerateRequest:
    chat: bool
    model: str
    prompt_ids: np.ndarray
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None


MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs`` (and OpenAI's limit for ``top_logprobs``)."""
ECHO_CHARS = 100
"""Longest client value quoted back in an error message."""


def clip(value: Any, limit: int = ECHO_CHARS) -> str:
    """`value` (a str as is, anything else as its repr) cut to `limit` characters for an error message."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def load_json_object(body: bytes) -> dict:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise _bad("The request body must be a JSON object.")
    return data


def _opt_int(data: dict, key: str, minimum: int) -> int | None:
    v = data.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if v < minimum:
        raise _bad(f"'{key}' must be at least {minimum}, got {clip(v)}", key)
    return v


def _opt_type(data: dict, key: str, types: tuple[type, ...], what: str) -> Any:
    v = data.get(key)
    if v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
        raise _bad(f"'{key}' must be {what}, got {type(v).__name__}", key)
    return v


def resolve_model(data: dict, served: str, models: frozenset[str]) -> str:
    model = data.get("model")
    if model is None:
        return served
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model not in models:
        raise OpenAIError(404, f"The model `{clip(model)}` does not exist.", param="model", type_="NotFoundError")
    return model


def prompt_ids_of(data: dict, chat: bool) -> np.ndarray:
    """Token ids of the prompt of a chat (`messages`) or completion (`prompt`) body; raises 400s."""
    if chat:
        if "messages" not in data:
            raise _bad("Field required: 'messages'", "messages")
        try:
            text = tokenizer.render_chat(data["messages"], tools=data.get("tools"),
                                         add_generation_prompt=data.get("add_generation_prompt", True) is not False)
        except tokenizer.ChatTemplateError as exc:
            raise _bad(str(exc), exc.param) from None
        return tokenizer.encode(text)
    if "prompt" not in data:
        raise _bad("Field required: 'prompt'", "prompt")
    prompt = data["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("The prompt cannot be empty.", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        # range-check in Python before numpy: an id of 2**63 would overflow int64 (an OverflowError, not a 400)
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= tokenizer.VOCAB_SIZE:
            bad = lo if lo < 0 else hi
            raise _bad(f"Token id {clip(bad)} is out of vocabulary: prompt token ids must be integers in "
                       f"[0, {tokenizer.VOCAB_SIZE}).", "prompt")
        return np.asarray(prompt, dtype=np.int64)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise _bad("Batched prompts are not supported by this server; send one prompt per request.", "prompt")
    raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")


def _opt_number(data: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
    v = _opt_type(data, key, (int, float), "a number")
    if v is None:
        return
    if not math.isfinite(v) or (v <= lo if lo_open else v < lo) or v > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _bad(f"'{key}' must be in {interval}, got {clip(v)}", key)


def _check_sampling(data: dict, chat: bool) -> None:
    """The sampling fields the simulated model ignores but vLLM validates (types and ranges, as vLLM)."""
    _opt_number(data, "temperature", 0.0, 2.0)
    _opt_number(data, "top_p", 0.0, 1.0, lo_open=True)
    _opt_number(data, "min_p", 0.0, 1.0)
    _opt_number(data, "presence_penalty", -2.0, 2.0)
    _opt_number(data, "frequency_penalty", -2.0, 2.0)
    _opt_number(data, "repetition_penalty", 0.0, math.inf, lo_open=True)
    _opt_int(data, "top_k", -1)  # -1 (vLLM's legacy "disabled"), 0 (disabled) and >= 1 are all valid
    _opt_int(data, "seed", -(1 << 63))
    _opt_int(data, "min_tokens", 0)
    stop = data.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise _bad(f"'stop' must be a string or a list of strings, got {clip(stop)}", "stop")
        if any(not x for x in stop):
            raise _bad("'stop' cannot contain an empty string.", "stop")
    if chat:
        logprobs = _opt_type(data, "logprobs", (bool,), "a boolean")
        top = _opt_int(data, "top_logprobs", 0)
        if top is not None:
            if top > MAX_LOGPROBS:
                raise _bad(f"'top_logprobs' must be at most {MAX_LOGPROBS}, got {clip(top)}", "top_logprobs")
            if top > 0 and not logprobs:
                raise _bad("When using 'top_logprobs', 'logprobs' must be set to true.", "top_logprobs")
    else:
        lp = _opt_int(data, "logprobs", 0)
        if lp is not None and lp > MAX_LOGPROBS:
            raise _bad(f"'logprobs' must be at most {MAX_LOGPROBS}, got {clip(lp)}", "logprobs")


def parse_generate(data: dict, *, chat: bool, served: str, models: frozenset[str], max_model_len: int,
                   default_max_tokens: int) -> GenerateRequest:
    """Validate a generation body (see module docstring for the chosen behaviours)."""
    model = resolve_model(data, served, models)
    stream = _opt_type(data, "stream", (bool,), "a boolean") or False
    so = _opt_type(data, "stream_options", (dict,), "an object")
    include_usage = False
    if so is not None:
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
        include_usage = bool(iu)
        if not stream:
            raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    n = _opt_int(data, "n", 1)
    if n is not None and n != 1:
        raise _bad("Only n=1 is supported by this server.", "n")
    _check_sampling(data, chat)
    max_tokens = _opt_int(data, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(data, "max_tokens", 1)
    cache_salt = _opt_type(data, "cache_salt", (str,), "a string")
    ids = prompt_ids_of(data, chat)
    num_prompt = len(ids)
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, max_model_len - num_prompt))
    if num_prompt + max_tokens > max_model_len:
        raise _bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
                   f"completion). Please reduce the length of the messages or completion.",
                   "messages" if chat else "prompt")
    return GenerateRequest(chat, model, ids, max_tokens, stream, include_usage, cache_salt)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class StreamEncoder:
    """Pre-encoded SSE chunks of one streamed response, in vLLM's format. Word texts must be JSON-safe."""

    __slots__ = ("head", "mid", "last", "chat", "usage_head", "first")

    def __init__(self, *, chat: bool, request_id: str, created: int, model: str) -> None:
        m = orjson.dumps(model).decode()
        self.chat = chat
        if chat:
            head = (f'data: {{"id":"{request_id}","object":"chat.completion.chunk","created":{created},'
                    f'"model":{m},"choices":[{{"index":0,"delta":{{"content":"')
            self.mid = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
            self.last = b'"},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
            self.first = (f'data: {{"id":"{request_id}","object":"chat.completion.chunk","created":{created},'
                          f'"model":{m},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                          f'"logprobs":null,"finish_reason":null}}]}}\n\n').encode()
        else:
            head = (f'data: {{"id":"{request_id}","object":"text_completion","created":{created},'
                    f'"model":{m},"choices":[{{"index":0,"text":"')
            self.mid = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            self.last = b'","logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
            self.first = b""
        self.head = head.encode()
        kind = "chat.completion.chunk" if chat else "text_completion"
        self.usage_head = (f'data: {{"id":"{request_id}","object":"{kind}","created":{created},'
                           f'"model":{m},"choices":[],"usage":').encode()

    def token(self, word: bytes, last: bool) -> bytes:
        return self.head + word + (self.last if last else self.mid)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        return self.usage_head + orjson.dumps(usage(prompt_tokens, completion_tokens, cached_tokens)) + b"}\n\n"


DONE = b"data: [DONE]\n\n"


def full_response(*, chat: bool, request_id: str, created: int, model: str, text: str, prompt_tokens: int,
                  completion_tokens: int, cached_tokens: int) -> bytes:
    """A non-streamed response body in vLLM's shape."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                  "logprobs": None, "finish_reason": "length", "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        obj = "text_completion"
    return orjson.dumps({"id": request_id, "object": obj, "created": created, "model": model,
                         "choices": [choice], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})


def check_responses_fields(data: dict) -> tuple[int | None, str | None]:
    """The sampling and cache fields of a /v1/responses body, validated as vLLM's ``ResponsesRequest`` does
    (types and ranges of chat's sampling fields; ``max_output_tokens`` >= 1 like ``max_tokens``;
    ``top_logprobs`` in [0, MAX_LOGPROBS]; ``cache_salt`` a non-empty string). Returns (max_output_tokens or
    None, cache_salt or None); the prompt fields are `prefixroute.responses_prompt.parse_body`'s. ``prompt_cache_key``
    is not a salt: upstream vLLM ignores it for caching (a routing hint, see the router), so it is only echoed."""
    _opt_number(data, "temperature", 0.0, 2.0)
    _opt_number(data, "top_p", 0.0, 1.0, lo_open=True)
    _opt_number(data, "repetition_penalty", 0.0, math.inf, lo_open=True)
    _opt_int(data, "top_k", -1)
    _opt_int(data, "seed", -(1 << 63))
    top = _opt_int(data, "top_logprobs", 0)
    if top is not None and top > MAX_LOGPROBS:
        raise _bad(f"'top_logprobs' must be at most {MAX_LOGPROBS}, got {clip(top)}", "top_logprobs")
    stop = data.get("stop")
    if stop is not None and not isinstance(stop, str) and (
            not isinstance(stop, list) or not all(isinstance(x, str) for x in stop)):
        raise _bad(f"'stop' must be a string or a list of strings, got {clip(stop)}", "stop")
    for key in ("parallel_tool_calls", "background"):
        _opt_type(data, key, (bool,), "a boolean")
    if data.get("background"):
        raise _bad("Background responses are not supported by this server.", "background")
    metadata = _opt_type(data, "metadata", (dict,), "an object")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise _bad("'metadata' values must be strings", "metadata")
    max_output = _opt_int(data, "max_output_tokens", 1)
    salt = _opt_type(data, "cache_salt", (str,), "a string")
    if salt is not None and not salt:
        raise _bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return max_output, salt
