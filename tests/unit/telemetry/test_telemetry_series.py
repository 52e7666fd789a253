"""telemetry/series.py against prometheus_client 0.26's own Counter and Histogram: the same calls give the same
exposition text (the ``_created`` timestamps aside), for any observations; a scrape from another thread while the
loop writes sees whole figures."""

from __future__ import annotations

import re
import threading

import pytest
from hypothesis import given, settings as hsettings, strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.telemetry.metrics import PREDICTION_ERROR_BUCKETS, TTFT_BUCKETS_S
from prefixroute.telemetry.series import FastCounter, FastHistogram

_CREATED = re.compile(r"^(\S+_created(?:\{[^}]*\})?) \S+$", re.MULTILINE)


def _text(registry: CollectorRegistry) -> str:
    return _CREATED.sub(r"\1 T", generate_latest(registry).decode())


labels = st.sampled_from(["10.0.0.1:8000", "10.0.0.2:8000", "b:1"])
amounts = st.floats(min_value=-2.0, max_value=100.0, allow_nan=False, allow_infinity=False)


@hsettings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(labels, amounts), max_size=40), st.sampled_from([TTFT_BUCKETS_S, PREDICTION_ERROR_BUCKETS]))
def test_the_same_calls_expose_the_same_text_as_prometheus_client(calls, buckets) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = FastCounter("x_tokens", "Tokens.", ["endpoint"], registry=ours)
    h1 = FastHistogram("x_seconds", "Seconds.", ["endpoint"], buckets=buckets, registry=ours)
    u1 = FastHistogram("x_plain_seconds", "Unlabelled.", buckets=buckets, registry=ours)
    c2 = Counter("x_tokens", "Tokens.", ["endpoint"], registry=theirs)
    h2 = Histogram("x_seconds", "Seconds.", ["endpoint"], buckets=buckets, registry=theirs)
    u2 = Histogram("x_plain_seconds", "Unlabelled.", buckets=buckets, registry=theirs)
    for ep, amount in calls:
        c1.labels(ep).inc(abs(amount))
        c2.labels(ep).inc(abs(amount))
        h1.labels(ep).observe(amount)
        h2.labels(ep).observe(amount)
        u1.observe(amount)
        u2.observe(amount)
    assert _text(ours) == _text(theirs)


def test_a_bound_is_inclusive_and_the_last_bucket_is_inf() -> None:
    r = CollectorRegistry()
    h = FastHistogram("h_seconds", "H.", buckets=(0.1, 1.0), registry=r)
    for v in (0.1, 0.1000001, 1.0, 7.0):
        h.observe(v)
    got = {s.labels.get("le"): s.value for f in text_string_to_metric_families(generate_latest(r).decode())
           for s in f.samples if s.name == "h_seconds_bucket"}
    assert got == {"0.1": 1, "1.0": 3, "+Inf": 4}


def test_bad_buckets_and_label_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        FastHistogram("h", "H.", buckets=(1.0, 0.5))
    with pytest.raises(ValueError):
        FastCounter("c", "C.", ["a", "b"]).labels("only one")


def test_a_scrape_while_the_loop_writes_sees_whole_figures() -> None:
    """One writer thread, scrapes from this one: every scrape parses, counts never go down, and the final
    figures are exact."""
    r = CollectorRegistry()
    c = FastCounter("w_requests", "W.", ["endpoint"], registry=r)
    h = FastHistogram("w_seconds", "W.", ["endpoint"], buckets=TTFT_BUCKETS_S, registry=r)
    num = 50_000
    done = threading.Event()

    def write() -> None:
        for i in range(num):
            c.labels(f"e{i % 7}").inc()
            h.labels(f"e{i % 7}").observe((i % 100) / 10)
        done.set()

    t = threading.Thread(target=write)
    t.start()
    last = 0.0
    while not done.is_set():
        total = sum(s.value for f in text_string_to_metric_families(generate_latest(r).decode()) for s in f.samples
                    if s.name == "w_requests_total")
        assert total >= last
        last = total
    t.join()
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(r).decode())}
    assert sum(s.value for s in families["w_requests"].samples if s.name == "w_requests_total") == num
    assert sum(s.value for s in families["w_seconds"].samples if s.name == "w_seconds_count") == num
