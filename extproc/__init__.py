"""The gateway: Envoy in front, our ext_proc endpoint picker beside it.

Modules:
- `servicer`: the gRPC `ExternalProcessor.Process` servicer; a thin translation to a `RouterService` (flow,
  processing modes and when in-flight is released: its docstring).
- `gie`: the Gateway API Inference Extension's endpoint picker protocol on one stream (FULL_DUPLEX_STREAMED
  bodies collected, decided on, echoed; responses passed back and measured), chosen per stream by the servicer;
  `gie_reference`: GIE's own reference Envoy configuration (gie_reference.yaml, verbatim) adapted to run here.
- `answers`: the ext_proc answers both protocols give (ImmediateResponse refusals, traceparent).
- `health`: the gRPC health service (grpc.health.v1: liveness, readiness, ExternalProcessor).
- `wire`: the ext_proc and health protobuf classes (upb), built from extproc/proto/ into a private descriptor pool.
- `service`: `PoolRouter`, the RouterService over `routing.RouterCore` + an `endpoints.Pool` (the live
  `EndpointPool`, or the benchmarks' virtual-time `SimulatedPool`: one code path for both).
- `headers`: the protocol names (headers, metadata keys) shared by the hot path and the Envoy configuration.
- `tracking`: per-request telemetry state joining the routing stream and the observing stream.
- `server`, `cli`: the grpc.aio server and `prefixroute extproc`.
- `envoy_config`: builds the Envoy bootstrap from envoy-data-plane's typed messages and renders it as YAML
  (`prefixroute envoy-config`; committed as `envoy/envoy.yaml`); never imported by the ext_proc process;
  failover (composite cluster of ORIGINAL_DST sub-clusters), spoof protection and the ext_proc-down
  behaviour are described there.
- `gateway`: `GatewayProcesses` (Envoy + ext_proc as children) and `prefixroute gateway`.
- `routing/`: the pure routing core; `endpoints/`: the live endpoint pool.

Benchmarks of this layer (`prefixroute overhead-bench`, `python -m prefixroute.bench.decision`) live in
`prefixroute.bench`.
"""
