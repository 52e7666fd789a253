"""The `prefixroute` console script.

Each subcommand lives in its own module, imported only when that subcommand runs (so
`prefixroute model-server` does not pay for importing gRPC or Streamlit). A command module
exposes:

    def configure_parser(parser: argparse.ArgumentParser) -> None   # add flags (settings.add_arguments)
    def main(args: argparse.Namespace) -> int                        # run; return the exit code

Register new commands in COMMANDS below.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from prefixroute.grpc_runtime import apply_grpc_defaults

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "model-server": ("prefixroute.model_servers.cli", "Run a simulated vLLM-like GPU model server."),
    "model-server-bench": ("prefixroute.bench.model_server", "Measure the simulated server's own CPU cost."),
    "extproc": ("prefixroute.extproc.cli", "Run the ext_proc routing service that Envoy calls."),
    "envoy-config": ("prefixroute.extproc.envoy_config", "Render the Envoy configuration to stdout or a file."),
    "gateway": ("prefixroute.extproc.gateway", "Run Envoy + the ext_proc service in front of given endpoints."),
    "overhead-bench": ("prefixroute.bench.overhead", "Measure Envoy with vs without ext_proc."),
    "telemetry": ("prefixroute.telemetry.cli", "OTLP receiver + request store (`telemetry dump` prints records)."),
    "dashboard": ("prefixroute.dashboard.cli", "Serve the live Streamlit dashboard of hit rates, TTFT and load."),
    "dashboard-screenshot": ("prefixroute.dashboard.screenshot",
                             "Save a PNG of the running dashboard once its content has drawn (needs Playwright)."),
    "up": ("prefixroute.stack.cli", "Run the whole local stack: Envoy, ext_proc, model servers, telemetry, dashboard."),
    "traffic": ("prefixroute.stack.traffic", "Send a steady demo load through the gateway until stopped."),
    "bench": ("prefixroute.bench.cli", "Benchmark routers and policies on workloads or traces."),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixroute", description=__doc__.splitlines()[0] if __doc__ else None)
    from prefixroute import __version__

    parser.add_argument("--version", action="version", version=f"prefixroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).configure_parser(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before any command module imports grpc, which reads its settings once (grpc_runtime.py).
    apply_grpc_defaults()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
