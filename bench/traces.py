"""Mooncake-format traces as benchmark workloads: parse and validate a JSONL trace (`load_trace`), slice it,
and turn its records into requests (`trace_workload`: one deterministic text block per hash id, arrival times
from the timestamps); `write_trace` writes the same shape (tests, small samples)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from prefixroute.bench.synthetic_text import block_text, partial_block_text
from prefixroute.bench.workload_spec import RequestSpec, Workload

TRACE_BLOCK_TOKENS = 512
"""Mooncake-format traces give one hash id per 512-token block of prompt."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRecord:
    """One line of a Mooncake-format trace (lengths in tokens, timestamp in ms from trace start)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceFormatError(ValueError):
    """A trace line is not of the Mooncake shape; the message names the line."""


def parse_trace_line(line: str, line_no: int = 0, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRecord:
    """Parse and validate one JSON line. Raises TraceFormatError (with the line number) on bad input.

    Contract: ``block_tokens * (len(hash_ids) - 1) < input_length <= block_tokens * len(hash_ids)``
    (the last block is partial) -- a longer input would have no text for its tail.
    """
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise TraceFormatError(f"trace line {line_no}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"trace line {line_no}: expected a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise TraceFormatError(f"trace line {line_no}: missing {key!r}")
    ts, ids = obj["timestamp"], obj["hash_ids"]
    ints = (obj["input_length"], obj["output_length"], *(ids if isinstance(ids, list) else ()))
    # bool is an int subclass in Python; a JSON true is not a length.
    if (not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(ids, list)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in ints)):
        raise TraceFormatError(f"trace line {line_no}: timestamp must be a number, input_length/output_length "
                               f"integers and hash_ids a list of integers")
    rec = TraceRecord(float(ts), obj["input_length"], obj["output_length"], tuple(ids))
    if (not rec.hash_ids or rec.input_length <= 0 or rec.output_length < 0 or not math.isfinite(rec.timestamp_ms)
            or rec.timestamp_ms < 0):
        raise TraceFormatError(f"trace line {line_no}: empty hash_ids, negative length or bad timestamp")
    n = len(rec.hash_ids)
    if not block_tokens * (n - 1) < rec.input_length <= block_tokens * n:
        raise TraceFormatError(f"trace line {line_no}: input_length {rec.input_length} does not fit "
                               f"{n} blocks of {block_tokens} tokens")
    return rec


def load_trace(path: str | Path, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRecord]:
    """Read a Mooncake-format JSONL trace (blank lines skipped), in file order."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for no, line in enumerate(fh, 1):
            if line.strip():
                records.append(parse_trace_line(line, no, block_tokens))
    return records


def slice_trace(records: Sequence[TraceRecord], *, start: int = 0, stop: int | None = None,
                start_s: float | None = None, end_s: float | None = None) -> list[TraceRecord]:
    """Take records[start:stop], then keep those with start_s <= timestamp < end_s (seconds)."""
    out = list(records[start:stop])
    if start_s is not None:
        out = [r for r in out if r.timestamp_ms >= start_s * 1000.0]
    if end_s is not None:
        out = [r for r in out if r.timestamp_ms < end_s * 1000.0]
    return out


def trace_prompt(rec: TraceRecord, seed: int = 0, block_tokens: int = TRACE_BLOCK_TOKENS) -> str:
    """The prompt text of a record: one deterministic block per hash id, the last block partial."""
    last_tokens = rec.input_length - block_tokens * (len(rec.hash_ids) - 1)
    parts = [block_text(seed, "h", h, block_tokens) for h in rec.hash_ids[:-1]]
    parts.append(partial_block_text(seed, "h", rec.hash_ids[-1], last_tokens, block_tokens))
    return "".join(parts)


def trace_workload(records: Sequence[TraceRecord], *, seed: int = 0, time_scale: float = 1.0,
                   max_output_tokens: int | None = None, api: Literal["chat", "completions"] = "chat",
                   block_tokens: int = TRACE_BLOCK_TOKENS, source: str = "",
                   slice_params: dict[str, Any] | None = None) -> Workload:
    """Requests from trace records; arrival_s = (timestamp - first timestamp) / 1000 x time_scale.

    time_scale < 1 compresses time (0.5 = twice the rate). The prompt is a single user message (chat)
    or a raw prompt (completions); output lengths can be capped by max_output_tokens.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    t0 = min((r.timestamp_ms for r in records), default=0.0)
    reqs = []
    for i, rec in enumerate(records):
        text = trace_prompt(rec, seed, block_tokens)
        out = max(1, rec.output_length if max_output_tokens is None else min(rec.output_length, max_output_tokens))
        arrival = (rec.timestamp_ms - t0) / 1000.0 * time_scale
        common = dict(index=i, max_tokens=out, arrival_s=arrival, group_id=f"block-{rec.hash_ids[0]}")
        if api == "chat":
            reqs.append(RequestSpec(messages=({"role": "user", "content": text},), **common))
        else:
            reqs.append(RequestSpec(prompt=text, **common))
    return Workload("trace", {"source": source, "time_scale": time_scale, "max_output_tokens": max_output_tokens,
                              "api": api, "seed": seed, **(slice_params or {})}, tuple(reqs))


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    """Write records in the Mooncake JSONL shape (used by tests and to ship small samples)."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            ts = int(r.timestamp_ms) if float(r.timestamp_ms).is_integer() else r.timestamp_ms
            fh.write(json.dumps({"timestamp": ts, "input_length": r.input_length,
                                 "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
