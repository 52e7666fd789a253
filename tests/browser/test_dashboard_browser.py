"""The dashboard in headless Chromium, against a store filled by a real short run (see realrun.py).

Checks what a user sees: the live page renders its charts with data, the hit rate it shows equals
the one computed from `prefixroute telemetry dump` over the same window, every endpoint of the run
appears, and new traffic shows up by the live refresh without a page reload. The figures agree with each
other and with the fleet (one balance figure in the tile and the header, the fair share over the real
endpoints, requests refused by the router shown as unrouted, not as an endpoint; KV usage with a decimal from
the router's real /metrics), and nothing is cut off at 1,280 px or at 1,920 px: every KPI label and value and
every cell of the endpoint and prediction tables shows its whole text (measured in the DOM: no element's content
wider than its box), no chart label is shortened with an ellipsis, and the table fits its column. The "Predicted vs actual
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
from prefixroute.dashboard import tables as T
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
        out[ep] = [f"{len(mine):,}", T.format_ms(med([r["predicted_ttft_ms"] for r in mine])),
                   T.format_ms(med([r["ttft_ms"] for r in mine])),
                   T.format_ratio(med([abs(r["ttft_ms"] - r["predicted_ttft_ms"]) / max(r["ttft_ms"], 1.0)
                                       for r in mine]))]
    return out


def test_dashboard_shows_a_real_run_in_chromium(tmp_path):
    _require_browser()
    from playwright.sync_api import sync_playwright

    with ExitStack() as stack:
        fleet = RealFleet(stack, tmp_path, num_servers=3)
        fleet.router = fleet.time_model = TimeModel(fleet.router)
        # 12 groups: cold prefixes on an idle fleet are placed by rendezvous hash (the ports are random), so
        # with 6 all landed on one endpoint about 1 run in 250 (3 / 3**6), leaving one endpoint to show.
        fleet.send(num_groups=12, per_group=3, spread_s=6.0)
        fleet.record_refused(NUM_REFUSED)
        metrics_url = start_router_metrics(stack, fleet.endpoints)
        port = free_port()
        stack.enter_context(start_process(
            prefixroute_cmd("dashboard", "--db", str(fleet.db), "--port", str(port), "--refresh-s", "1",
                            "--router-metrics-url", metrics_url, "--bench-dir", str(REPO / "bench-results")),
            ready_url=f"http://127.0.0.1:{port}/_stcore/health", timeout_s=60, log_dir=tmp_path / "logs",
            name="dashboard"))
        expected_hit, rows = dump_hit_ratio(fleet.db)
        assert len(rows) == fleet.num_sent
        served = {r["endpoint"] for r in rows} - {None}
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
    _check_figures_agree(page, fleet)
    for width in (1280, 1920):
        _check_nothing_cut_off(page, width)
    page.set_viewport_size({"width": 1500, "height": 2500})
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
    for width in (1280, 1920):  # the prediction panel's tiles and table too
        _check_nothing_cut_off(page, width)
    page.set_viewport_size({"width": 1500, "height": 2500})
    time.sleep(1.0)  # let the refreshed charts settle before the picture
    shot = artifacts_dir() / "dashboard-live.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    _check_screenshot_command(port)

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
    _check_benchmarks_page(page)


def _check_benchmarks_page(page) -> None:
    """The Benchmarks page over the project's own bench-results/: its charts drawn, no warning box, what it does not
    chart said in one line, nothing cut off at either width."""
    page.get_by_text("Benchmarks", exact=True).click()
    page.wait_for_function("document.querySelectorAll('.st-key-chart-bench_hit svg .role-mark path').length > 0",
                           timeout=30_000)
    assert page.locator('[data-testid="stAlert"]').count() == 0
    assert page.locator('[data-testid="stExpander"]').count() <= 1
    for width in (1280, 1920):
        page.set_viewport_size({"width": width, "height": 1200})
        page.wait_for_timeout(1000)
        assert page.evaluate(_CUT_OFF_JS) == [], width
    page.screenshot(path=str(artifacts_dir() / "dashboard-benchmarks.png"), full_page=True)


NUM_REFUSED = 5
KV_BLOCKS_USED, KV_BLOCKS = 500, 70_000  # "0.7 %", not "0 %"


def start_router_metrics(stack: ExitStack, endpoints: list[str]) -> str:
    """The router's real Prometheus /metrics (RouterMetrics over endpoint states, as its pool reports them), for
    the table's live columns; returns its URL."""
    from prefixroute.types import EndpointId, EndpointState
    from prefixroute.telemetry.metrics import RouterMetrics, start_metrics_server

    states = tuple(EndpointState(EndpointId(ep), healthy=True, kv_cache_usage_ratio=KV_BLOCKS_USED / KV_BLOCKS * (i + 1),
                                 num_requests_running=i, num_requests_waiting=0) for i, ep in enumerate(endpoints))
    server = start_metrics_server(RouterMetrics(endpoint_states=lambda: states), 0)
    stack.callback(server.server_close)
    stack.callback(server.shutdown)
    return f"http://127.0.0.1:{server.server_address[1]}/metrics"


def _check_figures_agree(page, fleet: RealFleet) -> None:
    """One balance figure; the fair share over the fleet's endpoints; the refused requests as unrouted; KV usage
    with a decimal."""
    main = page.inner_text('[data-testid="stMain"]')
    tile = _metric(page, "Balance")
    header = re.search(r"Share of routed requests · balance (\S+×)", main)
    assert header and header.group(1) == tile, (tile, header)
    _, rows = dump_hit_ratio(fleet.db)
    routed = [r["endpoint"] for r in rows if r["endpoint"]]
    counts = {ep: routed.count(ep) for ep in fleet.endpoints}
    assert tile == f"{max(counts.values()) / len(routed) * len(fleet.endpoints):.2f}×", (tile, counts)
    fair = page.locator(".st-key-chart-share svg text", has_text="fair share").text_content()
    assert fair == f"fair share {100 / len(fleet.endpoints):.1f} %", fair
    assert f"Unrouted: {NUM_REFUSED} requests" in page.locator(".st-key-unrouted").inner_text()
    table, live = _table(page, "endpoint-table"), _table(page, "endpoint-live-table")
    assert sorted(table) == sorted(live) == sorted(fleet.endpoints), table  # one row per endpoint, none unrouted
    assert [table[ep]["requests"] for ep in fleet.endpoints] == [str(counts[ep]) for ep in fleet.endpoints]
    assert live[fleet.endpoints[0]]["KV usage"] == "0.7\u00a0%", live  # 500 blocks of 70,000: not "0 %"


def _table(page, key: str) -> dict[str, dict[str, str]]:
    """A table of the page (container key `key`) as {first cell: {header: cell text}}."""
    rows = page.evaluate(f"""() => [...document.querySelectorAll('.st-key-{key} tr')]
        .map(tr => [...tr.querySelectorAll('th, td')].map(c => c.innerText.trim()))""")
    heads, body = rows[0], rows[1:]
    return {r[0]: dict(zip(heads, r)) for r in body}


# Every element whose content is wider than its box, among the KPI tiles, the endpoint tables and the sidebar's
# selectors (text cut or ellipsised), the tables' own width against their column, and every chart text that lies
# outside its chart.
_CUT_OFF_JS = """() => {
  const out = [];
  const sel = ['[data-testid="stMetric"]', '[data-testid="stMetric"] *', '.st-key-endpoint-table',
               '.st-key-endpoint-table *', '.st-key-endpoint-live-table', '.st-key-endpoint-live-table *',
               '[data-testid="stSidebar"] [data-baseweb="select"] *', '.st-key-ttft-predictions table',
               '.st-key-ttft-predictions table *'].join(', ');
  for (const el of document.querySelectorAll(sel)) {
    if (!el.clientWidth || !el.innerText || !el.innerText.trim()) continue;
    if (el.scrollWidth > el.clientWidth + 1)
      out.push(`${el.tagName}.${el.getAttribute('data-testid') || ''} "${el.innerText.trim().slice(0, 40)}" `
               + `${el.scrollWidth} > ${el.clientWidth}`);
  }
  // Chart texts (axis labels, legends, the fair-share label) inside their chart: Vega clips what lies outside
  // (3 px of slack: a rotated axis title's glyph box starts 2 px left of the chart, its ink inside).
  for (const svg of document.querySelectorAll('[data-testid="stMain"] svg.marks')) {
    const box = svg.getBoundingClientRect();
    for (const t of svg.querySelectorAll('text')) {
      if (getComputedStyle(t).opacity === '0') continue;  // hidden by the axis (labelOverlap, labelBound)
      const r = t.getBoundingClientRect();
      if (r.width && t.textContent.trim() && (r.left < box.left - 3 || r.right > box.right + 3))
        out.push(`chart text "${t.textContent.trim().slice(0, 40)}" ${Math.round(r.left - box.left)}..`
                 + `${Math.round(r.right - box.left)} outside 0..${Math.round(box.width)}`);
      // Vega shortens a label longer than its labelLimit with an ellipsis (a legend's 4th label was cut so).
      if (t.textContent.trim().endsWith('\u2026'))
        out.push(`chart text "${t.textContent.trim().slice(0, 40)}" shortened`);
    }
  }
  return out;
}"""


def _check_nothing_cut_off(page, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 2500})
    page.wait_for_timeout(1500)  # Streamlit lays the columns out again
    assert page.locator('[data-testid="stSidebar"]').is_visible()  # the narrow case keeps the sidebar open
    metrics = page.locator('[data-testid="stMetric"]')
    assert metrics.count() >= 8
    assert page.locator(".st-key-endpoint-table td").count() >= 3 * 11  # every column of both tables
    assert page.locator(".st-key-endpoint-live-table td").count() >= 3 * 5  # index: only with a real pool
    cut = page.evaluate(_CUT_OFF_JS)
    assert cut == [], (width, cut)


def _check_screenshot_command(port: int) -> None:
    """`prefixroute dashboard-screenshot` (the docs' way to a real picture) captures the drawn page, not the
    loading skeleton Chromium's own --screenshot gets: a full page much taller than its viewport."""
    import struct

    out = artifacts_dir() / "dashboard-1280.png"
    out.unlink(missing_ok=True)
    done = subprocess.run(prefixroute_cmd("dashboard-screenshot", "--url", f"http://127.0.0.1:{port}", "--width",
                                          "1280", "--height", "800", "--out", str(out), "--chromium", CHROMIUM),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    width, height = struct.unpack(">II", out.read_bytes()[16:24])  # the PNG header's IHDR
    assert width == 1280 and height > 2500, (width, height)  # every section drawn, far below the first 800 px


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
    from prefixroute.telemetry.store_reader import StoreReader

    with StoreReader(fleet.db) as reader:
        return reader.recent_requests(1)[0]["trace_id"]
