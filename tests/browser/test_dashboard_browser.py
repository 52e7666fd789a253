"""The dashboard in headless Chromium, against a store filled by a real short run (see realrun.py).

Checks what a user sees: the live page renders its charts with data, the hit rate it shows equals
the one computed from `prefixroute telemetry dump` over the same window, every endpoint of the run
appears, and new traffic shows up by the live refresh without a page reload. The "Predicted vs actual
TTFT" panel first says plainly that no decision carries a prediction (the run's first requests are
routed as by a policy without a time model), then, once requests with predictions arrive, shows per
endpoint the medians and the error computed from the dump. A full-page screenshot
is saved under $PREFIXROUTE_ARTIFACTS_DIR or <repo>/artifacts/.

Chromium missing: skipped, unless PREFIXROUTE_REQUIRE_BROWSER=1 (then it fails).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import re
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers.realrun import RealFleet
from prefixroute.dashboard import data as D
from helpers.procs import free_port, prefixroute_cmd, start_process

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(150)]

# Debian's chromium package (installed by .ci/run); PREFIXROUTE_CHROMIUM points at another build.
CHROMIUM = os.environ.get("PREFIXROUTE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
REPO = Path(__file__).resolve().parents[2]
WINDOW_S = 300  # the dashboard's default window, and the `dump --since` compared with it
LIVE_CHARTS = ("hit_fleet", "hit_endpoint", "ttft_pct", "ttft_hist", "latency_pct", "rate", "share", "reasons",
               "reasons_time", "decision_hist", "hit_bars")


def _require_browser():
    required = os.environ.get("PREFIXROUTE_REQUIRE_BROWSER") == "1"
    problem = None
    if not os.path.exists(CHROMIUM):
        problem = f"Chromium not installed at {CHROMIUM} (Debian package `chromium`)"
    else:
        try:
            from playwright.sync_api import sync_playwright  # noqa: F401
        except ImportError:
            problem = "the python `playwright` package is not installed"
    if problem:
        if required:
            pytest.fail(f"{problem} and PREFIXROUTE_REQUIRE_BROWSER=1")
        pytest.skip(problem)


def artifacts_dir() -> Path:
    d = Path(os.environ.get("PREFIXROUTE_ARTIFACTS_DIR") or REPO / "artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


def dump_hit_ratio(db: Path) -> tuple[float, list[dict]]:
    """Hit ratio computed from `prefixroute telemetry dump` (what a user would compare against)."""
    out = subprocess.run(prefixroute_cmd("telemetry", "dump", "--since", str(WINDOW_S), "--db", str(db)),
                         capture_output=True, text=True, timeout=30, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    used = [r for r in rows if r["prompt_tokens"] and r["cached_tokens"] is not None]
    return sum(r["cached_tokens"] for r in used) / sum(r["prompt_tokens"] for r in used), rows


def _metric(page, label: str) -> str:
    return page.locator('[data-testid="stMetric"]', has_text=label).locator(
        '[data-testid="stMetricValue"]').inner_text().strip()


def _num_requests_shown(page) -> int:
    m = re.search(r"· ([\d,]+) requests ·", page.inner_text('[data-testid="stMain"]'))
    return int(m.group(1).replace(",", "")) if m else -1


class TimeModel:
    """Stands in for the fleet's router (`fleet.router = TimeModel(fleet.router)`): while `on` is False decisions carry no TTFT prediction (as a policy without a
    time model routes); while on, the policy's own predictions, or, when it makes none, a stand-in model's
    (a fixed figure per endpoint): the panel is checked against the dump, whatever the figures are."""

    def __init__(self, router) -> None:
        self.router, self.on = router, False

    def __getattr__(self, name: str):
        return getattr(self.router, name)

    def route(self, *args, **kwargs):
        d = self.router.route(*args, **kwargs)
        if not self.on:
            return dataclasses.replace(d, predicted_ttft_ms=None, alternative_endpoint=None, alternative_ttft_ms=None)
        if d.predicted_ttft_ms is None and d.endpoints:
            port = int(d.endpoints[0].rpartition(":")[2])
            alt = d.endpoints[1] if len(d.endpoints) > 1 else None
            d = dataclasses.replace(d, predicted_ttft_ms=30.0 + port % 7 * 20.0, alternative_endpoint=alt,
                                    alternative_ttft_ms=900.0 if alt else None)
        return d


def expected_predictions(rows: list[dict]) -> dict[str, dict]:
    """Per endpoint, from dump rows: the comparable predictions (succeeded on their primary) and their
    medians (nearest rank, as the store computes them)."""
    import numpy as np

    med = lambda v: float(np.percentile(np.array(v), 50, method="inverted_cdf"))  # noqa: E731
    ok = [r for r in rows if r["predicted_ttft_ms"] is not None and r["ttft_ms"] is not None
          and r["status"] == 200 and r["error"] is None and r["endpoint"] == r["endpoints"][0]]
    out = {}
    for ep in {r["endpoint"] for r in ok}:
        mine = [r for r in ok if r["endpoint"] == ep]
        out[ep] = [f"{len(mine):,}", D.format_ms(med([r["predicted_ttft_ms"] for r in mine])),
                   D.format_ms(med([r["ttft_ms"] for r in mine])),
                   D.format_ratio(med([abs(r["ttft_ms"] - r["predicted_ttft_ms"]) / max(r["ttft_ms"], 1.0)
                                       for r in mine]))]
    return out


def test_dashboard_shows_a_real_run_in_chromium(tmp_path):
    _require_browser()
    from playwright.sync_api import sync_playwright

    with ExitStack() as stack:
        fleet = RealFleet(stack, tmp_path, num_servers=3)
        fleet.router = fleet.time_model = TimeModel(fleet.router)
        fleet.send(num_groups=6, per_group=4, spread_s=6.0)
        port = free_port()
        stack.enter_context(start_process(
            prefixroute_cmd("dashboard", "--db", str(fleet.db), "--port", str(port), "--refresh-s", "1"),
            ready_url=f"http://127.0.0.1:{port}/_stcore/health", timeout_s=60, log_dir=tmp_path / "logs",
            name="dashboard"))
        expected_hit, rows = dump_hit_ratio(fleet.db)
        assert len(rows) == fleet.num_sent
        served = {r["endpoint"] for r in rows}
        assert served <= set(fleet.endpoints) and len(served) >= 2

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                _check_page(browser, fleet, port, expected_hit, served)
            finally:
                browser.close()


def _check_page(browser, fleet: RealFleet, port: int, expected_hit: float, served: set[str]) -> None:
    page = browser.new_page(viewport={"width": 1500, "height": 2500})
    page.goto(f"http://127.0.0.1:{port}/", timeout=60_000)
    page.locator('[data-testid="stMetric"]', has_text="Hit rate (actual)").wait_for(timeout=60_000)
    # Every live chart is drawn, with marks (not just axes).
    for key in LIVE_CHARTS:
        page.wait_for_function(
            f"document.querySelectorAll('.st-key-chart-{key} svg .role-mark path, "
            f".st-key-chart-{key} svg .role-mark line').length > 0", timeout=30_000)

    shown = _metric(page, "Hit rate (actual)")
    assert shown.endswith("%"), shown
    assert float(shown.rstrip(" %")) == pytest.approx(expected_hit * 100, abs=0.051), (shown, expected_hit)
    assert _num_requests_shown(page) == fleet.num_sent
    body = page.inner_text("body")
    for endpoint in served:  # legends, share chart and table name every endpoint that served requests
        assert endpoint in body
    assert re.search(r"TTFT p50\s+[\d.,]+ ms", body)
    # No decision so far carried a predicted TTFT: the panel says so instead of drawing empty charts.
    panel = page.locator(".st-key-ttft-predictions")
    assert "No TTFT predictions in the last 5 min" in panel.inner_text()
    assert panel.locator("table").count() == 0

    # Live: new traffic appears through the fragment refresh, the page itself is not reloaded. These
    # requests' decisions carry TTFT predictions.
    page.evaluate("window.__prefixroute_marker = 42")
    before = fleet.num_sent
    fleet.time_model.on = True
    fleet.send(num_groups=6, per_group=2, first_question=100)
    page.wait_for_function(
        f"(document.querySelector('[data-testid=\"stMain\"]').innerText.match(/· ([\\d,]+) requests ·/)"
        f" || [0, '0'])[1].replace(',', '') == '{fleet.num_sent}'", timeout=20_000)
    assert fleet.num_sent > before
    assert page.evaluate("window.__prefixroute_marker") == 42
    _check_prediction_panel(page, fleet)
    time.sleep(1.0)  # let the refreshed charts settle before the picture
    shot = artifacts_dir() / "dashboard-live.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000

    # Drill-down: open Requests, click the newest row, see that request's span attributes.
    page.get_by_text("Requests", exact=True).click()
    grid = page.locator('[data-testid="stDataFrame"]')
    grid.wait_for(timeout=30_000)
    page.wait_for_timeout(1000)
    box = grid.bounding_box()
    page.mouse.click(box["x"] + 15, box["y"] + 55)  # the first data row's selection cell (newest request)
    page.get_by_text("Trace attributes").wait_for(timeout=20_000)
    trace_id = page.get_by_label("Trace id").input_value()
    assert trace_id == newest_trace_id(fleet)
    attrs_text = page.locator('[data-testid="stJson"]').nth(1).inner_text()
    assert "prefixroute.reason" in attrs_text and "gen_ai.request.model" in attrs_text
    page.screenshot(path=str(artifacts_dir() / "dashboard-request.png"), full_page=True)


def _check_prediction_panel(page, fleet: RealFleet) -> None:
    """The panel's per-endpoint figures equal those computed from `telemetry dump`, and its chart has bars."""
    _, rows = dump_hit_ratio(fleet.db)
    want = expected_predictions(rows)
    assert want, "no request with a comparable prediction in the run"
    page.locator(".st-key-ttft-predictions table").wait_for(timeout=20_000)
    page.wait_for_function("document.querySelectorAll('.st-key-chart-ttft_pred svg .role-mark path').length > 0",
                           timeout=20_000)
    shown = page.evaluate("""() => [...document.querySelectorAll('.st-key-ttft-predictions table tbody tr')]
        .map(tr => [...tr.querySelectorAll('th, td')].map(c => c.innerText.trim()))""")
    got = {r[0]: r[1:5] for r in shown}
    assert got == want, (got, want)
    scored = sum(int(v[0].replace(",", "")) for v in want.values())
    assert _metric(page, "Requests with a prediction") == f"{scored:,}"
    assert "No TTFT predictions" not in page.locator(".st-key-ttft-predictions").inner_text()


def newest_trace_id(fleet: RealFleet) -> str:
    from prefixroute.telemetry.store import StoreReader

    with StoreReader(fleet.db) as reader:
        return reader.recent_requests(1)[0]["trace_id"]
