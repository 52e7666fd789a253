"""When the store writer falls behind, the receiver answers OTLP partial success instead of growing memory,
and stores everything it accepted once the store is writable again."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from prefixroute.telemetry.otlp_encode import EncodedBatch
from prefixroute.telemetry.receiver import Receiver
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store_reader import StoreReader
from helpers.waiting import until_async

pytestmark = pytest.mark.integration


def export_request(i: int):
    r = TelemetryRecorder(environ={}, endpoint="http://127.0.0.1:1")  # used only to encode
    try:
        batch, _ = r._encode([RequestRecord(trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}",
                                            start_time=time.time(), request_id=f"bp-{i}", status=200)])
    finally:
        r.shutdown(0.1)
    assert isinstance(batch, EncodedBatch)
    return batch.request


async def test_backpressure_rejects_then_recovers(tmp_path):
    db = tmp_path / "bp.db"
    receiver = Receiver(str(db), port=0, max_pending_batches=1, retention_interval_s=60)
    await receiver.start()
    locker = sqlite3.connect(db, isolation_level=None, timeout=0)
    try:
        locker.execute("BEGIN IMMEDIATE")  # another writer holds the lock: inserts wait (busy timeout 5 s)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{receiver.port}") as ch:
            stub = trace_service_pb2_grpc.TraceServiceStub(ch)
            responses = []
            for i in range(4):
                responses.append(await stub.Export(export_request(i), timeout=5))
                if i == 0:  # the writer takes the first request off its queue and blocks on the lock
                    await until_async(lambda: receiver.writer._queue.empty(), 5)  # noqa: SLF001 - no public signal
            rejected = [r.partial_success.rejected_spans for r in responses]
            # The writer holds one request, the queue one more; the rest are refused, not buffered.
            assert rejected[:2] == [0, 0] and rejected[2:] == [1, 1]
            assert "behind" in responses[-1].partial_success.error_message
            locker.execute("ROLLBACK")
            assert await asyncio.get_running_loop().run_in_executor(None, receiver.writer.wait_idle, 10)
        assert receiver.stats.num_spans_rejected == 2
    finally:
        locker.close()
        await receiver.stop()
    with StoreReader(db) as reader:
        assert sorted(r["request_id"] for r in reader.recent_requests()) == ["bp-0", "bp-1"]
