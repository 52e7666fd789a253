"""Flow control's gateway wait and outcome through telemetry (issue 24): the tracker copies them from a held pick
and from a shed answer, the span carries them (both encoders), the receiver stores them, a v5 file gains the
columns in place, and the query API and dashboard table show them."""

from __future__ import annotations

import json
import sqlite3

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from helpers.picks import make_pick
from prefixroute.dashboard.data import recent_frame
from prefixroute.extproc.flow.control import FlowControl, Shed, ShedReason, gateway_outcome
from prefixroute.extproc.flow.gate import FlowGate
from prefixroute.extproc.flow.saturation import EndpointLoad, SaturationDetector
from prefixroute.extproc.flow.settings import FlowClass, FlowSettings
from prefixroute.extproc.tracking import RequestTracker
from prefixroute.openai_errors import OpenAIError
from prefixroute.telemetry.http_api import query
from prefixroute.telemetry.otlp_decode import request_rows
from prefixroute.telemetry.record_spans import record_attributes
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore
from prefixroute.telemetry.store_reader import StoreReader
from prefixroute.telemetry.store_schema import SCHEMA_VERSION
from prefixroute.types import EndpointId

NOW = 1_800_000_000.0
WAIT, OUTCOME = "prefixroute.gateway_wait_ms", "prefixroute.gateway_outcome"


def rec(i: int, **kw) -> RequestRecord:
    base = dict(trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}", start_time=NOW - 10 + i, endpoint="e:1",
                endpoints=("e:1",), status=200, ttft_ms=10.0, latency_ms=20.0)
    base.update(kw)
    return RequestRecord(**base)


def _tracker(out: list) -> RequestTracker:
    return RequestTracker(lambda d, us: None, out.append, {}.get, max_body_bytes=1000, obs_grace_s=0.05)


def test_tracker_copies_a_held_picks_wait_and_release_reason():
    t = _tracker([])
    held = make_pick(("e:1",))
    held.flow_wait_s, held.flow_released_by = 0.25, "first_token"
    st, _ = t.begin({":path": "/v1/chat/completions"})
    t.decided(st, held)
    assert (st.rec.gateway_wait_ms, st.rec.gateway_outcome) == (250.0, "released:first_token")
    st2, _ = t.begin({":path": "/v1/chat/completions"})
    t.decided(st2, make_pick(("e:1",)))  # never held
    assert (st2.rec.gateway_wait_ms, st2.rec.gateway_outcome) == (0.0, None)


def test_a_shed_answer_becomes_the_refusals_outcome_and_other_refusals_have_none():
    t = _tracker([])
    shed = Shed(429, "waited past its deadline", ShedReason.DEADLINE, 3)
    shed.wait_s = 1.5
    st, _ = t.begin({":path": "/v1/chat/completions"})
    t.refused(st, shed.status, shed.message, *gateway_outcome(shed))
    assert (st.rec.status, st.rec.gateway_wait_ms, st.rec.gateway_outcome) == (429, 1500.0, "shed:deadline")
    assert gateway_outcome(OpenAIError(400, "bad")) == (0.0, None)


async def test_the_gate_stamps_how_long_a_shed_request_was_held():
    gate = FlowGate(FlowControl(FlowSettings()), SaturationDetector(max_queued_s=0.25),
                    lambda: [EndpointLoad(EndpointId("a:1"), 1.0)])  # saturated for good
    with pytest.raises(Shed) as caught:
        await gate.admit("k", FlowClass(deadline_s=0.05), cost_s=1.0, num_bytes=10)
    assert caught.value.reason.value == "deadline" and caught.value.wait_s >= 0.04
    assert gateway_outcome(caught.value)[1] == "shed:deadline"


def test_span_attributes_carry_wait_and_outcome():
    attrs = record_attributes(rec(0, gateway_wait_ms=12.5, gateway_outcome="released:scrape"))
    assert (attrs[WAIT], attrs[OUTCOME]) == (12.5, "released:scrape")
    bare = record_attributes(rec(1))
    assert bare[WAIT] == 0.0 and OUTCOME not in bare  # never held: 0 ms, no outcome


@pytest.mark.parametrize("encoder", ["fast", "sdk"])
def test_wait_and_outcome_survive_both_encoders_to_the_store_row(encoder):
    recs = [rec(0, gateway_wait_ms=80.0, gateway_outcome="released:first_token"),
            rec(1, status=429, gateway_wait_ms=30000.0, gateway_outcome="shed:deadline"), rec(2)]
    r = TelemetryRecorder(environ={}, endpoint="http://127.0.0.1:1")  # never exports in this test
    try:
        req = r._encode(recs)[0].request if encoder == "fast" else encode_spans([r._factory.span(x) for x in recs])
    finally:
        r.shutdown(0.1)
    rows, _ = request_rows(req)
    assert [(row["gateway_wait_ms"], row["gateway_outcome"]) for row in rows] == [
        (80.0, "released:first_token"), (30000.0, "shed:deadline"), (0.0, None)]


def test_a_v5_file_gains_the_columns_in_place_and_the_api_and_dashboard_show_them(tmp_path):
    path = tmp_path / "v5.db"
    store = TelemetryStore(path)
    store.insert_records([rec(0)])
    store.close()
    conn = sqlite3.connect(path)  # make it a version-5 file: no gateway columns
    conn.executescript("ALTER TABLE requests DROP COLUMN gateway_wait_ms; ALTER TABLE requests DROP COLUMN "
                       "gateway_outcome; UPDATE meta SET value = '5' WHERE key = 'schema_version';")
    conn.close()
    reader = StoreReader(path)
    (old,) = reader.recent_requests(5)  # not upgraded yet: the columns read as NULL
    assert (old["gateway_wait_ms"], old["gateway_outcome"]) == (None, None)
    store = TelemetryStore(path)
    store.insert_records([rec(1, gateway_wait_ms=700.0, gateway_outcome="released:release"),
                          rec(2, status=429, gateway_wait_ms=2000.0, gateway_outcome="shed:deadline")])
    store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert SCHEMA_VERSION >= 6
    conn.close()
    rows = {r["trace_id"]: r for r in query(reader, "/api/recent", {"limit": ["10"]})}
    assert rows[rec(0).trace_id]["gateway_outcome"] is None
    assert (rows[rec(1).trace_id]["gateway_wait_ms"], rows[rec(1).trace_id]["gateway_outcome"]) == \
        (700.0, "released:release")
    assert query(reader, "/api/request", {"trace_id": [rec(2).trace_id]})["gateway_outcome"] == "shed:deadline"
    by = {r["gateway_outcome"]: r["num_requests"]
          for r in query(reader, "/api/breakdown", {"by": ["gateway_outcome"], "window_s": ["60"], "now": [str(NOW)]})}
    assert by == {None: 1, "released:release": 1, "shed:deadline": 1}
    hist = query(reader, "/api/histogram", {"column": ["gateway_wait_ms"], "window_s": ["60"], "now": [str(NOW)],
                                            "bin_width": ["1000"]})
    assert sum(h["num_requests"] for h in hist) == 2
    frame = recent_frame(reader.recent_requests(10))
    assert {"gateway_wait_ms", "gateway_outcome"} <= set(frame.columns)
    assert set(frame["gateway_outcome"]) == {"", "released:release", "shed:deadline"}
    assert json.loads(json.dumps(list(frame["gateway_wait_ms"].dropna()))) == [2000.0, 700.0]
    reader.close()
