"""The dashboard tests' shared parts: a clean environment (fixture), synthetic records written to real SQLite
stores, and readers of what the Streamlit app shows under AppTest. Used by tests/unit/dashboard (stores in
tmp_path) and tests/integration/dashboard (the same app against real receivers and HTTP servers)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest  # Streamlit is in the test extra: missing, these tests fail, never skip

import prefixroute.dashboard
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.store import TelemetryStore

APP = str(Path(prefixroute.dashboard.__file__).parent / "app.py")  # a script: run by AppTest, never imported
ENDPOINTS = ("10.0.0.2:8000", "10.0.0.10:8000", "10.0.0.3:8000")


@pytest.fixture
def dashboard_env(monkeypatch, tmp_path):
    """No PREFIXROUTE_DASHBOARD_* setting from the caller's environment; benchmark results in a temp dir."""
    for var in ("DB", "TELEMETRY", "BENCH_DIR", "SCRAPE_ENDPOINTS", "WINDOW_S", "REFRESH_S", "ROUTER_METRICS_URL",
                "TELEMETRY_TOKEN"):
        monkeypatch.delenv(f"PREFIXROUTE_DASHBOARD_{var}", raising=False)
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_BENCH_DIR", str(tmp_path / "bench"))
    monkeypatch.setenv("PREFIXROUTE_STATE_DIR", str(tmp_path / "state"))  # its bench/ is searched too


def app_records(n: int, *, age_s: tuple[float, float] = (1, 200), seed: int = 0) -> list[RequestRecord]:
    """`n` routed requests of the last `age_s` seconds over ENDPOINTS (weights 6:3:1), a quarter of them 503."""
    rnd = random.Random(seed)
    now = time.time()
    out = []
    for i in range(n):
        ep = rnd.choices(ENDPOINTS, weights=(6, 3, 1))[0]
        prompt = rnd.randint(16, 4000)
        out.append(RequestRecord(
            trace_id=f"{rnd.getrandbits(128):032x}", span_id=f"{rnd.getrandbits(64):016x}",
            start_time=now - rnd.uniform(*age_s), request_id=f"r{i}", model="m", policy="prefix",
            reason=rnd.choice(("affinity", "cold", "spill")), endpoint=ep, endpoints=(ep,),
            predicted_hit_ratio=rnd.random(), decision_us=rnd.uniform(20, 400), ttft_ms=rnd.uniform(2, 900),
            latency_ms=rnd.uniform(900, 3000), prompt_tokens=prompt, completion_tokens=20,
            cached_tokens=rnd.randint(0, prompt), stream=True, status=rnd.choice((200, 200, 200, 503)),
            path="/v1/chat/completions"))
    return out


def prediction_records(n: int, *, predicted: bool, seed: int = 0) -> list[RequestRecord]:
    """`n` requests with (or without) the time model's predicted and alternative TTFT; a fifth of them 503."""
    rnd = random.Random(seed)
    now = time.time()
    out = []
    for i in range(n):
        ep = rnd.choices(ENDPOINTS, weights=(6, 3, 1))[0]
        other = rnd.choice([e for e in ENDPOINTS if e != ep])
        status = rnd.choice((200, 200, 200, 200, 503))
        out.append(RequestRecord(
            trace_id=f"{rnd.getrandbits(128):032x}", span_id=f"{rnd.getrandbits(64):016x}",
            start_time=now - rnd.uniform(1, 200), request_id=f"r{i}", model="m", policy="prefix", reason="affinity",
            endpoint=ep, endpoints=(ep, other), ttft_ms=rnd.uniform(5, 900) if status == 200 else None,
            latency_ms=rnd.uniform(900, 3000), prompt_tokens=100, completion_tokens=20, cached_tokens=50, stream=True,
            status=status, error=None if status == 200 else "upstream", path="/v1/chat/completions",
            predicted_ttft_ms=rnd.uniform(5, 900) if predicted else None,
            alternative_endpoint=other if predicted else None,
            alternative_ttft_ms=rnd.uniform(100, 3000) if predicted else None))
    return out


def write(db: Path, records: list[RequestRecord], run_id: str | None = None) -> None:
    store = TelemetryStore(db, run_id=run_id)
    store.insert_records(records)
    store.close()


def median(values) -> float:  # noqa: ANN001
    return float(np.percentile(np.array(values), 50, method="inverted_cdf"))


def expected_predictions(records: list[RequestRecord]) -> dict[str, dict]:
    """Per endpoint over the comparable requests (succeeded, on the primary): independent of the store."""
    ok = [r for r in records if r.predicted_ttft_ms is not None and r.status == 200 and r.endpoint == r.endpoints[0]]
    out = {}
    for ep in {r.endpoint for r in ok}:
        mine = [r for r in ok if r.endpoint == ep]
        out[ep] = {"n": len(mine), "pred": median([r.predicted_ttft_ms for r in mine]),
                   "actual": median([r.ttft_ms for r in mine]),
                   "ape": median([abs(r.ttft_ms - r.predicted_ttft_ms) / r.ttft_ms for r in mine])}
    return out


def run_app() -> AppTest:
    return AppTest.from_file(APP, default_timeout=60).run()


def endpoint_table(at: AppTest, i: int = 0):  # noqa: ANN201
    """An endpoint table as shown (text cells, headers as displayed), indexed by endpoint: 0 = the window's
    requests, 1 = the live state (when the router's metrics answer)."""
    return at.table[i].value.set_index("endpoint")


def shown(text: str) -> str:
    return text.replace(" ", "\u00a0")  # cells keep a number and its unit together


def metric(at: AppTest, label: str) -> str:
    for m in at.metric:
        if m.label == label:
            return m.value
    raise AssertionError(f"no metric {label!r}: {[m.label for m in at.metric]}")


def texts(at: AppTest) -> str:
    parts = [e.value for kind in (at.info, at.warning, at.error, at.success) for e in kind]
    parts += [c.value for c in at.code] + [c.value for c in at.caption] + [m.value for m in at.markdown]
    return "\n".join(str(p) for p in parts)
