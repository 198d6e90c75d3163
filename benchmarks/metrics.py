"""Pure metric arithmetic for the overlap benchmarks (no torch, no GPU).

All times are in milliseconds, sizes in bytes, bandwidths in GB/s (1e9 B/s),
throughput in TFLOP/s (1e12 FLOP/s).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Sequence

__all__ = [
    "median",
    "gemm_flops",
    "tflops",
    "alg_gbps",
    "bus_gbps",
    "speedup",
    "overlap_efficiency",
    "best_possible_speedup",
    "limit_attained",
    "pct_error",
    "stage_medians",
    "fused_gemm_ms",
]


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


def median(samples: Iterable[float]) -> float:
    """Median of a non-empty sequence (mean of the two middle values when even)."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("median of an empty sequence")
    mid = len(xs) // 2
    if len(xs) % 2:
        return xs[mid]
    return 0.5 * (xs[mid - 1] + xs[mid])


def gemm_flops(m: int, n: int, k: int) -> int:
    """FLOPs of one [m, k] x [k, n] GEMM (a multiply-add counts as 2)."""
    if min(m, n, k) <= 0:
        raise ValueError(f"GEMM dims must be positive, got m={m} n={n} k={k}")
    return 2 * int(m) * int(n) * int(k)


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return float(flops) / (_positive("ms", ms) * 1e-3) / 1e12


def alg_gbps(nbytes: float, ms: float) -> float:
    """Algorithm bandwidth: ``nbytes`` / time, in GB/s."""
    return float(nbytes) / (_positive("ms", ms) * 1e-3) / 1e9


def bus_gbps(nbytes: float, ms: float, world: int) -> float:
    """Bus bandwidth (nccl-tests convention) of an all-gather / reduce-scatter.

    ``nbytes`` is the size of the whole tensor (the gathered output of an
    all-gather, the full input of a reduce-scatter).  Each GPU moves
    ``(world-1)/world`` of it, so busbw = algbw * (world-1)/world.  It is 0
    for world == 1 (nothing moves).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return alg_gbps(nbytes, ms) * (world - 1) / world


def speedup(t_ref: float, t_new: float) -> float:
    """How many times faster ``t_new`` is than ``t_ref`` (>1 means faster)."""
    return _positive("t_ref", t_ref) / _positive("t_new", t_new)


def overlap_efficiency(t_serial: float, t_fused: float, t_comm: float) -> Optional[float]:
    """Share of the communication time hidden: (t_serial - t_fused) / t_comm.

    1.0 means the fused op is as fast as the serial one minus all of its
    communication; 0 means nothing was hidden; negative means the fused op is
    slower than running serially.  Values above 1 are possible when the fused
    op also computes faster than the serial baseline.  Returns None when there
    is no communication (t_comm == 0, e.g. world == 1).
    """
    _positive("t_serial", t_serial)
    _positive("t_fused", t_fused)
    t_comm = float(t_comm)
    if t_comm < 0 or not math.isfinite(t_comm):
        raise ValueError(f"t_comm must be >= 0, got {t_comm!r}")
    if t_comm == 0.0:
        return None
    return (t_serial - t_fused) / t_comm


def best_possible_speedup(t_gemm: float, t_comm: float) -> float:
    """Speedup of perfect overlap over running GEMM then communication serially.

    (t_gemm + t_comm) / max(t_gemm, t_comm); between 1 (one part is
    negligible) and 2 (both parts take equally long).
    """
    t_gemm = float(t_gemm)
    t_comm = float(t_comm)
    if t_gemm < 0 or t_comm < 0 or max(t_gemm, t_comm) <= 0:
        raise ValueError(f"need t_gemm, t_comm >= 0 and not both 0, got {t_gemm}, {t_comm}")
    return (t_gemm + t_comm) / max(t_gemm, t_comm)


def limit_attained(t_gemm: float, t_comm: float, t_fused: float) -> float:
    """max(t_gemm, t_comm) / t_fused: 1.0 means the fused op reached the overlap limit."""
    t_gemm = float(t_gemm)
    t_comm = float(t_comm)
    if t_gemm < 0 or t_comm < 0 or max(t_gemm, t_comm) <= 0:
        raise ValueError(f"need t_gemm, t_comm >= 0 and not both 0, got {t_gemm}, {t_comm}")
    return max(t_gemm, t_comm) / _positive("t_fused", t_fused)


def pct_error(predicted: float, measured: float) -> float:
    """Signed model error in percent of the measurement (+ means over-predicted)."""
    return 100.0 * (float(predicted) - float(measured)) / _positive("measured", measured)


def stage_medians(calls: Sequence[Sequence[tuple]]) -> Dict[str, float]:
    """Median ms since call start of each stage label over calls of (label, stream, ms) lists (a fused op's
    timed stages, flux_shmem.runtime.stall), in the first call's order; labels every call has."""
    if not calls:
        return {}
    labels = [lab for lab, _s, _t in calls[0]]
    per = [{lab: t for lab, _s, t in c} for c in calls]
    return {lab: median([p[lab] for p in per]) for lab in labels if all(lab in p for p in per)}


def fused_gemm_ms(stages: Sequence[tuple]) -> Optional[float]:
    """How long the GEMM inside a fused call ran, from one call's (label, stream, ms since call start): from the
    main stream's stage before the 'fused GEMM ... finished' stage (the barrier or start gate it launched after;
    the call's start if none) to that stage. None if the call had no fused GEMM stage."""
    start = 0.0
    for label, stream, t in stages:
        if label.startswith("fused GEMM"):
            return t - start
        if stream == "main":
            start = t
    return None
