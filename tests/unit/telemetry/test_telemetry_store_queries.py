"""`StoreQueries` is the one interface of the store's queries: the SQLite reader and the HTTP client each define
every query themselves (an explicit subclass of a Protocol would otherwise inherit a stub answering None), with
the protocol's parameters, so the dashboard's `DataSource.query` works the same on a file and on a receiver."""

from __future__ import annotations

import inspect

import pytest

from prefixroute.telemetry.client import HttpStoreClient
from prefixroute.telemetry.store_reader import StoreQueries, StoreReader

QUERIES = sorted(name for name, member in vars(StoreQueries).items()
                 if inspect.isfunction(member) and not name.startswith("_"))


def _params(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_lists_the_queries_the_dashboard_and_dump_use():
    assert {"summary", "timeseries", "endpoints", "reasons", "histogram", "ttft_predictions", "recent_requests",
            "iter_requests", "request", "runs", "num_requests", "close"} <= set(QUERIES)


@pytest.mark.parametrize("impl", [StoreReader, HttpStoreClient])
@pytest.mark.parametrize("name", QUERIES)
def test_each_source_defines_each_query_with_the_protocol_parameters(impl, name):
    own = impl.__dict__.get(name)
    assert own is not None, f"{impl.__name__} does not define {name} (it would inherit the protocol's stub)"
    assert _params(own) == _params(vars(StoreQueries)[name])
