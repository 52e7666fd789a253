"""ext_proc answers both protocols give (prefixroute's own, servicer.py; GIE's, gie.py): a header option, a
refusal as an ImmediateResponse, a routing answer with ``traceparent`` added, and the refusal of a Responses
follow-up whose holder changed during its lookup. Pure functions over the wire classes; no state."""

from __future__ import annotations

from typing import Any

from prefixroute.extproc import wire
from prefixroute.extproc.headers import REFUSED_HEADER, TRACEPARENT_HEADER
from prefixroute.openai_errors import OpenAIError


def header_option(key: str, value: str) -> Any:
    """A header to set, overwriting any value the request already has."""
    return wire.HeaderValueOption(header=wire.HeaderValue(key=key, raw_value=value.encode()),
                                  append_action=wire.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def with_traceparent(cached: Any, at_headers: bool, traceparent: str) -> Any:
    """A copy of a cached routing response that also sets ``traceparent`` (the router span) upstream."""
    resp = wire.ProcessingResponse()
    resp.CopyFrom(cached)
    common = resp.request_headers.response if at_headers else resp.request_body.response
    common.header_mutation.set_headers.append(header_option(TRACEPARENT_HEADER, traceparent))
    return resp


def immediate_response(err: OpenAIError) -> Any:
    """An OpenAIError as an ext_proc ImmediateResponse (status, JSON body, content-type, retry-after)."""
    headers = [header_option("content-type", "application/json"), header_option(REFUSED_HEADER, str(err.status))]
    if err.retry_after_s is not None:
        headers.append(header_option("retry-after", str(err.retry_after_s)))
    return wire.ProcessingResponse(immediate_response=wire.ImmediateResponse(
        status=wire.HttpStatus(code=err.status),
        headers=wire.HeaderMutation(set_headers=headers), body=err.body(), details=f"prefixroute_{err.status}"))


def lookup_changed(response_id: str) -> OpenAIError:
    """The 503 of a follow-up whose response id was found, then forgotten at once (its endpoint left meanwhile):
    no second lookup round."""
    return OpenAIError(503, f"the endpoint holding response '{response_id[:100]}' changed during its lookup; retry",
                       retry_after_s=1, param="previous_response_id")
