"""GPU step-time model fitted to the H200 calibration measurements (package data in `calibration/`).

One engine step runs a batch of sequences; sequence i computes ``n_i`` new tokens on top of ``c_i``
tokens already in its KV cache (a decode step is ``n_i = 1``, ``c_i`` = its context). The step time is
linear in five features of the batch::

    N = sum n_i                          tokens computed (weight GEMMs)
    H = max(N - 256, 0)                  hinge: below ~256 tokens a step is weight-read (memory) bound
    A = sum n_i * (c_i + n_i / 2)        attention work (causal: each new token attends to the cache
                                         and to half of the new tokens on average)
    K = sum c_i                          KV cache tokens read (memory-bound attention reads)
    S = number of sequences              per-sequence overhead (sampling, metadata)

    t(step) = t0 + a*N + h*H + b*A + k*K + s*S

Two coefficient sets per model, as calibration/README.md advises: one fitted to the CUDA-graph
measurements (decode and small prefills, used when N < 2,048) and one fitted to the eager
measurements with >= 2,048 new tokens (compute-bound, used when N >= 2,048). Fitting minimises the
relative error with non-negative coefficients. `fit_report()` (and ``prefixroute model-server-bench
--cost-model-report``) prints the predicted vs measured time of every calibration point.

Tensor parallelism (profile ``llama-3.1-70b-h200-tp4``): the 70B measurements are the compute of the
whole model on one GPU, so a TP degree ``p`` step takes ``t / (p * efficiency)`` plus two all-reduces
per layer, each ``latency + 2 (p-1)/p * N * hidden * 2 bytes / bus_bandwidth`` (ring all-reduce over
NVLink). Defaults: efficiency 0.9, latency 8 us, bus bandwidth 360 GB/s.

All functions here are pure; a `CostModel` is immutable and thread-safe.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from typing import Iterable

import numpy as np

EAGER_THRESHOLD_TOKENS = 2048
"""Steps computing at least this many tokens use the eager (compute-bound) fit, per calibration/README.md."""
HINGE_TOKENS = 256
FEATURES = ("t0", "new_tokens", "hinge", "attention", "kv_reads", "seqs")

CUDAGRAPH_FILE = "h200_llama31_cudagraphs.json"
EAGER_FILE = "h200_llama31_prefill.json"


@dataclasses.dataclass(frozen=True, slots=True)
class CalibrationPoint:
    """One measured step: `kind` is prefill, cached_prefill or decode; `source` the regime (graph/eager)."""

    model: str
    source: str
    kind: str
    num_new_tokens: int  # per sequence (decode: 1)
    num_cached_tokens: int  # per sequence (decode: context)
    num_seqs: int
    seconds: float

    def features(self) -> tuple[float, float, float, float]:
        n, c, s = self.num_new_tokens, self.num_cached_tokens, self.num_seqs
        return float(n * s), float(s * n * (c + n / 2)), float(s * c), float(s)


@dataclasses.dataclass(frozen=True, slots=True)
class LinearCost:
    """Coefficients of one regime: t0 (s), then s per token / attention unit / KV token / sequence."""

    t0: float
    new_tokens: float
    hinge: float
    attention: float
    kv_reads: float
    seqs: float

    def time_s(self, num_new_tokens: float, attention_units: float, num_kv_reads: float, num_seqs: float) -> float:
        hinge = num_new_tokens - HINGE_TOKENS
        return (self.t0 + self.new_tokens * num_new_tokens + (self.hinge * hinge if hinge > 0 else 0.0)
                + self.attention * attention_units + self.kv_reads * num_kv_reads + self.seqs * num_seqs)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorParallel:
    """How a TP-degree step is approximated from the single-GPU compute (see module docstring)."""

    degree: int = 4
    efficiency: float = 0.9
    num_layers: int = 80
    hidden_size: int = 8192
    allreduce_latency_s: float = 8e-6
    bus_bandwidth_bytes_per_s: float = 360e9

    def step_time_s(self, single_gpu_s: float, num_new_tokens: float) -> float:
        p = self.degree
        bytes_per_allreduce = 2.0 * (p - 1) / p * num_new_tokens * self.hidden_size * 2
        allreduce_s = self.allreduce_latency_s + bytes_per_allreduce / self.bus_bandwidth_bytes_per_s
        return single_gpu_s / (p * self.efficiency) + 2 * self.num_layers * allreduce_s


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Step time of one model on one (possibly tensor-parallel) GPU group. Immutable."""

    model: str
    graph: LinearCost
    eager: LinearCost
    tensor_parallel: TensorParallel | None = None
    eager_threshold_tokens: int = EAGER_THRESHOLD_TOKENS

    def step_time_s(self, num_new_tokens: float, attention_units: float, num_kv_reads: float,
                    num_seqs: float) -> float:
        """Seconds for one step with the given batch sums (see module docstring); 0 for an empty step."""
        if num_seqs <= 0:
            return 0.0
        regime = self.eager if num_new_tokens >= self.eager_threshold_tokens else self.graph
        t = regime.time_s(num_new_tokens, attention_units, num_kv_reads, num_seqs)
        if self.tensor_parallel is not None:
            t = self.tensor_parallel.step_time_s(t, num_new_tokens)
        return t

    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """One sequence's prefill of `num_new_tokens` on top of `num_cached_tokens`, in one step."""
        n, c = num_new_tokens, num_cached_tokens
        return self.step_time_s(n, n * (c + n / 2), c, 1)

    def decode_time_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences of `context` tokens each."""
        return self.step_time_s(batch, batch * (context + 0.5), batch * context, batch)

    def point_time_s(self, p: CalibrationPoint) -> float:
        """Prediction for a calibration point, in the same regime it was measured in (no TP)."""
        n, a, k, s = p.features()
        regime = self.eager if p.source == "eager" else self.graph
        return regime.time_s(n, a, k, s)


def _load(name: str) -> dict:
    return json.loads(resources.files("prefixroute.model_servers").joinpath("calibration", name).read_text())


@functools.cache
def calibration_points(model: str) -> tuple[CalibrationPoint, ...]:
    """Every measured point used by the fit: CUDA-graph points, and eager points with >= 2,048 new tokens."""
    out: list[CalibrationPoint] = []
    for source, name in (("graph", CUDAGRAPH_FILE), ("eager", EAGER_FILE)):
        data = _load(name)["models"][model]
        for kind in ("prefill", "cached_prefill", "decode"):
            for e in data.get(kind, ()):
                if kind == "decode":
                    if source == "eager":
                        continue  # eager decode is Python launch-bound; a real engine replays graphs
                    p = CalibrationPoint(model, source, kind, 1, e["context"], e["batch"], e["seconds_full_model"])
                else:
                    if source == "eager" and e["new_tokens"] < EAGER_THRESHOLD_TOKENS:
                        continue
                    p = CalibrationPoint(model, source, kind, e["new_tokens"], e["cached_tokens"], 1,
                                         e["seconds_full_model"])
                out.append(p)
    return tuple(out)


def _design(points: Iterable[CalibrationPoint]) -> tuple[np.ndarray, np.ndarray]:
    rows, y = [], []
    for p in points:
        n, a, k, s = p.features()
        rows.append((1.0, n, max(n - HINGE_TOKENS, 0.0), a, k, s))
        y.append(p.seconds)
    return np.array(rows), np.array(y)


@functools.cache
def fit(model: str, tensor_parallel: TensorParallel | None = None) -> CostModel:
    """Fit both regimes of `model` ("llama-3.1-8b" or "llama-3.1-70b") from the packaged measurements.

    The graph regime fits all six coefficients. The eager points all have one sequence and large N, so
    they cannot separate the memory-bound terms: the eager regime fits only t0, a and b and borrows k and s
    (KV reads, per-sequence cost) from the graph fit, so decode sequences riding in a big chunked-prefill
    step cost what they cost in a graph step.
    """
    pts = calibration_points(model)
    rows, y = _design(p for p in pts if p.source == "graph")
    graph = LinearCost(*map(float, _nnls_on(rows, y, y)))
    rows, y = _design(p for p in pts if p.source == "eager")
    borrowed = rows[:, 4] * graph.kv_reads + rows[:, 5] * graph.seqs
    t0, a, b = _nnls_on(rows[:, [0, 1, 3]], y - borrowed, y)
    eager = LinearCost(float(t0), float(a), 0.0, float(b), graph.kv_reads, graph.seqs)
    return CostModel(model, graph, eager, tensor_parallel)


def _nnls_on(rows: np.ndarray, target: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Non-negative least squares of rows @ coef ~ target, residuals weighted by 1/scale (relative)."""
    x = rows / scale[:, None]
    t = target / scale
    active = list(range(rows.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], t, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    out = np.zeros(rows.shape[1])
    out[active] = np.maximum(coef, 0)
    return out


def fit_errors(cost: CostModel) -> list[tuple[CalibrationPoint, float, float]]:
    """(point, predicted seconds, relative error) for every calibration point of the model."""
    out = []
    for p in calibration_points(cost.model):
        pred = cost.point_time_s(p)
        out.append((p, pred, (pred - p.seconds) / p.seconds))
    return out


def fit_report(models: Iterable[str] = ("llama-3.1-8b", "llama-3.1-70b")) -> str:
    """Human-readable table: coefficients and predicted vs measured for every point, with error summary."""
    lines = []
    for model in models:
        cost = fit(model)
        lines.append(f"== {model} (single GPU; t = t0 + a*N + h*max(N-{HINGE_TOKENS},0) + b*A + k*K + s*S)")
        for name, c in (("graph", cost.graph), ("eager", cost.eager)):
            lines.append(f"  {name:5s}: t0={c.t0 * 1e3:.3f} ms a={c.new_tokens * 1e6:.3f} us/tok "
                         f"h={c.hinge * 1e6:.3f} us/tok b={c.attention * 1e12:.1f} ps/unit "
                         f"k={c.kv_reads * 1e9:.2f} ns/tok s={c.seqs * 1e6:.2f} us/seq")
        lines.append(f"  {'regime':6s} {'kind':15s} {'new':>6s} {'cached':>6s} {'seqs':>4s} "
                     f"{'measured ms':>11s} {'model ms':>9s} {'error':>7s}")
        errs = fit_errors(cost)
        for p, pred, err in errs:
            lines.append(f"  {p.source:6s} {p.kind:15s} {p.num_new_tokens:6d} {p.num_cached_tokens:6d} "
                         f"{p.num_seqs:4d} {p.seconds * 1e3:11.2f} {pred * 1e3:9.2f} {err * 100:+6.1f}%")
        rel = np.array([abs(e) for _, _, e in errs])
        lines.append(f"  points={len(rel)} max |error|={rel.max() * 100:.1f}% "
                     f"rms={np.sqrt((rel ** 2).mean()) * 100:.1f}% median={np.median(rel) * 100:.1f}%")
    return "\n".join(lines)
