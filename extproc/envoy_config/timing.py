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

On the facts path (`response_facts_lua`) the facts filter of facts.py takes this filter's place: it stamps the same
first token time, and takes the rest of a response's facts for the router.
"""

from __future__ import annotations

from envoy_data_plane.envoy.config.core.v3 import DataSource
from envoy_data_plane.envoy.extensions.filters.http.lua.v3 import Lua
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpFilter
from envoy_data_plane.google.protobuf import Any as ProtoAny

from prefixroute.extproc.envoy_config.facts import RESPONSE_FACTS_LUA
from prefixroute.extproc.facts_fields import FIRST_TOKEN_KEY, TIMING_NAMESPACE

TIMING_FILTER = "prefixroute.first_token_time"

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
    `response_facts`, the facts path's filter that takes every response's facts as well (facts.py)."""
    code = RESPONSE_FACTS_LUA if response_facts else FIRST_TOKEN_LUA
    return HttpFilter(name=TIMING_FILTER, typed_config=ProtoAny.pack(Lua(default_source_code=DataSource(
        inline_string=code))))
