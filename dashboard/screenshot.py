"""`prefixroute dashboard-screenshot`: a PNG of the running dashboard as a user sees it.

Headless Chromium's own ``--screenshot`` captures the page at its first paint, which for a Streamlit app is its
loading skeleton: the app has not run yet and no chart is drawn. This command drives Chromium with Playwright,
as the browser test does: it opens the page, waits for the app's content (its title rendered, the script past
its first run, no skeleton left, every chart's axes drawn), lets the charts settle, then captures the full page.

    prefixroute dashboard-screenshot                                  # http://127.0.0.1:8501 -> dashboard.png
    prefixroute dashboard-screenshot --url http://127.0.0.1:8502 --width 1280 --out narrow.png

Needs Playwright (``pip install playwright``; the test extra has it) and a Chromium: ``--chromium PATH``,
``$PREFIXROUTE_CHROMIUM``, a ``chromium`` on PATH (Debian's package), else Playwright's own
(``playwright install chromium``). Exit status 0 with the file written; 1 with the reason when the page did
not show its content in time or no browser could start; 2 for bad settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from typing import Any, ClassVar

from prefixroute import settings
from prefixroute.settings import Settings, setting

# Chromium flags for a headless run in a container or CI (no sandbox: often no user namespaces there).
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run")

# True once the app has shown its content: not the skeleton Chromium's own --screenshot captures.
CONTENT_READY_JS = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  if (!app || app.getAttribute('data-test-script-state') === 'initial') return false;
  if (document.querySelector('[data-testid="stAppSkeleton"], [data-testid="stSkeleton"]')) return false;
  if (!document.querySelector('[data-testid="stMain"] h1')) return false;
  return [...document.querySelectorAll('svg.marks')].every(svg => svg.querySelector('.role-axis'));
}"""


@dataclasses.dataclass(frozen=True)
class ScreenshotSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_SCREENSHOT_"
    TITLE: ClassVar[str] = "Dashboard screenshot"

    url: str = setting("http://127.0.0.1:8501", "The dashboard's URL (`prefixroute up` serves it on 8501).")
    out: str = setting("dashboard.png", "PNG file to write: the whole page (the window is grown to its height), not "
                       "only the first screen.")
    width: int = setting(1500, "Viewport width in pixels (the page lays itself out for it; 1,280 is the narrowest "
                         "the dashboard is laid out for).")
    height: int = setting(1000, "Viewport height in pixels; the picture is the full page whatever its height.")
    timeout_s: float = setting(60.0, "How long to wait for the page to show its content (Streamlit's first run "
                               "takes a few seconds on a small machine).")
    settle_s: float = setting(2.0, "Wait after the content has shown, for the charts to finish drawing (Vega draws "
                              "asynchronously) before capturing.")
    chromium: str = setting("", "Chromium binary; empty: $PREFIXROUTE_CHROMIUM, `chromium` on PATH, else "
                            "Playwright's own.")


def chromium_path(explicit: str = "") -> str | None:
    """The Chromium to launch (see `ScreenshotSettings.chromium`); None: Playwright's own."""
    return explicit or os.environ.get("PREFIXROUTE_CHROMIUM") or shutil.which("chromium") or None


# Streamlit scrolls its main area inside the window, not the document, so a "full page" capture would stop at
# the viewport: the page's real height is the main area's scroll height.
CONTENT_HEIGHT_JS = """() => {
  const main = document.querySelector('[data-testid="stMain"]');
  return Math.ceil(main ? main.scrollHeight : document.documentElement.scrollHeight);
}"""


def capture(page: Any, out: str, *, timeout_s: float = 60.0, settle_s: float = 2.0) -> None:
    """Wait until the Playwright `page` (already at the dashboard) shows its content, grow the viewport to the
    content's whole height, then write a PNG of it to `out`. Raises Playwright's TimeoutError when the content
    does not show within `timeout_s`."""
    page.wait_for_function(CONTENT_READY_JS, timeout=timeout_s * 1000)
    page.wait_for_timeout(settle_s * 1000)
    width = page.viewport_size["width"]
    for _ in range(3):  # a taller window can lay the page out again (charts sized to it): until it stays put
        height = max(page.viewport_size["height"], page.evaluate(CONTENT_HEIGHT_JS))
        if height == page.viewport_size["height"]:
            break
        page.set_viewport_size({"width": width, "height": height})
        page.wait_for_function(CONTENT_READY_JS, timeout=timeout_s * 1000)
        page.wait_for_timeout(500)
    page.screenshot(path=out, full_page=True)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, ScreenshotSettings)


def main(args: argparse.Namespace) -> int:
    try:
        s = settings.from_namespace(ScreenshotSettings, args)
        if s.width < 320 or s.height < 200 or not s.timeout_s > 0 or s.settle_s < 0:
            raise ValueError("--width >= 320, --height >= 200, --timeout-s > 0 and --settle-s >= 0, please")
    except ValueError as exc:
        print(f"prefixroute dashboard-screenshot: {exc}", file=sys.stderr)
        return 2
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("prefixroute dashboard-screenshot: needs Playwright: pip install playwright (and a Chromium: "
              "Debian's `apt-get install chromium`, or `playwright install chromium`)", file=sys.stderr)
        return 1
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(s.chromium), args=list(CHROMIUM_ARGS))
            try:
                page = browser.new_page(viewport={"width": s.width, "height": s.height})
                page.goto(s.url, timeout=s.timeout_s * 1000)
                capture(page, s.out, timeout_s=s.timeout_s, settle_s=s.settle_s)
            finally:
                browser.close()
    except PlaywrightError as exc:  # no browser, the page not reachable, or its content not shown in time
        print(f"prefixroute dashboard-screenshot: {s.url}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"prefixroute dashboard-screenshot: {s.out} ({s.url} at {s.width} px)", flush=True)
    return 0
