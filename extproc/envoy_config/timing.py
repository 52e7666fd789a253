"""Exact response timing from Envoy's clock, for Envoy's request records (records.py) and the telemetry store.

What a record carries (RECORD_ATTRIBUTES), all measured by Envoy, none by the router's event loop:
- ``prefixroute.ttft_us``: from the first byte of the request received (``DS_RX_BEG``) to the first body byte of the
  upstream response (``US_RX_BODY_BEG``), in microseconds. A vLLM (or our simulated) chat or completion stream sends
  its first body bytes with the first token (the role chunk is written with it), and a non-streamed response's
  body comes whole at its end: so this is the time to the first body byte that holds a token.
- ``prefixroute.first_token_us``: only for Responses API streams, whose first events (``response.created``,
  ``response.in_progress``, item announcements) precede any token: the wall-clock time (unix microseconds, Envoy's
  system clock, the clock of ``START_TIME``) at which the first token event (an ``event: ...delta`` line) passed
  through Envoy, stamped by `FIRST_TOKEN_LUA` as dynamic metadata. Absent for every other response.
- ``prefixroute.duration_us``: from ``DS_RX_BEG`` to the last byte sent to the client (``DS_TX_END``).

The Lua filter sits just before the router, so on the response path it sees each chunk before the ext_proc filters
do. It never buffers (``bodyChunks`` hands each chunk on at once) and stops at the first non-empty chunk of any
response that is not a Responses API stream (content type ``text/event-stream`` and a first line ``event:``), so a
chat stream costs it one coroutine and a 6-byte read, and nothing per later chunk.

`RESPONSE_FACTS_LUA` is a prototype measured by `prefixroute overhead-bench --variants lua-facts` (docs/benchmarks.md,
"Router overhead"): the facts the observing ext_proc filter now sends to the router chunk by chunk (first body byte
time, usage with cached tokens, response id), taken in Envoy and written once into its request record. The router
does not read them: that is the router-side work it would need (docs/benchmarks.md).
"""

from __future__ import annotations

from envoy_data_plane.envoy.config.core.v3 import DataSource
from envoy_data_plane.envoy.extensions.filters.http.lua.v3 import Lua
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpFilter
from envoy_data_plane.google.protobuf import Any as ProtoAny

TIMING_FILTER = "prefixroute.first_token_time"
TIMING_NAMESPACE = "prefixroute.timing"
FIRST_TOKEN_KEY = "first_token_us"

FIRST_TOKEN_LUA = f"""
-- Stamps the time the first token event of a Responses API stream passed (see extproc/envoy_config/timing.py).
function envoy_on_response(h)
  local ct = h:headers():get("content-type")
  if ct == nil or string.find(ct, "text/event-stream", 1, true) == nil then
    return
  end
  local tail = nil
  for chunk in h:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      if tail == nil then
        if chunk:getBytes(0, math.min(n, 6)) ~= "event:" then
          return
        end
        tail = ""
      end
      -- An event line may straddle two chunks: keep the last bytes of the previous one.
      local text = tail .. chunk:getBytes(0, n)
      if string.find(text, ".delta\\n", 1, true) ~= nil then
        h:streamInfo():dynamicMetadata():set("{TIMING_NAMESPACE}", "{FIRST_TOKEN_KEY}",
                                              h:timestampString(EnvoyTimestampResolution.MICROSECOND))
        return
      end
      tail = string.sub(text, -24)
    end
  end
end
"""

FACTS_NAMESPACE = "prefixroute.facts"
RESPONSE_FACTS_LUA = f"""
-- PROTOTYPE (overhead-bench --variants lua-facts): a response's facts taken in Envoy, once per request.
function envoy_on_response(h)
  -- Fetched at each use: a stream info object does not outlive a yield (the next body chunk).
  local function set(key, value)
    h:streamInfo():dynamicMetadata():set("{FACTS_NAMESPACE}", key, value)
  end
  local tail = nil
  for chunk in h:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      local text = chunk:getBytes(0, n)
      if tail == nil then
        set("first_body_us", h:timestampString(EnvoyTimestampResolution.MICROSECOND))
        local id = string.match(text, '"id":"([^"]+)"')
        if id ~= nil then
          set("response_id", id)
        end
        tail = ""
      end
      -- The usage event is the stream's last but [DONE]: the last 1 KiB holds it.
      tail = string.sub(tail .. text, -1024)
    end
  end
  if tail ~= nil then
    local p = string.match(tail, '"prompt_tokens":(%d+)')
    if p ~= nil then
      set("prompt_tokens", p)
      set("cached_tokens", string.match(tail, '"cached_tokens":(%d+)') or "0")
    end
  end
end
"""
FACTS_ATTRIBUTES = {f"prefixroute.{k}": f"%DYNAMIC_METADATA({FACTS_NAMESPACE}:{k})%"
                    for k in ("first_body_us", "response_id", "prompt_tokens", "cached_tokens")}
"""Envoy's record attributes of the facts prototype (`RESPONSE_FACTS_LUA`)."""

TIMING_ATTRIBUTES = {
    "prefixroute.ttft_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",
    "prefixroute.first_token_us": f"%DYNAMIC_METADATA({TIMING_NAMESPACE}:{FIRST_TOKEN_KEY})%",
    "prefixroute.duration_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
    # The routing filter's traceparent (the router's span): Envoy's record joins the router's by it.
    "prefixroute.traceparent": "%REQ(TRACEPARENT)%",
}
"""Envoy's record attributes for the timing (module docstring); `records.RECORD_ATTRIBUTES` includes them."""


def timing_filter(response_facts: bool = False) -> HttpFilter:
    """The Lua filter that stamps a Responses API stream's first token time (module docstring); with
    `response_facts`, the prototype that takes every response's facts instead (`RESPONSE_FACTS_LUA`)."""
    code = RESPONSE_FACTS_LUA if response_facts else FIRST_TOKEN_LUA
    return HttpFilter(name=TIMING_FILTER, typed_config=ProtoAny.pack(Lua(default_source_code=DataSource(
        inline_string=code))))
