#!/usr/bin/env python3
"""Decode time per KV-event batch: this checkout's decoder (`prefixroute.kv_events_wire.BatchDecoder`) against an
older one (``--baseline-rev``, default ``main``: common/kv_events_wire.py at that git revision, loaded from git),
alternating A/B rounds in one process so drifting machine load hits both alike.

Batches: one engine step of vLLM shape, a `BlockStored` of ``--blocks`` new 16-token blocks plus a
`BlockRemoved` of as many, in each wire form (array: vLLM <= 0.23; mixed: vLLM 0.24 .. 0.33 and SGLang 0.5.2x;
map: the 0181ea3 commit), plus the golden payloads of tests/data/kv_events (the releases' own bytes). A form
the baseline cannot decode is reported as such. Usage::

    .venv/bin/python scripts/bench_kv_decode.py [--blocks 32] [--rounds 7] [--baseline-rev main]

Prints one JSON object: per form, microseconds per batch (median of rounds) for each decoder and the ratio
new / baseline.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_baseline(rev: str):
    """common/kv_events_wire.py at `rev` as a module (None when git cannot show it)."""
    try:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:common/kv_events_wire.py"], check=True,
                              capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    path = Path(tempfile.mkdtemp()) / "kv_events_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("kv_events_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kv_events_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


def payloads(blocks: int) -> dict[str, list[bytes]]:
    from prefixroute.kv_events_wire import BlockRemoved, BlockStored, EventBatch, encode_batch

    rng = random.Random(1)
    batches = []
    for k in range(64):
        hashes = [rng.getrandbits(64) for _ in range(blocks)]
        batches.append(EventBatch(1.7e9 + k, [
            BlockStored(hashes, rng.getrandbits(64), [rng.randrange(128_000) for _ in range(16 * blocks)], 16,
                        None, "GPU", None),
            BlockRemoved([rng.getrandbits(64) for _ in range(blocks)], "GPU")], 0))
    out = {form: [encode_batch(b, form=form) for b in batches] for form in ("array", "mixed", "map")}
    golden = []
    for p in sorted((REPO / "tests" / "data" / "kv_events").glob("*/capture.json")):
        golden += [base64.b64decode(m[2]) for m in json.loads(p.read_text())["live"]]
    out["golden (9 releases)"] = golden
    return out


def time_decoder(decode, batch: list[bytes], reps: int) -> float | None:
    """Microseconds per payload, or None when `decode` fails on one."""
    try:
        for p in batch:
            decode(p)
    except Exception:  # noqa: BLE001 - a form this decoder does not read
        return None
    t0 = time.perf_counter()
    for _ in range(reps):
        for p in batch:
            decode(p)
    return (time.perf_counter() - t0) / (reps * len(batch)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=32, help="blocks stored (and removed) per batch")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--baseline-rev", default="main")
    args = ap.parse_args()
    from prefixroute.kv_events_wire import BatchDecoder

    base = load_baseline(args.baseline_rev)
    data = payloads(args.blocks)
    results = {}
    for form, batch in data.items():
        new_t, old_t = [], []
        for _ in range(args.rounds):  # A B A B ...
            new_t.append(time_decoder(BatchDecoder().decode, batch, args.reps))
            if base is not None:
                old_t.append(time_decoder(base.decode_batch, batch, args.reps))
        new = statistics.median(new_t)  # type: ignore[type-var]
        old = statistics.median(old_t) if old_t and None not in old_t else None  # type: ignore[type-var]
        results[form] = {"new_us_per_batch": round(new, 2),
                         f"{args.baseline_rev}_us_per_batch": round(old, 2) if old is not None else "does not decode",
                         "ratio_new_over_baseline": round(new / old, 3) if old else None}
    print(json.dumps({"blocks_per_batch": args.blocks, "rounds": args.rounds, "forms": results}, indent=1))


if __name__ == "__main__":
    main()
