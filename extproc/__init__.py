"""The gateway: Envoy in front, our ext_proc endpoint picker beside it.

Modules:
- `servicer`: the gRPC `ExternalProcessor.Process` servicer (upb protobuf classes from xds-protos); a thin
  translation to a `RouterService` (flow, processing modes and when in-flight is released: its docstring).
- `service`: `PoolRouter`, the RouterService over `routing.RouterCore` + `endpoints.EndpointPool`.
- `server`, `cli`: the grpc.aio server and `prefixroute extproc`.
- `envoy_config`: renders the Envoy bootstrap (`prefixroute envoy-config`; committed as `envoy/envoy.yaml`);
  failover (composite cluster of ORIGINAL_DST sub-clusters), spoof protection and the ext_proc-down
  behaviour are described there.
- `gateway`: `GatewayProcesses` (Envoy + ext_proc as children) and `prefixroute gateway`.
- `overhead_bench`, `http_load`, `fast_upstream`: `prefixroute overhead-bench`.
"""
