"""The simulated model server's settings (`ServerSettings`: ``prefixroute model-server --help``, env
PREFIXROUTE_MODEL_SERVER_*). The engine's part of them builds an `EngineSpec` (profiles.py)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from prefixroute.model_servers import kv_events_publisher
from prefixroute.model_servers.profiles import DEFAULT_PROFILE, PROFILES
from prefixroute.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class ServerSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_MODEL_SERVER_"
    TITLE: ClassVar[str] = "Simulated model server"

    host: str = setting("127.0.0.1", "Address to listen on (loopback: the simulation never needs more).")
    port: int = setting(8000, "TCP port to listen on (vLLM's default port).")
    id: str = setting("", "Server id returned in x-prefixroute-server-id (default: host:port).")
    profile: str = setting(DEFAULT_PROFILE, f"Model/GPU profile: {', '.join(PROFILES)}. Sets the cost model, "
                                            "KV capacity and served model name.")
    served_model_name: str = setting("", "Model name served (default: the profile's Hugging Face name).")
    lora_modules: tuple[str, ...] = setting((), "LoRA adapter names also served (comma-separated); the adapter "
                                                "name is part of the block hash, like vLLM.")
    num_gpu_blocks: int | None = setting(None, "KV cache capacity in blocks (default: from the profile's GPU "
                                              "memory after weights, e.g. 52,852 for the 8B profile).")
    block_size: int = setting(16, "Tokens per KV block (vLLM's default on CUDA).")
    kv_offloading_size: float | None = setting(None, "Host-memory (CPU) KV tier in GiB, vLLM's "
                                                    "--kv-offloading-size (total over TP ranks): blocks the GPU "
                                                    "evicts are kept there under their own LRU, loaded back on a "
                                                    "prefix hit at the H200's host-link bandwidth (55 GB/s), and "
                                                    "published as KV events with medium CPU. Empty = no "
                                                    "offloading (vLLM's default).")
    kv_offloading_backend: str = setting("native", "vLLM's --kv-offloading-backend: only 'native' (vLLM's own "
                                                   "CPU offloading) is simulated.")
    max_num_seqs: int = setting(256, "Most requests running at once (vLLM's default).")
    max_num_batched_tokens: int = setting(8192, "Token budget per engine step, chunked prefill above it "
                                                "(vLLM's default for online serving on an H100/H200).")
    max_model_len: int | None = setting(None, "Context window in tokens (default: the profile's 131,072, "
                                              "capped at the KV capacity).")
    default_max_tokens: int = setting(16, "Tokens generated when a request sets no max_tokens (the simulated "
                                          "model never stops early; 16 is OpenAI's completions default).")
    time_scale: float = setting(1.0, "Multiplier on modelled step times (1.0 = calibrated H200 time; 0.1 makes "
                                     "the simulated GPU 10x faster for quick tests; 0 = no GPU time).")
    fail_ratio: float = setting(0.0, "Fraction of generation requests answered with a 500 (fault injection).")
    extra_latency_ms: float = setting(0.0, "Latency added before each generation request enters the engine.")
    refuse_connections: bool = setting(False, "Start with the serving socket closed (toggle with SIGUSR1 or "
                                              "POST /admin/faults on the admin listener).")
    admin_port: int = setting(-1, "Port of the separate admin listener that serves GET|POST /admin/faults "
                                  "(runtime fault injection): -1 = no admin listener (the default: nothing "
                                  "can change faults at runtime except SIGUSR1), 0 = a free port (printed as "
                                  "`ADMIN host:port` before `READY`), N = that port. Never the serving port: "
                                  "a gateway forwarding a client's /admin/faults must not reach it.")
    admin_host: str = setting("127.0.0.1", "Address of the admin listener (loopback: only processes on this "
                                           "host, such as tests and benches, can inject faults).")
    max_stream_buffer_bytes: int = setting(256 * 1024, "Most bytes of one response held in this process for a "
                                                       "client that does not read (beyond the kernel's socket "
                                                       "buffers); past it the request is aborted and its KV "
                                                       "blocks freed. 256 KiB is ~1,200 SSE token chunks (~6 s "
                                                       "of an 8B decode at 200 tokens/s): a reading client "
                                                       "never comes near it, and 1,000 stalled clients hold at "
                                                       "most 256 MiB.")
    stall_timeout_s: float = setting(30.0, "How long a connection may stay write-paused (its client reads "
                                           "nothing, or too little to drain the buffer) before its request is "
                                           "aborted and the connection reset. 30 s: far above any pause of a "
                                           "live client (GC, TCP retransmits), short enough that a dead one "
                                           "frees its KV blocks before a slow generation fills the buffer. "
                                           "0 = no stall limit (the buffer limit alone).")
    shutdown_grace_s: float = setting(2.0, "On SIGTERM, how long in-flight requests may finish before their "
                                           "connections are closed (short: tests restart servers often).")
    max_body_bytes: int = setting(16 * 1024 * 1024, "Largest request body accepted; larger ones get a 413 and "
                                                     "the connection is closed (16 MiB: 30x a full 131k-token "
                                                     "prompt as JSON).")
    responses_store: bool = setting(True, "Keep finished Responses API responses (body `store`, default true) in "
                                          "this process's memory so `previous_response_id` follow-ups and GET "
                                          "/v1/responses/{id} find them (vLLM with "
                                          "VLLM_ENABLE_RESPONSES_API_STORE=1). Off: nothing is stored, like "
                                          "vLLM's default; every follow-up gets a 404. The store empties when "
                                          "the process restarts.")
    responses_store_max_entries: int = setting(10_000, "Most responses kept (least recently used evicted "
                                                       "first; a follow-up refreshes its previous response). "
                                                       "10,000 holds e.g. 500 live agent sessions of 20 turns.")
    responses_store_max_bytes: int = setting(256 * 1024 * 1024, "Most bytes kept in the response store, counted "
                                                                "as the JSON of each entry (the messages its "
                                                                "request rendered plus the response). Each turn "
                                                                "stores its whole conversation, so a session's "
                                                                "entries grow with its length: 256 MiB holds "
                                                                "~5,000 turns of 50 KB (~12k-token) contexts. An "
                                                                "evicted id answers 404, as after a restart.")
    listen_fd: int = setting(-1, "Serve on this inherited listening socket instead of binding host:port (a launcher "
                                 "that holds the port across this server's restarts, so no other process can take "
                                 "it while this one is down: `prefixroute up`). -1: bind host:port.")
    seed: int = setting(0, "Seed of the fault-injection random generator (reproducible runs).")
    log_level: str = setting("INFO", "Python log level: INFO logs start-up and rare events (a prefix-cache reset, "
                             "an aborted slow client at WARNING); per-request logs are DEBUG.")
    kv_events_config: str = setting(
        "", "KV-cache events, as vLLM's --kv-events-config JSON: e.g. '{\"enable_kv_cache_events\": true, "
            "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", "
            "\"topic\": \"kv-events\"}' (also buffer_steps 10000, hwm 100000, max_queue_size 100000: vLLM's keys "
            "and defaults; an unknown key is a startup error). An endpoint with '*' or '::' is bound, any other "
            "is connected to, like vLLM: 'tcp://*:P' binds every interface, 'tcp://[::ffff:127.0.0.1]:P' "
            "loopback (as real vLLM binds it; 'tcp://[::1]:P' does not bind in ZMQ), 'tcp://127.0.0.1:*' "
            "loopback at a free port, printed as KV_EVENTS (a plain 'tcp://127.0.0.1:P' is bound here with a "
            "warning: vLLM connects to it). Empty = no events (vLLM's default).")

    def __post_init__(self) -> None:
        kv_events_publisher.parse_config(self.kv_events_config)  # a bad config fails at startup, with its reason
        if self.kv_offloading_backend != "native":
            raise ValueError(f"--kv-offloading-backend {self.kv_offloading_backend!r} is not simulated; only "
                             "'native'")
        if self.kv_offloading_size is not None and self.kv_offloading_size < 0:
            raise ValueError(f"--kv-offloading-size must be >= 0 GiB; got {self.kv_offloading_size}")
        if self.responses_store_max_entries < 1 or self.responses_store_max_bytes < 1:
            raise ValueError("responses_store_max_entries and responses_store_max_bytes must be >= 1")
