"""Token usage from OpenAI-style responses, as the ext_proc servicer sees them (pure, no I/O).

- Non-stream response: the JSON body's ``usage`` (`usage_from_body`).
- Stream (SSE): only the final ``data: {...}`` event carries ``usage`` (when the request had
  ``stream_options.include_usage``). `StreamUsageTail` keeps the last few KiB of the stream as
  chunks pass (O(chunk) copy, no parsing per chunk, so the token stream is not slowed) and parses
  usage once at end of stream.

``cached_tokens`` is ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``); None when absent, 0 when reported as 0.

Responses API (``/v1/responses``): the usage names differ (``input_tokens``, ``output_tokens``,
``input_tokens_details.cached_tokens``) and map to the same `Usage` fields; a stream carries it in the
``response`` object of its final ``response.completed`` event. That event holds the whole response (output
text, echoed instructions and tools), so it may outgrow the kept tail: the tail is then searched for the
last ``"usage":`` object, which vLLM writes near the end of the response object.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orjson

# The final usage event is a few hundred bytes; 16 KiB also covers a last content chunk + [DONE].
DEFAULT_TAIL_BYTES = 16 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def usage_from_json(obj: Any) -> Usage | None:
    """Usage of a decoded response object (None when it has no usage object)."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if u is None and isinstance(obj.get("response"), dict):  # a Responses stream event (response.completed)
        u = obj["response"].get("usage")
    return usage_of(u)


def usage_of(u: Any) -> Usage | None:
    """A decoded ``usage`` object (chat/completions or Responses names) as `Usage`; None when not an object."""
    if not isinstance(u, dict):
        return None
    if "prompt_tokens" in u or "completion_tokens" in u:
        details = u.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        return Usage(_int(u.get("prompt_tokens")), _int(u.get("completion_tokens")), cached)
    details = u.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(_int(u.get("input_tokens")), _int(u.get("output_tokens")), cached)


def usage_from_body(body: bytes) -> Usage | None:
    """Usage of a non-stream JSON response body; None for invalid JSON or no usage."""
    try:
        return usage_from_json(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


class StreamUsageTail:
    """Keeps the tail of an SSE response; `usage()` parses the last event that carries usage.

    Not thread-safe (one instance per request, fed in order).
    """

    __slots__ = ("_buf", "_max")

    def __init__(self, max_bytes: int = DEFAULT_TAIL_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_bytes

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        if len(self._buf) > 2 * self._max:  # trim rarely: amortised O(1) per byte
            del self._buf[: len(self._buf) - self._max]

    def ended(self) -> bool:
        """Whether the stream's own end is in the tail: a chat or completions stream's ``data: [DONE]``, or a
        Responses stream's terminal event. A client that closes then had its whole answer (the OpenAI SDK closes
        at ``[DONE]``, often before Envoy has read the server's end of stream)."""
        buf = self._buf
        return buf[-32:].rstrip().endswith(b"data: [DONE]") or any(e in buf for e in _TERMINAL_EVENTS)

    def usage(self) -> Usage | None:
        """Usage of the last ``data:`` event with a usage object, None when there is none."""
        for line in reversed(bytes(self._buf).splitlines()):
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                continue  # [DONE], or the cut-off start of the tail
            try:
                found = usage_from_json(orjson.loads(payload))
            except orjson.JSONDecodeError:
                continue
            if found is not None:
                return found
        return _last_usage_object(bytes(self._buf))


_TERMINAL_EVENTS = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")
_USAGE_KEY = b'"usage":'
_DECODER = json.JSONDecoder()  # stateless once built; building one costs more than decoding a usage object


def _last_usage_object(buf: bytes) -> Usage | None:
    """The last ``"usage": {...}`` object in `buf` that decodes (module docstring: an event longer than the
    tail). JSON escaping keeps a ``"usage":`` inside a string value from matching (its quotes are escaped)."""
    end = len(buf)
    decoder = _DECODER
    while True:
        i = buf.rfind(_USAGE_KEY, 0, end)
        if i < 0:
            return None
        rest = buf[i + len(_USAGE_KEY):].lstrip()
        if rest.startswith(b"{"):
            try:
                obj, _ = decoder.raw_decode(rest.decode("utf-8", "replace"))
            except ValueError:
                obj = None
            found = usage_of(obj)
            if found is not None:
                return found
        end = i


last_usage_object = _last_usage_object
"""Public name: the facts path parses the usage text Envoy's Lua filter took (extproc/envoy_facts.py)."""
