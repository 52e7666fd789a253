"""How request parsing refuses: an OpenAI-format 400 naming the field, quoting the client's value clipped (pure).

Shared by the parsing modules (routing/request.py, request_prompt.py, request_fields.py) and by the router's
other refusals that quote a client's value (`clip`).
"""

from __future__ import annotations

from prefixroute.openai_errors import OpenAIError

MAX_ECHO_CHARS = 100
"""Most characters of a client's value quoted back in an error message (`clip`)."""


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` as text for an error message: at most `limit` characters, then a marker saying how many more."""
    s = value if isinstance(value, str) else repr(value)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}...({len(s) - limit} more characters)"


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """The 400 of an invalid request body (`param`: the field, e.g. ``messages[2].content``)."""
    return OpenAIError(400, message, param=param)
