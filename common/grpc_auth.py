"""Authentication of prefixroute's gRPC servers, the ext_proc service and the OTLP receiver: one implementation,
so their rules cannot drift apart.

- Bearer token: every call must carry ``authorization: Bearer <token>`` (scheme case-insensitive). The token is
  compared in constant time (`bearer_matches`), so its bytes cannot be found one at a time from response
  times. A refused call is answered UNAUTHENTICATED by `BearerTokenInterceptor` before its handler runs and
  before its request is read (a unary call's refusal is served by a request-streaming handler, which never
  reads the message): the service behind it never sees it.
- TLS (`server_credentials`): a certificate chain and key; with a client CA, mutual TLS (a client without a
  certificate signed by it fails the handshake).
- Tokens are given inline (an environment variable) or in a file (`read_token`), never on the command line
  in deployments: argv is world-readable in /proc.
- Check before read (`CallAuth`, `unary_after_auth`): a unary method is served by a stream-unary handler (a
  client's unary call is the same on the wire), which runs on the call's metadata before any message is read:
  the token is checked there, then the one message is read as raw bytes, its length bounded, and only then
  decoded. A refused call never has its message read into the server's memory beyond what HTTP/2 flow control
  let the client send before the refusal (the server's stream window, `grpc.http2.lookahead_bytes`), and a
  message over the method's bound is never decoded.

The interceptor and `CallAuth` keep counters and are used from one event loop (grpc.aio); the functions are
pure.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc

log = logging.getLogger(__name__)


def read_token(token: str, token_file: str) -> str | None:
    """The bearer token: `token` (stripped), or the stripped content of `token_file`; None when neither is set.
    ValueError when both are set, or the file is unreadable or empty (a misconfiguration worth refusing to
    start for, never a silent "no authentication")."""
    if token and token_file:
        raise ValueError("give the auth token or the auth token file, not both")
    if token_file:
        try:
            value = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"auth token file: {exc}") from None
        if not value:
            raise ValueError(f"auth token file {token_file} is empty")
        return value
    return token.strip() or None


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "") -> grpc.ServerCredentials | None:
    """TLS credentials (None = plaintext, when no file is given); mutual TLS when `client_ca_file` is set.
    ValueError for an incomplete combination or an unreadable file."""
    if not (cert_file or key_file or client_ca_file):
        return None
    if not (cert_file and key_file):
        raise ValueError("TLS needs both a certificate file and a key file (a client CA alone is not enough)")

    def read(path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"TLS file: {exc}") from None

    client_ca = read(client_ca_file) if client_ca_file else None
    return grpc.ssl_server_credentials([(read(key_file), read(cert_file))], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def bearer_matches(authorization: str | bytes | None, token: bytes) -> bool:
    """True when an Authorization value is ``Bearer <token>`` (constant-time comparison of the token)."""
    if not authorization:
        return False
    value = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
    scheme, _, given = value.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


# No request deserializer: a refused request is never parsed. A unary request's refusal is served by a
# request-streaming handler (the same call on the wire), which runs on the call's metadata: gRPC would read a unary
# handler's whole message (up to the server's max_receive_message_length) before calling it. A refused call's
# message is therefore never read beyond what HTTP/2 flow control let the client send (the stream window).
_DENY = {(False, False): grpc.stream_unary_rpc_method_handler(_deny),
         (False, True): grpc.stream_stream_rpc_method_handler(_deny),
         (True, False): grpc.stream_unary_rpc_method_handler(_deny),
         (True, True): grpc.stream_stream_rpc_method_handler(_deny)}


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call (a stream counts once) whose metadata lacks the bearer token.
    `on_refused` is called once per refused call (a counter of the service's own); refusals are also logged at
    1, 10, 100 and every 1,000th, so a flood does not flood the log. `label` names the service in the log."""

    def __init__(self, token: str, *, label: str, on_refused: Callable[[], None] | None = None,
                 exempt: frozenset[str] = frozenset()) -> None:
        """`exempt`: full method paths served without the token (the gRPC health check: a kubelet probe or a
        gateway's health checker carries no token, and the answer tells only serving / not serving)."""
        if not token:
            raise ValueError("empty bearer token")
        self._exempt = exempt
        self._token = token.encode()
        self._label = label
        self._on_refused = on_refused
        self.num_refused = 0

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        if self._exempt and handler_call_details.method in self._exempt:
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                if bearer_matches(value, self._token):
                    return await continuation(handler_call_details)
                break
        self.num_refused += 1
        if self._on_refused is not None:
            self._on_refused()
        if self.num_refused in (1, 10, 100) or self.num_refused % 1000 == 0:
            log.warning("%s: refused %d call(s) without the right bearer token", self._label, self.num_refused)
        handler = await continuation(handler_call_details)  # only its shape: it never runs
        return None if handler is None else _DENY[handler.request_streaming, handler.response_streaming]


class CallAuth:
    """The bearer-token check of one gRPC call on its metadata (`allows`), and its refusal (`refuse`:
    UNAUTHENTICATED, counted in `num_refused`, logged at 1, 10, 100 and every 1,000th). One instance per server,
    shared by its methods, so `num_refused` counts every refused call of the port. `label` names the port in the
    log."""

    def __init__(self, token: str, label: str = "ext_proc") -> None:
        if not token:
            raise ValueError("empty bearer token")
        self._token = token.encode()
        self._label = label
        self.num_refused = 0

    def allows(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return bearer_matches(value, self._token)
        return False

    async def refuse(self, context: grpc.aio.ServicerContext) -> NoReturn:
        self.num_refused += 1
        if self.num_refused in (1, 10, 100) or self.num_refused % 1000 == 0:
            log.warning("%s: refused %d call(s) without the right bearer token", self._label, self.num_refused)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        raise AssertionError("unreachable: abort raises")  # pragma: no cover


def unary_after_auth(behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], *,
                     auth: CallAuth | None, max_message_bytes: int,
                     request_deserializer: Callable[[bytes], Any] | None = None,
                     response_serializer: Callable[[Any], bytes] | None = None) -> grpc.RpcMethodHandler:
    """A unary method `behavior(request, context)`, served so that nothing is read before the caller is checked
    (module docstring): a stream-unary handler checks `auth` (None: no token configured) on the metadata, then
    reads one message as raw bytes; a message over `max_message_bytes` is refused with RESOURCE_EXHAUSTED before
    it is decoded, a call without one with INVALID_ARGUMENT; the message is then decoded with
    `request_deserializer` (None: `behavior` gets the bytes). Further messages (a unary client sends none) are
    never read."""

    async def handler(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        if auth is not None and not auth.allows(context.invocation_metadata()):
            await auth.refuse(context)
        message = await context.read()
        if message is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a unary call without its message")
        if len(message) > max_message_bytes:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"message of {len(message)} bytes over this method's {max_message_bytes}")
        try:
            request = request_deserializer(message) if request_deserializer is not None else message
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: the caller sent garbage
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the message does not decode")
        return await behavior(request, context)

    return grpc.stream_unary_rpc_method_handler(handler, request_deserializer=None,
                                                response_serializer=response_serializer)
