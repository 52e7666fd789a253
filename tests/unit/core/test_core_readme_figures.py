"""The README's figures equal those of the reports it cites: the results summary is read back against
bench-results/shared-prompts/results.json (the data its report.md is rendered from) and the router-overhead
figures against bench-results/routing-authz-http/README.md. A rerun that changes a report fails here until the
README says the new figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _summary(readme: str) -> str:
    block = readme.split("<!-- results-summary:start -->", 1)[1].split("<!-- results-summary:end -->", 1)[0]
    return " ".join(block.split())


def _find(pattern: str, text: str) -> tuple[str, ...]:
    m = re.search(pattern, text)
    assert m, f"README results summary no longer says /{pattern}/: update this test with it"
    return m.groups()


def shared_prompts_figures(results: dict) -> dict[str, str]:
    """The summary's figures as the README prints them, computed from the shared-prompts results.json."""
    runs = {r["router"]: r for r in results["runs"]}
    rand, ours = runs["prefixroute:random"], runs["prefixroute:prefix"]
    p50 = ours["ttft_ms"]["p50"] / rand["ttft_ms"]["p50"]
    p90 = ours["ttft_ms"]["p90"] / rand["ttft_ms"]["p90"]
    return {"p50_drop": f"{1 - p50:.0%}", "p50_random_ms": f"{rand['ttft_ms']['p50']:.0f}",
            "p50_ours_ms": f"{ours['ttft_ms']['p50']:.0f}", "p90_drop": f"{1 - p90:.0%}",
            "hit_random": f"{rand['hit_ratio']:.2f}", "hit_ours": f"{ours['hit_ratio']:.2f}",
            "upper_bound": f"{results['upper_bound_hit_ratio']:.2f}",
            "max_share": f"{ours['extra']['max_share_over_fair']:.2f}"}


def readme_figures(summary: str) -> dict[str, str]:
    p50_drop, p50_random, p50_ours = _find(r"falls (\d+%) \((\d+) ms -> (\d+) ms\)", summary)
    (p90_drop,) = _find(r"P90 by (\d+%)", summary)
    hit_random, hit_ours = _find(r"hit ratio rises from ([\d.]+) to ([\d.]+) \(what one infinite cache", summary)
    (max_share,) = _find(r"busiest server at ([\d.]+)x", summary)
    return {"p50_drop": p50_drop, "p50_random_ms": p50_random, "p50_ours_ms": p50_ours, "p90_drop": p90_drop,
            "hit_random": hit_random, "hit_ours": hit_ours, "upper_bound": hit_ours, "max_share": max_share}


def test_readme_summary_matches_the_shared_prompts_results():
    summary = _summary((REPO / "README.md").read_text())
    assert "`bench-results/shared-prompts/`" in summary
    results = json.loads((REPO / "bench-results" / "shared-prompts" / "results.json").read_text())
    assert readme_figures(summary) == shared_prompts_figures(results)


def test_readme_overhead_figures_are_the_cited_reports():
    readme = " ".join((REPO / "README.md").read_text().split())
    report = " ".join((REPO / "bench-results" / "routing-authz-http" / "README.md").read_text().split())
    summary = _summary((REPO / "README.md").read_text())
    assert "bench-results/routing-authz-http/" in summary
    # "about 0.4 ms at the median": the HTTP ext_authz row at 4 KB, 0.40-0.44 ms.
    (median,) = _find(r"Routing adds about ([\d.]+) ms at the median", summary)
    low, high = _find(r"\| 4 KB \| \*\*ext_authz, HTTP\*\* \| \*\*([\d.]+)-([\d.]+) ms\*\*", report)
    assert f"{float(low):.1f}" == f"{float(high):.1f}" == median
    (hop,) = _find(r"about ([\d.]+-[\d.]+) ms to a request's time-to-first-token", summary)
    assert f"~{hop} ms" in report
    latency = _find(r"added latency falls from ([\d.]+-[\d.]+) to ([\d.]+-[\d.]+) ms", readme)
    cpu = _find(r"CPU per request from (\d+-\d+) to (\d+-\d+) us", readme)
    row = _find(r"\| 4 KB \| ext_proc \(runs 1-3\) \| ([\d.]+-[\d.]+) ms \| [^|]+ \| (\d+-\d+) us \|", report)
    new = _find(r"\| 4 KB \| \*\*ext_authz, HTTP\*\* \| \*\*([\d.]+-[\d.]+) ms\*\* \| [^|]+ \| \*\*(\d+-\d+) us\*\*", report)
    assert (latency, cpu) == ((row[0], new[0]), (row[1], new[1]))


def test_the_check_catches_a_changed_figure():
    results = json.loads((REPO / "bench-results" / "shared-prompts" / "results.json").read_text())
    stale = ("falls 96% (635 ms -> 28 ms), P90 by 64%, and the KV-cache hit ratio rises from 0.61 to 0.88 (what one "
             "infinite cache would reach), with the busiest server at 1.11x its fair share")
    assert readme_figures(stale) != shared_prompts_figures(results)
