"""What a benchmark workload is: a `Workload`, a named, parameterised tuple of `RequestSpec` in send order.

A `RequestSpec` knows the OpenAI body it is sent as (`body`: chat or completions; `responses_body`: the same turn
in Responses API form) and its place in the sequence (`arrival_s`, `after_index`). Workloads are built by
bench/workloads.py (synthetic), bench/agents_workload.py (tool-calling agents) and bench/traces.py (Mooncake
traces); nothing here builds one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

CHARS_PER_TOKEN = 4
"""The simulated servers' tokenizer averages ~4 characters per token (see model_servers tokenizer)."""


def check_positive(**values: float) -> None:
    """ValueError unless every value is >= 0, and > 0 for a ``num_*`` one (a workload generator's sizes)."""
    for k, v in values.items():
        if v is None or v < 0 or (k.startswith("num_") and v == 0):
            raise ValueError(f"{k} must be {'> 0' if k.startswith('num_') else '>= 0'}, got {v}")


@dataclasses.dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, in send order.

    Exactly one of `messages` (chat, sent to /v1/chat/completions) and `prompt` (sent to
    /v1/completions) is set. `arrival_s` is seconds from the start of the run, None under closed-loop
    arrivals. `group_id` names the shared prefix the request belongs to (prompt group, document,
    session or first trace block) for analysis; `after_index` is the index of a request that must
    finish before this one is sent (previous turn of a session); `think_s` is how long after that request ends the
    client waits before sending this one (an agent's tool call running), so a follow-up goes at its arrival
    time or `think_s` after its previous turn, whichever is later.

    Tool-calling requests (the ``agents`` workload) also carry `tools` (chat form: ``{"type": "function",
    "function": {...}}``) and `tool_choice`, sent with `messages` on /v1/chat/completions, and `responses`: the
    same turn in Responses API form (``instructions``, this turn's ``input`` items, flat ``tools``,
    ``tool_choice``), sent by `responses_body` on /v1/responses. `messages` is then exactly the chat prompt the
    server builds for the Responses form (`prefixroute.responses_prompt.input_messages` over the stored chain), so
    the chat and Responses forms of a conversation are the same prompts and one upper bound covers both.
    """

    index: int
    max_tokens: int
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    arrival_s: float | None = None
    group_id: str = ""
    session_id: str | None = None
    turn: int = 0
    after_index: int | None = None
    think_s: float = 0.0
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | None = None
    responses: dict[str, Any] | None = None

    def num_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m["content"]) for m in self.messages or () if isinstance(m.get("content"), str))

    def approx_prompt_tokens(self) -> int:
        """Prompt tokens without template overhead (chars / 4); the server's count is authoritative."""
        return self.num_chars() // CHARS_PER_TOKEN

    def body(self, model: str) -> dict[str, Any]:
        """The OpenAI request body: streaming with a final usage chunk, exactly max_tokens generated."""
        b: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "stream": True,
                             "stream_options": {"include_usage": True}, "ignore_eos": True,
                             "temperature": 0.0}
        if self.messages is not None:
            b["messages"] = [dict(m) for m in self.messages]
            if self.tools:
                b["tools"] = [dict(t) for t in self.tools]
            if self.tool_choice is not None:
                b["tool_choice"] = self.tool_choice
        else:
            b["prompt"] = self.prompt
        return b

    def responses_body(self, model: str, previous_response_id: str | None = None,
                       call_id: str | None = None) -> dict[str, Any]:
        """The ``POST /v1/responses`` body of this turn (streaming, stored, exactly max_tokens generated).

        A follow-up names `previous_response_id` (the response of its `after_index` request, known only at
        send time) and answers that response's function call: `call_id` replaces the placeholder call id of
        its ``function_call_output`` items. ValueError when the request has no Responses form."""
        if self.responses is None:
            raise ValueError(f"request {self.index} has no Responses API form")
        form = self.responses
        inp = [dict(item) for item in form["input"]]
        if call_id is not None:
            for item in inp:
                if item.get("type") == "function_call_output":
                    item["call_id"] = call_id
        b: dict[str, Any] = {"model": model, "input": inp, "stream": True, "store": True,
                             "max_output_tokens": self.max_tokens, "temperature": 0.0}
        if form.get("instructions"):
            b["instructions"] = form["instructions"]
        if form.get("tools"):
            b["tools"] = [dict(t) for t in form["tools"]]
        if form.get("tool_choice") is not None:
            b["tool_choice"] = form["tool_choice"]
        if previous_response_id is not None:
            b["previous_response_id"] = previous_response_id
        return b

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named, parameterised request sequence. `params` is JSON-able and goes into results.json."""

    name: str
    params: dict[str, Any]
    requests: tuple[RequestSpec, ...]

    def describe(self) -> dict[str, Any]:
        reqs = self.requests
        timed = [r.arrival_s for r in reqs if r.arrival_s is not None]
        return {
            "name": self.name,
            **self.params,
            "num_requests": len(reqs),
            "mean_prompt_tokens_approx": round(sum(r.approx_prompt_tokens() for r in reqs) / max(1, len(reqs)), 1),
            "total_output_tokens": sum(r.max_tokens for r in reqs),
            "duration_s": round(max(timed) - min(timed), 3) if timed else None,
        }
