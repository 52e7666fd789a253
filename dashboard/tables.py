"""The dashboard's figures as text: milliseconds, microseconds and ratios as the page shows them (`format_*`), and
the frames of data.py as the page's HTML tables (`endpoint_table`, `prediction_table`); unknown values show as "–".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

TableColumn = tuple[str, str, Callable[[Any], str]]
"""(frame column, header, text of a value) of a table as shown."""


def format_ratio(v: float | None, digits: int = 1) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 100:.{digits}f} %"


def format_ms(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:,.0f} ms" if v >= 100 else f"{v:.1f} ms"


def format_us(v: float | None) -> str:
    return "–" if v is None else (f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} µs")


# The endpoint tables as shown: (frame column, header, text of a value); unknown values show as "–". Two tables,
# so that each fits a 1,280 px screen whole: what the window's requests did per endpoint, and the endpoints'
# live state as the router's pool sees it now.
_NBSP = "\u00a0"  # inside a number and its unit: a narrow column wraps between columns, never inside a value
ENDPOINT_TABLE_COLUMNS: tuple[TableColumn, ...] = (
    ("endpoint", "endpoint", str),
    ("num_requests", "requests", lambda v: f"{int(v):,}"),
    ("share_ratio", "share", format_ratio),
    ("requests_per_s", "req/s", lambda v: f"{v:.2f}"),
    ("actual_hit_ratio", "hit", format_ratio),
    ("predicted_hit_ratio", "predicted", format_ratio),
    ("ttft_ms_p50", "TTFT p50", format_ms),
    ("ttft_ms_p99", "TTFT p99", format_ms),
    ("mean_in_flight", "in-flight", lambda v: f"{v:.2f}"),
    ("num_errors", "errors", lambda v: f"{int(v):,}"),
    ("num_refused", "refused", lambda v: f"{int(v):,}"),
)
LIVE_TABLE_COLUMNS: tuple[TableColumn, ...] = (
    ("endpoint", "endpoint", str),
    ("healthy", "healthy", lambda v: "yes" if v >= 0.5 else "no"),
    ("running", "running", lambda v: f"{v:.0f}"),
    ("waiting", "waiting", lambda v: f"{v:.0f}"),
    # One decimal: 500 blocks in use of 70,000 read 0.7 %, not 0 %.
    ("kv_cache_usage_ratio", "KV usage", lambda v: format_ratio(v, 1)),
    # The load conversations are placed by (routing/conversations.py): how many the router follows there, and
    # its estimate of the endpoint's recent prefill utilisation.
    ("conversations", "conversations", lambda v: f"{v:.0f}"),
    ("prefill_load_ratio", "prefill load", format_ratio),
    ("index_source", "index", str),
)
_ALWAYS_SHOWN = ("endpoint", "num_requests", "num_errors", "num_refused")


def endpoint_table(frame: pd.DataFrame, columns: Sequence[TableColumn] = ENDPOINT_TABLE_COLUMNS
                   ) -> pd.DataFrame:
    """`endpoint_frame` as text for display, `columns` (ENDPOINT_TABLE_COLUMNS or LIVE_TABLE_COLUMNS) headed by
    their headers; a column with no value in any row is left out (e.g. in-flight from a receiver URL). Empty (no
    column but the endpoint) when no column of `columns` has a value."""
    out = {}
    for col, header, fmt in columns:
        values = frame[col]
        if col not in _ALWAYS_SHOWN and not values.notna().any():
            continue
        out[header] = ["–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt(v).replace(" ", _NBSP)
                       for v in values]
    return pd.DataFrame(out, columns=list(out))



PREDICTION_TABLE_HEADERS = ("endpoint", "requests", "predicted p50", "actual p50", "abs. error p50", "bias p50",
                            "alternative p50")


def prediction_table(frame: pd.DataFrame) -> pd.DataFrame:
    """`prediction_frame` formatted for display (strings: ms, percent), headed PREDICTION_TABLE_HEADERS."""
    def signed(v: float) -> str:
        return "–" if v is None or math.isnan(v) else f"{v * 100:+.1f}\u00a0%"  # no break inside a narrow column

    rows = [(r.endpoint, f"{r.num_requests:,}", format_ms(r.predicted_ttft_ms_p50), format_ms(r.actual_ttft_ms_p50),
             format_ratio(r.ape_ratio_p50), signed(r.error_ratio_p50), format_ms(r.alternative_ttft_ms_p50))
            for r in frame.itertuples()]
    return pd.DataFrame(rows, columns=list(PREDICTION_TABLE_HEADERS)).set_index("endpoint")
