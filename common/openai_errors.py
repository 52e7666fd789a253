"""Errors in the OpenAI / vLLM JSON format, shared by the router and the simulated model servers.

Shape (what vLLM's OpenAI server returns)::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}
"""

from __future__ import annotations

import orjson

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class OpenAIError(Exception):
    """An error that maps to one HTTP status and an OpenAI-format body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type_: str | None = None,
                 retry_after_s: int | None = None, record_message: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ERROR_TYPES.get(status, "Error")
        self.retry_after_s = retry_after_s
        self._record_message = record_message

    @property
    def record_message(self) -> str:
        """What records, logs and dashboards keep of this error: `message`, unless it quotes something only its
        client may see (a response id reads its response), which the error then withholds here."""
        return self._record_message if self._record_message is not None else self.message

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, type_=self.type)


def error_body(status: int, message: str, *, param: str | None = None, type_: str | None = None) -> bytes:
    """The JSON body for an error response."""
    return orjson.dumps({"error": {"message": message, "type": type_ or ERROR_TYPES.get(status, "Error"),
                                   "param": param, "code": status}})
