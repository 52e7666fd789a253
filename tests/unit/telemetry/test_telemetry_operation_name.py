"""GenAI operation names per OpenAI path (gen_ai.operation.name on every decision span)."""

import pytest

from prefixroute.telemetry.attributes import operation_name


@pytest.mark.parametrize(("path", "expected"), [
    ("/v1/chat/completions", "chat"),
    ("/v1/responses", "chat"),  # a Responses turn is a chat operation in the GenAI conventions
    ("/v1/completions", "text_completion"),
    ("/v1/embeddings", "embeddings"),
    ("/v1/models", None),
    ("/v1/responses/resp_1", None),  # retrieving a stored response is no generation
])
def test_operation_name(path, expected):
    assert operation_name(path) == expected
