"""Cost model vs every calibration point, regime choice, TP approximation."""

from __future__ import annotations

import pytest

from prefixroute.model_servers import cost_model
from prefixroute.model_servers.profiles import PROFILES, get_profile

MODELS = ("llama-3.1-8b", "llama-3.1-70b")


@pytest.mark.parametrize("model", MODELS)
def test_every_calibration_point_within_bounds(model):
    errs = cost_model.fit_errors(cost_model.fit(model))
    assert len(errs) >= 10
    rel = [abs(e) for _, _, e in errs]
    assert max(rel) < 0.15, max(rel)
    assert (sum(r * r for r in rel) / len(rel)) ** 0.5 < 0.06


def test_report_lists_every_point():
    report = cost_model.fit_report()
    n = sum(len(cost_model.calibration_points(m)) for m in MODELS)
    assert sum(1 for line in report.splitlines() if line.rstrip().endswith("%") and "ms" not in line) >= n


@pytest.mark.parametrize(("new", "cached"), [(8192, 0), (4096, 16384), (2048, 0), (32768, 0)])
def test_large_prefills_use_eager_fit(new, cached):
    c = cost_model.fit("llama-3.1-8b")
    assert c.prefill_time_s(new, cached) == pytest.approx(
        c.eager.time_s(new, new * (cached + new / 2), cached, 1))


@pytest.mark.parametrize(("fewer", "more"), [
    ((1024, 0), (2048, 0)), ((256, 0), (256, 16384)), ((8192, 0), (16384, 0)), ((64, 4096), (1024, 4096))])
def test_cost_grows_with_work(fewer, more):
    c = cost_model.fit("llama-3.1-8b")
    assert c.prefill_time_s(*fewer) < c.prefill_time_s(*more)


def test_decode_flat_in_batch_until_kv_reads_dominate():
    c = cost_model.fit("llama-3.1-8b")
    assert c.decode_time_s(8, 512) < 1.2 * c.decode_time_s(1, 512)
    assert c.decode_time_s(128, 8192) > 2 * c.decode_time_s(1, 8192)


def test_tp4_between_ideal_split_and_single_gpu():
    one = cost_model.fit("llama-3.1-70b")
    tp4 = get_profile("llama-3.1-70b-h200-tp4").cost_model()
    for args in ((8192, 0), (256, 8192), (1, 2048)):
        assert one.prefill_time_s(*args) / 4 < tp4.prefill_time_s(*args) < one.prefill_time_s(*args) / 2


@pytest.mark.parametrize(("name", "lo", "hi"), [("llama-3.1-8b-h200", 50_000, 56_000),
                                                 ("llama-3.1-70b-h200-tp4", 60_000, 80_000)])
def test_profile_capacity(name, lo, hi):
    assert lo < PROFILES[name].num_gpu_blocks(16) < hi
    assert PROFILES[name].num_gpu_blocks(32) == PROFILES[name].num_gpu_blocks(16) // 2


def test_unknown_profile():
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("gpt-5")
