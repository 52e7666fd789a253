"""prefixroute: a prefix-aware router for LLM inference fleets (Envoy ext_proc)."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("prefixroute")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
