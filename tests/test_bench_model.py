"""The analytical model in benchmarks/model.py (pure arithmetic, no measurement)."""
import math

import pytest

from benchmarks import model

MB = 1 << 20


def hw(**kw):
    base = dict(nvlink_gbps=360.0, ib_gbps=40.0, gpus_per_node=8, latency_us=10.0)
    base.update(kw)
    return model.Hardware(**base)


def test_defaults_match_issue():
    h = model.Hardware()
    assert (h.nvlink_gbps, h.ib_gbps, h.gpus_per_node) == (360.0, 40.0, 8)
    assert model.NVLINK_NOMINAL_GBPS == 450.0 and model.IB_NOMINAL_GBPS == 50.0
    with pytest.raises(ValueError):
        model.Hardware(nvlink_gbps=0)
    with pytest.raises(ValueError):
        model.Hardware(latency_us=-1)


def test_topology():
    assert model.topology(8, 8) == (1, 8)
    assert model.topology(16, 8) == (2, 8)
    assert model.topology(2, 8) == (1, 2)  # 2 GPUs of one node
    with pytest.raises(ValueError):
        model.topology(12, 8)


def test_comm_bytes_single_node_has_no_ib():
    nv, ib = model.comm_bytes_per_gpu(10 * MB, world=8, gpus_per_node=8)
    assert nv == 7 * 10 * MB and ib == 0


def test_comm_bytes_two_level_only_when_multi_node():
    # 4 nodes x 8 GPUs: (nodes-1)=3 shards over IB, (L-1)*nodes = 28 shards over NVLink
    nv, ib = model.comm_bytes_per_gpu(MB, world=32, gpus_per_node=8)
    assert ib == 3 * MB
    assert nv == 7 * 4 * MB
    # every shard except our own arrives once per GPU... over IB or NVLink (no double count of our own)
    t = model.comm_time_ms(MB, 32, hw())
    assert t == pytest.approx((28 * MB / 360e9 + 3 * MB / 40e9) * 1e3)
    # IB bandwidth does not matter on one node, matters across nodes
    assert model.comm_time_ms(MB, 8, hw(ib_gbps=1.0)) == model.comm_time_ms(MB, 8, hw(ib_gbps=400.0))
    assert model.comm_time_ms(MB, 16, hw(ib_gbps=1.0)) > model.comm_time_ms(MB, 16, hw(ib_gbps=400.0))


def test_world_one_is_gemm_plus_latency():
    p = model.predict("ag_gemm", 4096, 4096, 4096, 1, 2, hw(gpus_per_node=1), gemm_tflops=500.0)
    t_gemm = 2 * 4096**3 / 500e12 * 1e3
    assert p.t_comm_ms == 0.0 and p.ib_bytes == 0 and p.nvlink_bytes == 0
    assert p.total_ms == pytest.approx(t_gemm + 0.010)


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_ideal_case_reduces_to_max_plus_latency(op):
    # infinite bandwidth: fused = t_gemm + latency = max(t_gemm, t_comm) + latency
    h = hw(nvlink_gbps=math.inf, ib_gbps=math.inf)
    p = model.predict(op, 8192, 28672, 8192, 8, 2, h, gemm_tflops=600.0)
    assert p.t_comm_ms == 0.0
    assert p.total_ms == pytest.approx(max(p.t_gemm_ms, p.t_comm_ms) + p.latency_ms)
    assert p.exposed_ms == 0.0


def test_monotonic_in_bandwidth():
    args = ("ag_gemm", 16384, 49152, 12288, 16, 2)
    prev = None
    for bw in (50.0, 100.0, 200.0, 400.0, 800.0):
        t = model.predict(*args, hw(nvlink_gbps=bw), gemm_tflops=700.0).total_ms
        if prev is not None:
            assert t <= prev
        prev = t
    prev = None
    for bw in (5.0, 10.0, 25.0, 50.0, 100.0):
        t = model.predict(*args, hw(ib_gbps=bw), gemm_tflops=700.0).total_ms
        if prev is not None:
            assert t <= prev
        prev = t
    # and strictly faster somewhere when comm-bound
    slow = model.predict(*args, hw(ib_gbps=5.0), gemm_tflops=700.0).total_ms
    fast = model.predict(*args, hw(ib_gbps=100.0), gemm_tflops=700.0).total_ms
    assert fast < slow


def test_faster_gemm_never_slower():
    a = model.predict("gemm_rs", 8192, 8192, 28672, 8, 2, hw(), gemm_tflops=300.0).total_ms
    b = model.predict("gemm_rs", 8192, 8192, 28672, 8, 2, hw(), gemm_tflops=600.0).total_ms
    assert b <= a


def test_shard_bytes_and_comm_ops():
    # AG moves A rows: [M/world, K]; RS moves C rows: [M/world, N]
    assert model.shard_bytes("ag_gemm", 8192, 28672, 8192, 8, 2) == 1024 * 8192 * 2
    assert model.shard_bytes("gemm_rs", 8192, 8192, 28672, 8, 2) == 1024 * 8192 * 2
    p = model.predict("all_gather", 8192, 28672, 8192, 8, 2, hw())
    expected = 7 * 1024 * 8192 * 2 / 360e9 * 1e3 + 0.010
    assert p.total_ms == pytest.approx(expected)
    assert p.t_gemm_ms == 0.0
    with pytest.raises(ValueError):
        model.predict("ag_gemm", 8192, 28672, 8192, 8, 2, hw())  # needs gemm_tflops
    with pytest.raises(ValueError):
        model.predict("nope", 1, 1, 1, 1, 2, hw())
