"""The Envoy gateway's settings (`EnvoySettings`: ``prefixroute envoy-config --help``, env PREFIXROUTE_ENVOY_*)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from prefixroute.settings import Settings, setting

DEFAULT_ALLOWED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models",
                         "/tokenize", "/detokenize")
DEFAULT_ALLOWED_PATH_PREFIXES = ("/v1/responses/", "/v1/models/")


ROUTING_PROCESSING_ALIASES = {"ext_authz_http": "authz-http", "ext_authz": "authz", "ext_proc": "buffered"}
"""The routing filters' names (as `prefixroute gateway --routing-filter` and the docs say them) accepted for
`EnvoySettings.routing_processing`, and the processing option each stands for."""


@dataclasses.dataclass(frozen=True)
class EnvoySettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_ENVOY_"
    TITLE: ClassVar[str] = "Envoy gateway configuration"

    gateway_port: int = setting(8080, "Port clients send OpenAI requests to (8080: the usual unprivileged HTTP port).")
    listen_address: str = setting("0.0.0.0", "Address the gateway listens on (all interfaces, so a container's "
                                  "published port reaches it; use 127.0.0.1 to keep it local).")
    admin_port: int = setting(9901, "Envoy admin port, bound to 127.0.0.1 only (9901: Envoy's customary port); "
                              "admin_mode loopback.")
    admin_mode: str = setting("loopback", "Envoy's admin interface: loopback (127.0.0.1:admin_port, read-only paths "
                              "only: stats, ready, clusters, listeners, server_info; every local user can reach "
                              "loopback), unix (every path, on the Unix socket admin_socket_path, mode 0600: only "
                              "its owner), or off (no admin; health_path still answers).")
    admin_socket_path: str = setting("", "Unix socket of the admin interface when admin_mode is unix; put it in a "
                                     "folder only its owner can enter.")
    health_path: str = setting("/healthz", "Path Envoy answers itself on the gateway listener with 200 "
                               "{\"status\": \"ok\"} (GET; no router, no endpoint): a supervisor's probe that the "
                               "listener serves (a drained listener fails it). Empty: none.")
    extproc_address: str = setting("127.0.0.1:9002", "host:port of the ext_proc routing service "
                                   "(9002: the port the endpoint-picker reference uses).")
    extproc_replica_addresses: tuple[str, ...] = setting(
        (), "host:port of each ext_proc replica, in replica index order (replica k is started with --replica-index "
        "k); two or more replace extproc_address: Envoy spreads routing streams over them (least request, a "
        "refused or dead replica retried on another) and sends each request's observing stream to the replica "
        "that routed it (the x-prefixroute-replica header it sets selects the route). Empty = extproc_address "
        "alone.")
    authz_body_bytes: int = setting(
        1024 * 1024, "Routed by ext_authz ('authz', 'authz-http'): the most of a request body the filter sends the "
        "router whole; a larger body is sent in part (its first authz_body_bytes) and the router hands the request "
        "to the ext_proc filter, which sends it whole (max_request_body_bytes bounds it there: 413 above). 1 MiB: "
        "the router's inline_parse_bytes, above which it parses a body in its worker and so hands it off anyway; "
        "the body then crosses to the router once in full, not twice.")
    extproc_authz_http_addresses: tuple[str, ...] = setting(
        (), "host:port of each replica's ext_authz HTTP port (the service's authz_http_port), in replica index order, "
        "for routing_processing 'authz-http'. Empty = each ext_proc address's host at port 9004.")
    endpoints: tuple[str, ...] = setting(
        ("127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"),
        "Model-server endpoints host:port for the fail-open round-robin route (the same list the ext_proc "
        "service is given; four local simulated servers by default).")
    failure_mode: str = setting("open", "What happens when the ext_proc service is down or times out: 'open' = "
                                "round-robin over the configured endpoints (availability beats affinity), "
                                "'closed' = OpenAI-format 503.")
    extproc_message_timeout_ms: int = setting(500, "How long Envoy waits for one ext_proc answer before applying "
                                              "failure_mode (decisions take ~1 ms; 500 ms absorbs GC pauses and "
                                              "CPU contention yet fails open fast when the picker hangs).")
    extproc_max_hold_s: float = setting(
        90.0, "Longest Envoy lets the ext_proc service extend one answer (its max_message_timeout): while the fleet "
        "is saturated the service holds a request in its queue (flow control) and asks Envoy, per request, to wait "
        "up to that request's queue deadline (override_message_timeout); every other answer keeps "
        "extproc_message_timeout_ms. 90 s is above the default queue deadline (30 s) and any deadline header a "
        "client may send beyond it is cut here; it must stay under request_timeout_s, which also runs while a "
        "request is held. 0 = no extension (flow control's holds then fail over after extproc_message_timeout_ms: "
        "turn flow control off).")
    max_request_body_bytes: int = setting(8 * 1024 * 1024, "Largest request body; larger gets 413 (8 MiB, the "
                                          "routing core's max_body_bytes: a 128k-token prompt many times over, "
                                          "while bounding what Envoy buffers per request).")
    connect_timeout_s: float = setting(1.0, "Upstream connect timeout (refused connections fail at once; 1 s "
                                       "bounds a black-holed endpoint before the fallback is tried).")
    upstream_timeout_s: float = setting(600.0, "Whole-response timeout for an inference request (long "
                                        "generations stream for minutes; 0 disables).")
    num_fallbacks: int = setting(2, "Fallback endpoints tried, in order, when the previous one refuses the "
                                 "connection, 0-4 (2: survives two endpoints down at once without long tails; "
                                 "the routing core's num_fallbacks should match).")
    retry_on_reset: bool = setting(True, "Also move to the next endpoint when one resets or closes the connection "
                                   "before any response byte (a crashed or killed server, or a pooled connection it "
                                   "closed just as Envoy reused it). Such a request may have started there, so it can "
                                   "run twice (one extra prefill); without it, those requests fail with 503. Streamed "
                                   "responses that started are never retried.")
    report_served: bool = setting(True, "Send response headers to ext_proc so it learns which endpoint served "
                                  "(passive failure detection; costs one more small gRPC message per request). With "
                                  "observe_responses the observing filter carries them, without blocking.")
    expose_served_endpoint: bool = setting(
        False, "Tell clients which endpoint served them: the response header x-gateway-destination-endpoint-served "
        "(the endpoint's internal ip:port) reaches the client. Off: Envoy removes it from every response, as it "
        "removes every other router-internal header whatever a server sends (docs/security.md); the router and "
        "the facts path read it before that either way.")
    max_downstream_connections: int = setting(50000, "Client connections Envoy accepts at once; beyond it new "
                                              "ones are refused (bounds memory; far above what one picker "
                                              "process can route).")
    extproc_enabled: bool = setting(True, "Insert the ext_proc filter (false = plain round-robin, used by the "
                                    "overhead benchmark as the baseline).")
    observe_responses: bool = setting(False, "Insert the observing ext_proc filter (observability mode: Envoy never "
                                      "waits for it) that streams response headers and every body chunk to the "
                                      "ext_proc service for gateway TTFT, latency and token usage per request (~95 us "
                                      "of ext_proc CPU per chunk). Off by default: response_facts_lua takes the same "
                                      "facts in Envoy, once per request. Use one or the other.")
    routing_processing: str = setting(
        "buffered",
        "Envoy's routing filter and how it sends a request (every option Envoy 1.40 offers, measured and checked in "
        "bench-results/routing-modes/): 'buffered' (also 'ext_proc': the ext_proc filter; request headers, answered "
        "at once, then the whole body: two round trips, correct for any body up to max_request_body_bytes and any "
        "upload speed). The others exist to measure them and are not correct as a gateway: 'buffered-partial' "
        "(BUFFERED_PARTIAL: a body above the buffer limit is routed on its first part instead of refused), "
        "'full-duplex' (body FULL_DUPLEX_STREAMED, served by the GIE protocol: no fallback or replica headers, a "
        "slow upload fails over), 'streamed-early' (body STREAMED with "
        "send_body_without_waiting_for_header_response: routed on the first chunk), 'skip-headers' (request headers "
        "SKIP, body BUFFERED, path and headers asked as request_attributes: Envoy 1.40 routes at the headers, "
        "before the router answers). 'ext_authz' (also 'authz') is correct too and routes by Envoy's ext_authz "
        "filter instead: one unary Check with the headers and whole body (one round trip, about half the router's "
        "gRPC CPU per request: bench-results/routing-authz/); it needs the facts path (response_facts_lua: the "
        "facts record releases each pick); a request to hold past saturation, or a large body, is handed to the "
        "ext_proc filter on the handoff route. 'ext_authz_http' (also 'authz-http') is the same filter and decision "
        "over plain HTTP/1.1 to the service's authz_http_port (extproc_authz_http_addresses) instead of gRPC: the "
        "fastest measured (bench-results/routing-authz-http/), an option of `prefixroute gateway` and `up` "
        "(--routing-filter ext_authz_http); the default, here and there, is 'buffered': Envoy's ext_proc filter.")

    def __post_init__(self) -> None:
        # One name per routing filter, as `gateway --routing-filter` says them: ext_authz_http, ext_authz,
        # ext_proc; the older processing names stay accepted (see ROUTING_PROCESSING_ALIASES).
        canonical = ROUTING_PROCESSING_ALIASES.get(self.routing_processing)
        if canonical is not None:
            object.__setattr__(self, "routing_processing", canonical)

    allowed_paths: tuple[str, ...] = setting(
        DEFAULT_ALLOWED_PATHS,
        "Request paths (exact, case-sensitive, query string aside) the gateway routes to endpoints: the OpenAI "
        "inference API and vLLM's /tokenize and /detokenize. Any other path gets an OpenAI-format 404 from Envoy "
        "and never reaches an endpoint or the ext_proc service, so a model server's admin, metrics, profiling "
        "or sleep paths stay private. Add a path here for an endpoint API you mean to expose.")
    allowed_path_prefixes: tuple[str, ...] = setting(
        DEFAULT_ALLOWED_PATH_PREFIXES,
        "Path prefixes routed like allowed_paths (a prefix should end in '/'): the Responses API's "
        "/v1/responses/{id}... and /v1/models/{model}. Paths are normalised first (%2F and %5C decoded, then RFC "
        "3986 dot segments resolved and repeated slashes merged; the endpoint receives that path), so '..' cannot "
        "climb out of them, and a model id with a slash (meta-llama%2FLlama-3.1-8B-Instruct) reaches the endpoint as "
        "vLLM itself would see it.")
    request_headers_timeout_s: float = setting(
        10.0, "Time a client has, from the first byte of a request, to send all of its headers; then Envoy closes "
        "the connection (slowloris: a client trickling headers otherwise holds a connection forever). Real "
        "clients send headers in one packet; 10 s leaves room for a lossy mobile link.")
    request_timeout_s: float = setting(
        120.0, "Time to receive a whole request, headers and body (Envoy answers 408 in OpenAI format after it). "
        "The timer stops once the request has gone to the endpoint, so it never cuts a long response; 120 s "
        "uploads a max_request_body_bytes body (8 MiB) at ~0.5 Mbit/s. 0 disables.")
    stream_idle_timeout_s: float = setting(
        300.0, "A request with no bytes moving in either direction for this long is reset (a stalled client or "
        "endpoint). Sized for inference: near saturation a first token can take tens of seconds, and a "
        "non-streamed completion sends nothing until its last token (a few thousand tokens at ~30 tokens/s: "
        "minutes); 300 s is Envoy's default and stays under upstream_timeout_s. A client that stops reading "
        "stalls its stream (flow control) and is cut after this long. 0 disables.")
    idle_timeout_s: float = setting(
        30.0, "A client connection with no request in flight for this long is closed (keep-alive connections, and "
        "connections that never send a byte: request_headers_timeout_s starts at the first byte). Never "
        "applies while a response streams. 30 s: far above SDK reuse gaps (the OpenAI SDK's httpx keeps idle "
        "connections 5 s), short enough that idle sockets do not pile up. 0 disables.")
    trusted_ingress_headers: tuple[str, ...] = setting(
        (), "Scheduling headers (x-prefixroute-priority, x-prefixroute-tenant, x-gateway-inference-objective, "
        "x-gateway-inference-fairness-id) an ingress in front of this gateway sets and this gateway keeps; every "
        "other client copy of them is stripped at ingress, so a client cannot choose its own priority, tenant or "
        "flow. Empty (the default): all four stripped, and the fairness header set to the client's address. "
        "List only headers your ingress sets on every request (or strips), and trust them in the router too "
        "(extproc --trusted-headers).")
    max_request_headers_kb: int = setting(
        32, "Largest request header block in KiB; larger gets an OpenAI-format 431. OpenAI clients send under 2 KiB "
        "(a long bearer JWT is ~1-8 KiB); 32 KiB (Envoy's default is 60) halves what a header flood holds per "
        "request.")
    connection_buffer_bytes: int = setting(
        32 * 1024, "Per-connection buffer high-water mark, client side and endpoint side: how far Envoy reads "
        "ahead of a slow peer before flow control pauses the other side. It bounds what a client that stops "
        "reading costs Envoy (~2x this per stream instead of ~2x max_request_body_bytes). 32 KiB is Envoy's "
        "edge-proxy recommendation: seconds of a token stream (~100 bytes per SSE event); request bodies are "
        "buffered separately up to max_request_body_bytes.")
    records_otlp_address: str = setting(
        "", "host:port of an OTLP/gRPC receiver (`prefixroute telemetry`) Envoy sends one log record per routed "
        "request to (its id, path, status, served endpoint, response flags, and TTFT and latency on Envoy's clock): "
        "the receiver gives the router's record of the request Envoy's TTFT and latency, and keeps Envoy's record as "
        "the request's own only when the router's never comes (the router was down or was killed while the request "
        "ran), so every request served has a record. Set: a Lua filter stamps a Responses API stream's first token "
        "(docs/telemetry.md). Empty: none.")
    first_token_lua: bool = setting(
        True, "With records_otlp_address, a Lua filter stamps the time of a Responses API stream's first token event "
        "into Envoy's record (its opening events precede any token, so its first body byte is too early a TTFT). "
        "It reads only the first chunk of any other response (measured: docs/benchmarks.md, Router overhead). Off: "
        "a Responses stream's TTFT is its first body byte.")
    response_facts_lua: bool = setting(
        True, "The facts path (docs/architecture.md, Response facts; the default): a Lua filter takes each "
        "response's facts in Envoy (first token time, usage with cached tokens, response id) and one OTLP log record "
        "per request carries them, with status, served endpoint and Envoy's timing, to the ext_proc replica that "
        "routed it; nothing per body chunk crosses gRPC. Use with observe_responses false (the observing filter's "
        "per-chunk stream is what it replaces); `prefixroute gateway` sets both from --response-path. False (and "
        "observe_responses false): the router learns only the served endpoint, from the response headers.")
    facts_flush_interval_ms: int = setting(
        50, "How long Envoy's facts logger holds records before sending them to the ext_proc replica (ms): a "
        "response's facts reach the router its stream's end plus up to this. 50 ms: one gRPC message carries many "
        "requests under load, and the router learns a first token well within the time its follow-ups take.")
    records_otlp_token_file: str = setting(
        "", "File holding the bearer token the OTLP receiver of records_otlp_address requires (read by Envoy, "
        "never written into the configuration).")
    extproc_tls_ca_file: str = setting(
        "", "PEM CA bundle that signs the ext_proc service's certificate; set = Envoy talks TLS to it and verifies "
        "its certificate (the SAN must name extproc_tls_server_name). Empty = plaintext (loopback only).")
    extproc_tls_cert_file: str = setting(
        "", "PEM client certificate Envoy presents to the ext_proc service (mutual TLS; the service requires one "
        "when it is given tls_client_ca_file). Needs extproc_tls_key_file and extproc_tls_ca_file.")
    extproc_tls_key_file: str = setting("", "PEM private key of extproc_tls_cert_file.")
    extproc_tls_server_name: str = setting(
        "", "Name sent as SNI and required in the ext_proc certificate's subject alternative names (DNS name or "
        "IP address); empty = the host of extproc_address.")
    extproc_auth_token: str = setting(
        "", "Bearer token Envoy sends to the ext_proc service (`authorization: Bearer ...` on every stream, both "
        "filters); must equal the service's auth_token. Prefer extproc_auth_token_file: given inline, the token is "
        "written into the rendered configuration (as a secret, so Envoy's /config_dump redacts it; envoy-config "
        "--out writes the file mode 0600).")
    extproc_auth_token_file: str = setting(
        "", "File holding extproc_auth_token, read by Envoy itself at start: the rendered configuration names the "
        "file and holds no secret (Envoy must be able to read it). A file with surrounding whitespace (a trailing "
        "newline) is read here instead and its stripped token written into the configuration. Used when "
        "extproc_auth_token is empty.")
