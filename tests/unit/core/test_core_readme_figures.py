"""The README's figures equal those of the reports it cites: the results summary is read back against
bench-results/shared-prompts/results.json (the data its report.md is rendered from) and the router-overhead
figures against bench-results/extproc-default/README.md. A rerun that changes a report fails here until the
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


def _default_rows(report: str, prompt: str) -> list[tuple[float, int, float, int, float, int]]:
    """Per run at `prompt`: (default p50 ms, default CPU us, floor p50, floor CPU, HTTP check p50, its CPU)."""
    rows = re.findall(rf"\| {prompt} \| \d \| ([\d.]+) ms / (\d+) us \| ([\d.]+) ms / (\d+) us \| [^|]+ \| "
                      rf"([\d.]+) ms / (\d+) us \|", report)
    assert rows, f"no {prompt} rows in bench-results/extproc-default/README.md"
    return [(float(a), int(b), float(c), int(d), float(e), int(f)) for a, b, c, d, e, f in rows]


def test_readme_overhead_figures_are_the_cited_reports():
    readme = " ".join((REPO / "README.md").read_text().split())
    report = " ".join((REPO / "bench-results" / "extproc-default" / "README.md").read_text().split())
    summary = _summary((REPO / "README.md").read_text())
    assert "bench-results/extproc-default/" in summary
    rows = _default_rows(report, "4 KB")
    # "about 1.0 ms at the median": the default's added p50 at 4 KB, each run within 0.2 ms of it.
    (median,) = _find(r"Routing adds about ([\d.]+) ms at the median", summary)
    assert all(abs(r[0] - float(median)) <= 0.2 for r in rows), (median, rows)
    (hop,) = _find(r"about ([\d.]+-[\d.]+) ms to a request's time-to-first-token", summary)
    low, high = _find(r"\*\*\+([\d.]+)-([\d.]+) ms\*\*", report)
    assert hop == f"{float(low):.1f}-{float(high):.1f}"
    # The paragraph's ranges are the runs' min-max: the HTTP check's p50 and CPU beside the default's.
    said = _find(r"it adds ([\d.]+)-([\d.]+) ms at the median against the default's ([\d.]+)-([\d.]+) ms, and costs "
                 r"the router (\d+)-(\d+) us of CPU per request against (\d+)-(\d+) us", readme)

    def span(values: list[float], fmt: str) -> tuple[str, str]:
        return fmt.format(min(values)), fmt.format(max(values))

    assert said == (*span([r[4] for r in rows], "{:.2f}"), *span([r[0] for r in rows], "{:.2f}"),
                    *span([r[5] for r in rows], "{}"), *span([r[1] for r in rows], "{}")), said


def test_the_check_catches_a_changed_figure():
    results = json.loads((REPO / "bench-results" / "shared-prompts" / "results.json").read_text())
    stale = ("falls 96% (635 ms -> 28 ms), P90 by 64%, and the KV-cache hit ratio rises from 0.61 to 0.88 (what one "
             "infinite cache would reach), with the busiest server at 1.11x its fair share")
    assert readme_figures(stale) != shared_prompts_figures(results)
