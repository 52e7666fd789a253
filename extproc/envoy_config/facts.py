"""The facts path, Envoy's side: a response's facts taken in Envoy and sent to the router once per request.

- `RESPONSE_FACTS_LUA` (the Lua filter last before the router, so on the response path it sees each chunk first):
  scans the response's chunks as they pass, never buffering a body (``bodyChunks`` hands each chunk on at once), and
  writes into dynamic metadata: a Responses API stream's first token event time (`FIRST_TOKEN_KEY`, as the
  first-token filter of timing.py does), the response id (first ``"id":"resp..."`` of a JSON body or of an
  ``event:`` stream, within its first 64 KiB; chat streams are not searched) and the response's last
  ``"usage": {...}`` object as text: written as soon as a chunk carrying one passes (completed by the next chunk
  when cut at a chunk's end), and again at the body's end from the last `TAIL_BYTES` kept while chunks pass (a
  stream's final usage event, or the end of a JSON body). It also marks a response whose own end passed
  (`COMPLETE_KEY`: a stream's ``data: [DONE]``, a Responses stream's usage-carrying terminal event). Both matter
  when the client closes at its stream's end: the OpenAI SDK closes its connection at ``[DONE]``, often before
  Envoy reads the upstream's end of stream; the body's end then never comes to this filter, and Envoy flags the
  record DC although the client had its whole answer. Per chunk: one copy of the chunk (kept until the kept bytes
  outgrow 8 KiB, then cut to the last 4 KiB: no per-chunk concatenation, measured to cost ~0.3 ms of Envoy CPU on
  a 32-token stream) and plain searches for ``"usage"`` and ``[DONE]``.
- The early first token report (facts_fields.py, `FIRST_TOKEN_METHOD`): the same filter keeps the request's
  traceparent (set by the routing filter before it) in dynamic metadata, and at a stream's first token (a chat
  stream's first chunk, a Responses stream's first token event) makes one asynchronous ``httpCall`` (Envoy does not
  wait) to the replica that routed it: its cluster from the route's name (``... replica k``; the only replica's
  otherwise), whose upstream filters add the bearer token; the body is one hand-built gRPC frame holding the
  traceparent and, for a Responses stream answered 200, its response id (its ``response.created`` event precedes
  any token) and the served address. Only for routes the router picked (``picked_endpoint ...``) and
  ``text/event-stream`` responses.
- The early response id report (`RESPONSE_ID_METHOD`): a JSON Responses answer (not streamed) has no first token
  to report, so its id goes alone, in the same message, as soon as the filter sees it in the body's first bytes.
  Both reports let the router pin a follow-up sent the moment its previous response ended, before the record
  (which comes up to the flush interval later) arrives; without them such a follow-up was found by the
  directory's lookup fan-out instead.
- `facts_access_logs`: one ``envoy.access_loggers.open_telemetry`` logger per ext_proc replica, each sending the
  records of the requests that replica routed (a CEL filter on the route name: replica k's picks take the route
  ``picked_endpoint ... replica k``) to that replica's own gRPC port (the replica's ext_proc cluster, with its bearer
  token and TLS), where the router serves OTLP ``LogsService.Export`` (envoy_facts.py). The flush interval is set in
  ``common_config``: checked with Envoy 1.40, the logger's top-level ``buffer_flush_interval`` is ignored (records
  then waited for Envoy's 1 s default).

Field names: extproc/facts_fields.py (shared with the receiver).
"""

from __future__ import annotations

import warnings

from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog, AccessLogFilter, ExtensionFilter
from envoy_data_plane.envoy.config.core.v3 import ApiVersion, GrpcService, GrpcServiceEnvoyGrpc
from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import ExpressionFilter
from envoy_data_plane.envoy.extensions.access_loggers.grpc.v3 import CommonGrpcAccessLogConfig
from envoy_data_plane.envoy.extensions.access_loggers.open_telemetry.v3 import OpenTelemetryAccessLogConfig
from envoy_data_plane.google.protobuf import Any as ProtoAny
from envoy_data_plane.opentelemetry.proto.common.v1 import AnyValue, KeyValue, KeyValueList

from prefixroute.extproc.envoy_config.common import EXTPROC_CLUSTER, EXTPROC_REPLICA_CLUSTER_PREFIX, duration
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.facts_fields import (FACTS_ATTRIBUTES, FACTS_LOG_NAME, FACTS_NAMESPACE, FIRST_TOKEN_KEY,
                                              FIRST_TOKEN_METHOD, FIRST_TOKEN_TIMEOUT_MS, MAX_ID_SCAN_BYTES,
                                              MAX_USAGE_CHARS, RESPONSE_ID_KEY, RESPONSE_ID_METHOD, TAIL_BYTES,
                                              TIMING_NAMESPACE, TRACEPARENT_KEY, USAGE_KEY, COMPLETE_KEY)
from prefixroute.extproc.headers import SERVED_HEADER

RESPONSE_FACTS_LUA = f"""
-- A response's facts, taken once per request (extproc/envoy_config/facts.py).
function envoy_on_request(h)
  -- After the routing filter: its traceparent (the pick's key), for the early first token report.
  local tp = h:headers():get("traceparent")
  if tp ~= nil then
    h:streamInfo():dynamicMetadata():set("{FACTS_NAMESPACE}", "{TRACEPARENT_KEY}", tp)
  end
end

-- The early reports' sender for a request the router picked, or nil: report(method, id) makes one gRPC unary call,
-- sent asynchronously (Envoy waits for no answer), to the replica that routed it (its route's name). The message
-- is the traceparent (the pick's key), then, with a response id of a 200 answer, that id and the served address.
local function early_reporter(h)
  local route = h:streamInfo():routeName() or ""
  if string.sub(route, 1, 16) ~= "picked_endpoint " then return nil end
  local md = h:streamInfo():dynamicMetadata():get("{FACTS_NAMESPACE}")
  local tp = md and md["{TRACEPARENT_KEY}"]
  if tp == nil or #tp > 128 then return nil end
  local k = string.match(route, " replica (%d+)$")
  local cluster = k and ("{EXTPROC_REPLICA_CLUSTER_PREFIX}" .. k) or "{EXTPROC_CLUSTER}"
  -- Read now: the headers object does not outlive a yield.
  local ok = h:headers():get(":status") == "200"
  local served = string.sub(h:headers():get("{SERVED_HEADER}") or "", 1, 64)
  return function(method, id)
    local msg = tp
    if id ~= nil and ok and #id <= 128 then msg = tp .. "\\n" .. id .. "\\n" .. served end
    -- A gRPC frame: uncompressed, 4-byte big-endian length (under 64 KiB here), then the message.
    local n = #msg
    local frame = string.char(0, 0, 0, math.floor(n / 256), n % 256) .. msg
    h:httpCall(cluster, {{[":method"] = "POST", [":path"] = method,
      [":authority"] = cluster, ["content-type"] = "application/grpc", ["te"] = "trailers"}},
      frame, {FIRST_TOKEN_TIMEOUT_MS}, true)
  end
end

-- Where the last ``"usage": {{`` of `text` starts, or nil.
local function last_usage(text)
  local at = nil
  local from = 1
  while true do
    local s = string.find(text, '"usage"%s*:%s*{{', from)
    if s == nil then return at end
    at = s
    from = s + 1
  end
end

function envoy_on_response(h)
  -- Fetched at each use: a stream info object does not outlive a yield (the next body chunk).
  local function set(ns, key, value)
    h:streamInfo():dynamicMetadata():set(ns, key, value)
  end
  local ct = h:headers():get("content-type") or ""
  local sse = string.find(ct, "text/event-stream", 1, true) ~= nil
  local reporter = early_reporter(h)
  -- A streamed response the router picked for: its first token is reported at once (then nil).
  local report = sse and reporter or nil
  local found = nil   -- the response id, once found
  local first = true
  local events = nil  -- a Responses stream before its first token event: the last bytes seen
  local event_stream = false  -- a Responses stream (its first line is an event line)
  local head = nil    -- the first bytes, while the response id is searched for
  local scanned = 0
  -- The last bytes, as the chunks themselves: joined only when they outgrow twice the tail (O(chunk) per chunk).
  local parts, nparts, size = {{}}, 0, 0
  -- A usage object seen in the chunk that just passed (cut at that chunk's end): completed by the next chunk.
  local usage = nil
  for chunk in h:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      local text = chunk:getBytes(0, n)
      if first then
        first = false
        local ev = string.sub(text, 1, 6) == "event:"
        if sse and ev then events = "" event_stream = true end
        if ev or not sse then head = "" end
        -- A chat stream's first chunk is its first token (as on the observing stream): report it now.
        if report ~= nil and events == nil then
          report("{FIRST_TOKEN_METHOD}", nil)
          report = nil
        end
      end
      -- Before the first token check: a Responses stream's id (response.created) precedes its first token, and
      -- the first token report carries it (the router pins follow-ups before the record comes).
      if head ~= nil then
        local t = head .. text
        local id = string.match(t, '"id"%s*:%s*"(resp[^"]*)"')
        scanned = scanned + n
        if id ~= nil then
          found = string.sub(id, 1, 256)
          set("{FACTS_NAMESPACE}", "{RESPONSE_ID_KEY}", found)
          head = nil
          -- A JSON answer has no first token to report: its id goes alone, as soon as it is seen.
          if not sse and reporter ~= nil then reporter("{RESPONSE_ID_METHOD}", found) end
        elseif scanned >= {MAX_ID_SCAN_BYTES} then
          head = nil
        else
          head = string.sub(t, -300)
        end
      end
      if events ~= nil then
        -- An event line may straddle two chunks: keep the last bytes of the previous one.
        local t = events .. text
        if string.find(t, ".delta\\n", 1, true) ~= nil then
          set("{TIMING_NAMESPACE}", "{FIRST_TOKEN_KEY}", h:timestampString(EnvoyTimestampResolution.MICROSECOND))
          events = nil
          if report ~= nil then
            report("{FIRST_TOKEN_METHOD}", found)
            report = nil
          end
        else
          events = string.sub(t, -24)
        end
      end
      -- The usage, as soon as it passes: a client that has its answer may close before Envoy sees the stream's
      -- end (the OpenAI SDK closes at a stream's [DONE]), and then the loop below never ends.
      if usage ~= nil then
        set("{FACTS_NAMESPACE}", "{USAGE_KEY}", string.sub(usage .. text, 1, {MAX_USAGE_CHARS}))
        usage = nil
      end
      if string.find(text, '"usage"', 1, true) ~= nil then
        local at = last_usage(text)
        if at ~= nil then
          usage = string.sub(text, at, at + {MAX_USAGE_CHARS - 1})
          set("{FACTS_NAMESPACE}", "{USAGE_KEY}", usage)
          -- A Responses stream's usage comes in its terminal event (written whole, so in this chunk with its event
          -- line): the client has the whole answer.
          if event_stream and (string.find(text, "event: response.completed", 1, true) ~= nil or
              string.find(text, "event: response.incomplete", 1, true) ~= nil or
              string.find(text, "event: response.failed", 1, true) ~= nil) then
            set("{FACTS_NAMESPACE}", "{COMPLETE_KEY}", "1")
          end
        end
      end
      if sse and string.find(text, "data: [DONE]", 1, true) ~= nil then
        set("{FACTS_NAMESPACE}", "{COMPLETE_KEY}", "1")
      end
      nparts = nparts + 1
      parts[nparts] = text
      size = size + n
      if size > {2 * TAIL_BYTES} and nparts > 1 then
        local kept = string.sub(table.concat(parts, "", 1, nparts), -{TAIL_BYTES})
        parts = {{kept}}
        nparts = 1
        size = #kept
      end
    end
  end
  local tail = string.sub(table.concat(parts, "", 1, nparts), -{TAIL_BYTES})
  -- The last usage object of the tail (a stream's final usage event; the end of a JSON body).
  local at = last_usage(tail)
  if at ~= nil then
    set("{FACTS_NAMESPACE}", "{USAGE_KEY}", string.sub(tail, at, at + {MAX_USAGE_CHARS - 1}))
  end
end
"""


def facts_access_logs(s: EnvoySettings, replicas: tuple[str, ...]) -> list[AccessLog]:
    """The facts loggers, one per ext_proc replica (module docstring); none unless the facts path is on."""
    if not (s.extproc_enabled and s.response_facts_lua):
        return []
    if s.facts_flush_interval_ms <= 0:
        raise ValueError(f"facts_flush_interval_ms must be > 0, got {s.facts_flush_interval_ms}")
    attributes = KeyValueList(values=[KeyValue(key=k, value=AnyValue(string_value=v))
                                      for k, v in FACTS_ATTRIBUTES.items()])
    several = len(replicas) > 1
    logs = []
    for k in range(len(replicas)):
        cluster = f"{EXTPROC_REPLICA_CLUSTER_PREFIX}{k}" if several else EXTPROC_CLUSTER
        # Only requests the router picked for: Envoy's own replies and fail-open requests have no pick.
        expression = "xds.route_name.startsWith('picked_endpoint ')"
        if several:
            expression += f" && xds.route_name.endsWith(' replica {k}')"
        with warnings.catch_warnings():
            # Deprecated in the API, but Envoy 1.40 honours only this flush interval (module docstring).
            warnings.simplefilter("ignore", DeprecationWarning)
            config = OpenTelemetryAccessLogConfig(
                common_config=CommonGrpcAccessLogConfig(
                    log_name=FACTS_LOG_NAME, transport_api_version=ApiVersion.V3,
                    grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=cluster)),
                    buffer_flush_interval=duration(s.facts_flush_interval_ms / 1000)),
                attributes=attributes)
        logs.append(AccessLog(name="envoy.access_loggers.open_telemetry", typed_config=ProtoAny.pack(config),
                              filter=AccessLogFilter(extension_filter=ExtensionFilter(
                                  name="envoy.access_loggers.extension_filters.cel",
                                  typed_config=ProtoAny.pack(ExpressionFilter(expression=expression))))))
    return logs
