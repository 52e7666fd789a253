"""The gateway: Envoy in front, our ext_proc endpoint picker beside it.

Modules:
- `servicer`: the gRPC `ExternalProcessor.Process` servicer; a thin translation to a `RouterService` (flow,
  processing modes and when in-flight is released: its docstring).
- `wire`: the ext_proc protobuf classes (upb), built from extproc/proto/ into a private descriptor pool.
- `service`: `PoolRouter`, the RouterService over `routing.RouterCore` + `endpoints.EndpointPool`.
- `server`, `cli`: the grpc.aio server and `prefixroute extproc`.
- `envoy_config`: renders the Envoy bootstrap (`prefixroute envoy-config`; committed as `envoy/envoy.yaml`);
  failover (composite cluster of ORIGINAL_DST sub-clusters), spoof protection and the ext_proc-down
  behaviour are described there.
- `gateway`: `GatewayProcesses` (Envoy + ext_proc as children) and `prefixroute gateway`.
- `overhead_bench`, `http_load`, `fast_upstream`: `prefixroute overhead-bench`.
"""
