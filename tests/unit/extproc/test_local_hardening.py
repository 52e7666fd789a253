"""Issue 27, the pure parts: stale gateway folders, the endpoint identity challenge, the embedded NATS
configuration, Envoy's request records in the receiver (held, then stored only without the router's)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.common.v1 import common_pb2

from helpers.waiting import until
from prefixroute import identity
from prefixroute.extproc.gateway import GATEWAY_DIR_PREFIX, OWNER_FILE, _owner_line, remove_stale_gateway_dirs
from prefixroute.extproc.peers.server import nats_config
from prefixroute.telemetry.otlp_decode import envoy_rows
from prefixroute.telemetry.receiver import ReceiverStats, StoreWriter


def _folder(root: Path, name: str, owner: str | None) -> Path:
    d = root / f"{GATEWAY_DIR_PREFIX}{name}"
    d.mkdir(mode=0o700)
    (d / "extproc.token").write_text("secret")
    if owner is not None:
        (d / OWNER_FILE).write_text(owner)
    return d


def test_only_folders_of_dead_owners_are_removed(tmp_path: Path) -> None:
    # A pid above the kernel's pid_max names no process, ever: a dead owner without starting a process.
    gone_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    dead = _folder(tmp_path, "dead", f"{gone_pid} 1\n")
    reused = _folder(tmp_path, "reused", f"{os.getppid()} 0\n")  # a live pid with another start time: reused
    alive = _folder(tmp_path, "alive", _owner_line(os.getppid()))
    mine = _folder(tmp_path, "mine", _owner_line(os.getpid()))
    unknown = _folder(tmp_path, "unknown", None)  # not ours to judge
    other = tmp_path / "unrelated"
    other.mkdir()
    removed = remove_stale_gateway_dirs(tmp_path)
    assert set(removed) == {dead, reused}
    assert not dead.exists() and not reused.exists()
    assert alive.exists() and mine.exists() and unknown.exists() and other.exists()


def test_the_identity_challenge() -> None:
    key, other = identity.new_key(), identity.new_key()
    c = identity.new_challenge()
    assert identity.verify(key, c, identity.proof(key, c))
    assert not identity.verify(other, c, identity.proof(key, c))  # another key
    assert not identity.verify(key, identity.new_challenge(), identity.proof(key, c))  # a replayed answer
    assert not identity.verify(key, c, None)


def test_the_identity_key_comes_from_the_environment_or_a_file(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv(identity.KEY_ENV, raising=False)
    assert identity.resolve_key() == ""
    f = tmp_path / "key"
    f.write_text(" k1\n")
    assert identity.resolve_key(str(f)) == "k1"
    monkeypatch.setenv(identity.KEY_ENV, "k2")
    assert identity.resolve_key(str(f)) == "k2"
    monkeypatch.delenv(identity.KEY_ENV)
    f.write_text("")
    with pytest.raises(ValueError):
        identity.resolve_key(str(f))


def test_nats_config_listens_where_told_and_requires_the_token() -> None:
    conf = nats_config(4222, "tok")
    assert 'listen: "127.0.0.1:4222"' in conf and 'token: "tok"' in conf
    with pytest.raises(ValueError):
        nats_config(4222, 'a"b')


def _envoy_logs(*ids: str) -> logs_service_pb2.ExportLogsServiceRequest:
    req = logs_service_pb2.ExportLogsServiceRequest()
    sl = req.resource_logs.add().scope_logs.add()
    for rid in ids:
        lr = sl.log_records.add()
        lr.time_unix_nano = int(time.time() * 1e9)
        for k, v in {"prefixroute.envoy_record": "1", "prefixroute.request_id": rid, "prefixroute.path":
                     "/v1/chat/completions", "prefixroute.status": "200", "prefixroute.latency_ms": "12",
                     "prefixroute.start_time": f"{time.time():.6f}", "prefixroute.endpoint": "127.0.0.1:8001",
                     "prefixroute.response_flags": "-", "prefixroute.route": "extproc_unavailable_round_robin"
                     }.items():
            lr.attributes.append(common_pb2.KeyValue(key=k, value=common_pb2.AnyValue(string_value=v)))
    return req


def test_envoy_records_become_rows() -> None:
    (row,) = envoy_rows(_envoy_logs("r1"))
    assert (row["request_id"], row["status"], row["latency_ms"], row["endpoint"], row["reason"],
            row["service_name"], row["error"]) == ("r1", 200, 12.0, "127.0.0.1:8001", "unrouted", "envoy", None)
    assert len(row["trace_id"]) == 32 and len(row["span_id"]) == 16
    assert envoy_rows(_envoy_logs("-")) == []  # no request id: nothing to match or keep


class _Store:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def insert_rows(self, rows) -> int:  # noqa: ANN001
        self.rows += list(rows)
        return len(rows)

    def enforce_retention(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _router_spans(*ids: str):  # noqa: ANN202
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from prefixroute.telemetry import attributes as A

    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i, rid in enumerate(ids):
        span = ss.spans.add(name=A.SPAN_NAME, trace_id=bytes([i + 1]) * 16, span_id=bytes([i + 1]) * 8,
                            start_time_unix_nano=int(time.time() * 1e9))
        span.attributes.append(common_pb2.KeyValue(key=A.FIELD_ATTRIBUTES["request_id"],
                                                   value=common_pb2.AnyValue(string_value=rid)))
    return req


def test_an_envoy_record_is_stored_only_when_the_routers_never_came() -> None:
    store, stats = _Store(), ReceiverStats()
    w = StoreWriter(store, stats, envoy_record_hold_s=0.5)  # type: ignore[arg-type]
    try:
        w.submit(_router_spans("seen"))  # the router's record of "seen" first
        w.wait_idle()
        w.submit(_envoy_logs("seen", "lost", "late"))
        w.wait_idle()
        w.submit(_router_spans("late"))  # ...and "late"'s after Envoy's, within the hold
        until(lambda: len(store.rows) >= 3, 5, message=lambda: store.rows)
        time.sleep(0.3)  # lets time pass on purpose: no fourth row (a duplicate) may come
        assert sorted(r["request_id"] for r in store.rows) == ["late", "lost", "seen"]
        assert [r["service_name"] for r in store.rows if r["request_id"] == "lost"] == ["envoy"]
        assert stats.num_envoy_records == 3 and stats.num_envoy_records_stored == 1
    finally:
        w.stop()
