"""prefixroute: a prefix-aware router for LLM inference fleets (Envoy ext_proc)."""

__version__ = "0.1.0"
