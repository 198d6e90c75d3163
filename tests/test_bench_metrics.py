"""Metric arithmetic of benchmarks/metrics.py on hand-computed synthetic timings (no measurement)."""
import math

import pytest

from benchmarks import metrics


def test_median_odd_even_and_unsorted():
    assert metrics.median([3.0, 1.0, 2.0]) == 2.0
    assert metrics.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert metrics.median([7]) == 7.0
    with pytest.raises(ValueError):
        metrics.median([])


def test_gemm_flops_and_tflops():
    assert metrics.gemm_flops(2, 3, 4) == 48
    # 8192^3 GEMM = 1.0995e12 FLOP; in 1.5 ms -> 733.0 TFLOP/s
    f = metrics.gemm_flops(8192, 8192, 8192)
    assert f == 2 * 8192**3
    assert metrics.tflops(f, 1.5) == pytest.approx(2 * 8192**3 / 1.5e-3 / 1e12)
    assert metrics.tflops(1e12, 1000.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        metrics.tflops(1e12, 0.0)
    with pytest.raises(ValueError):
        metrics.gemm_flops(0, 1, 1)


def test_bandwidths():
    # 1 GB in 10 ms = 100 GB/s algorithm bandwidth
    assert metrics.alg_gbps(1e9, 10.0) == pytest.approx(100.0)
    # bus bandwidth, nccl-tests convention: * (w-1)/w
    assert metrics.bus_gbps(1e9, 10.0, 8) == pytest.approx(100.0 * 7 / 8)
    assert metrics.bus_gbps(1e9, 10.0, 1) == 0.0
    with pytest.raises(ValueError):
        metrics.bus_gbps(1e9, 10.0, 0)


def test_speedup():
    assert metrics.speedup(3.0, 2.0) == pytest.approx(1.5)
    assert metrics.speedup(2.0, 4.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        metrics.speedup(1.0, 0.0)
    with pytest.raises(ValueError):
        metrics.speedup(-1.0, 1.0)


def test_overlap_efficiency_hand_computed():
    # serial 10 = gemm 7 + comm 3.  fused 7 -> all comm hidden; 8.5 -> half; 10 -> none; 11 -> worse.
    assert metrics.overlap_efficiency(10.0, 7.0, 3.0) == pytest.approx(1.0)
    assert metrics.overlap_efficiency(10.0, 8.5, 3.0) == pytest.approx(0.5)
    assert metrics.overlap_efficiency(10.0, 10.0, 3.0) == pytest.approx(0.0)
    assert metrics.overlap_efficiency(10.0, 11.0, 3.0) == pytest.approx(-1.0 / 3.0)
    # no communication (world 1): undefined
    assert metrics.overlap_efficiency(10.0, 9.0, 0.0) is None
    with pytest.raises(ValueError):
        metrics.overlap_efficiency(10.0, 9.0, -1.0)


def test_best_possible_speedup():
    assert metrics.best_possible_speedup(4.0, 4.0) == pytest.approx(2.0)
    assert metrics.best_possible_speedup(6.0, 2.0) == pytest.approx(8.0 / 6.0)
    assert metrics.best_possible_speedup(2.0, 6.0) == pytest.approx(8.0 / 6.0)
    assert metrics.best_possible_speedup(5.0, 0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        metrics.best_possible_speedup(0.0, 0.0)


def test_limit_attained_and_consistency():
    t_gemm, t_comm = 6.0, 2.0
    # reaching max(t_gemm, t_comm) is 100 % of the limit
    assert metrics.limit_attained(t_gemm, t_comm, 6.0) == pytest.approx(1.0)
    assert metrics.limit_attained(t_gemm, t_comm, 7.5) == pytest.approx(0.8)
    # speedup over own serial / best possible == limit attained
    t_fused = 7.0
    own = metrics.speedup(t_gemm + t_comm, t_fused)
    assert own / metrics.best_possible_speedup(t_gemm, t_comm) == pytest.approx(
        metrics.limit_attained(t_gemm, t_comm, t_fused))


def test_pct_error():
    assert metrics.pct_error(1.1, 1.0) == pytest.approx(10.0)
    assert metrics.pct_error(0.9, 1.0) == pytest.approx(-10.0)
    with pytest.raises(ValueError):
        metrics.pct_error(1.0, 0.0)
    assert math.isfinite(metrics.pct_error(0.0, 2.0))


def test_stage_medians_and_fused_gemm_window():
    rs = [("barrier (every PE past its previous call)", "main", 0.02), ("fused GEMM (60 CTAs) finished", "main", 1.40),
          ("reduce kernel (4 blocks) finished", "comm", 1.45), ("call done (epoch bumped)", "main", 1.60)]
    assert metrics.fused_gemm_ms(rs) == pytest.approx(1.38)
    ag = [("comm stream past the caller's prior work", "comm", 0.001), ("gather kernel (2 blocks) finished", "comm", 0.5),
          ("start gate opened (every gather block ran)", "main", 0.01), ("fused GEMM (62 CTAs) finished", "main", 1.33)]
    assert metrics.fused_gemm_ms(ag) == pytest.approx(1.32)  # from the gate, not from a comm-stream stage
    assert metrics.fused_gemm_ms([("fused GEMM (8 CTAs) finished", "main", 0.7)]) == pytest.approx(0.7)
    assert metrics.fused_gemm_ms([("call done (epoch bumped)", "main", 0.7)]) is None  # decomposed path
    calls = [[("a", "main", t), ("b", "main", 2 * t)] for t in (1.0, 3.0, 2.0)]
    assert metrics.stage_medians(calls) == {"a": 2.0, "b": 4.0}
    assert metrics.stage_medians([[("a", "main", 1.0)], [("b", "main", 1.0)]]) == {}
    assert metrics.stage_medians([]) == {}
