#!/usr/bin/env python3
"""Regenerate the golden KV-event payloads: run each release's own publisher and record the bytes it sends.

    .venv/bin/python tests/data/kv_events/generate.py --download          # every release in RELEASES
    .venv/bin/python tests/data/kv_events/generate.py vllm-0.33.0         # one (its wheel must be found)
    PREFIXROUTE_ENGINE_WHEELS=/some/dir .venv/bin/python tests/data/kv_events/generate.py

For each release named in ``tests/helpers/engines.py`` (RELEASES: vLLM 0.9.0, 0.11.0, 0.17.0, 0.23.0, 0.24.0,
0.26.0, 0.33.0, 0.34.0; SGLang 0.5.10, 0.5.23): find its wheel (``--download``: ``pip download --no-deps`` into
``.cache/engine-wheels``, ignored by git), extract its KV-event modules, run ``tests/helpers/engine_driver.py
capture`` (the release's event classes and ``ZmqEventPublisher``, with stubs for its other imports) and write
``<release>/capture.json``: the live frames (topic, seq, payload) and two replays, base64, the sha256 of every
release file that ran, and the expected outcome (the GPU block set after each batch, the prompts the router
must match). vLLM >= 0.33 is also captured with bytes block hashes (``capture-bytes-hashes.json``), and vLLM
0.34.0 with its default 64-token blocks (``capture-block-64.json``), SGLang 0.5.23 at its default page of 1 token
(``capture-page-1.json``).

For vLLM 0.33.0, 0.34.0 and SGLang 0.5.23 (SURFACE_RELEASES) it also writes
``tests/data/engines/<release>/surface.json``: the /metrics text their own metrics code produces for known
figures (vLLM's ``PrometheusStatLogger`` and its offloading connector's ``OffloadPromMetrics`` with
``vllm:kv_offload_config_info``, SGLang's ``SchedulerMetricsCollector``) and, for vLLM, the JSON schemas of
its own ``ErrorResponse`` and ``ResponsesResponse`` models (tests/unit/engines/test_engine_surface.py checks our
scraper and bodies against them).
tests/unit/kv_events/test_golden_payloads.py decodes them all; a release's wheel is ~350 MB (vLLM), so the
files are committed and CI never downloads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the helpers package

from helpers import engines  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("releases", nargs="*", help=f"default: all of {', '.join(engines.BY_NAME)}")
    ap.add_argument("--download", action="store_true", help="pip download a wheel that is not found")
    args = ap.parse_args()
    names = args.releases or list(engines.BY_NAME)
    unknown = [n for n in names if n not in engines.BY_NAME]
    if unknown:
        ap.error(f"unknown release(s) {unknown}; known: {', '.join(engines.BY_NAME)}")
    for name in names:
        release = engines.BY_NAME[name]
        wheel = engines.find_wheel(release)
        if wheel is None:
            if not args.download:
                print(f"{name}: no wheel found (pass --download, or PREFIXROUTE_ENGINE_WHEELS=DIR)", file=sys.stderr)
                return 1
            wheel = engines.download_wheel(release)
        with tempfile.TemporaryDirectory(prefix=f"kv-{name}-") as tmp:
            src = engines.extract(wheel, Path(tmp))
            out_dir = engines.DATA_DIR / name
            out_dir.mkdir(parents=True, exist_ok=True)
            since_033 = release.dist == "vllm" and tuple(map(int, release.version.split("."))) >= (0, 33)
            variants = [("capture.json", False, 16, 0)] + (
                [("capture-bytes-hashes.json", True, 16, 0)] if since_033 else [])
            if name == "vllm-0.34.0":  # its default block size on CUDA: 64 (the router hashes 16-token blocks)
                variants.append(("capture-block-64.json", False, 64, 0))
            if name == "sglang-0.5.23":  # its default page: 1 token (merged into the router's 16-token blocks)
                variants.append(("capture-page-1.json", False, 16, 1))
            for filename, bytes_hashes, block_size, page_size in variants:
                cap = engines.capture(release, src, bytes_hashes=bytes_hashes, block_size=block_size,
                                      page_size=page_size)
                cap["requirement"] = release.requirement
                cap["why"] = release.why
                cap["wheel"] = wheel.name
                (out_dir / filename).write_text(json.dumps(cap, indent=1, sort_keys=True) + "\n")
                print(f"{name}: {len(cap['live'])} batches -> {out_dir / filename}")
            if name in engines.SURFACE_RELEASES:
                surf = engines.surface(release, src)
                surf["requirement"] = release.requirement
                surf["wheel"] = wheel.name
                out = engines.SURFACE_DIR / name / "surface.json"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(surf, indent=1, sort_keys=True) + "\n")
                print(f"{name}: /metrics{' and models' if 'schemas' in surf else ''} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
