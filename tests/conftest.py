"""The suite runs gRPC as prefixroute's console script does: ``GRPC_EXPERIMENTS`` set before anything imports grpc
(common/grpc_runtime.py), so in-process servers and every child started from a test run one configuration,
whatever order the tests run in. A ``GRPC_EXPERIMENTS`` already in the environment is kept."""

from prefixroute.grpc_runtime import apply_grpc_defaults

apply_grpc_defaults()
