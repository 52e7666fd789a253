"""Scrape a `RouterMetrics` registry the way Prometheus does: over its real HTTP server, parsed as text."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from prefixroute.telemetry.metrics import RouterMetrics, start_metrics_server


def scrape_text(metrics: RouterMetrics) -> str:
    """The Prometheus text of one scrape of `metrics` on a fresh loopback server."""
    server = start_metrics_server(metrics, 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5) as resp:
            return resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()


def scrape(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from one scrape of `metrics` on a fresh loopback server."""
    text = scrape_text(metrics)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}
