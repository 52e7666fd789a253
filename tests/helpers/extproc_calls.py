"""Driving the ext_proc `Process` RPC from a test: one message written, one answer read, in turn."""

from __future__ import annotations

import grpc


async def exchange(process: grpc.aio.StreamStreamMultiCallable, msgs: list) -> list:
    """Write each of `msgs` on a new `Process` call and read its answer after each; then half-close and check
    the service ended the stream. Returns the answers in order."""
    call = process()
    out = []
    for m in msgs:
        await call.write(m)
        out.append(await call.read())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return out
