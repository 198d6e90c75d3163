"""FP8 (e4m3) GEMM kernels on the GPU (issue 26; no NVSHMEM, one process): every kernel configuration's fp8 build
against a dequantize-then-fp32 torch reference on ragged shapes, per-tensor / rowwise / mixed scales, bias,
swizzles, M-tile orders and split-K; fresh random inputs per case, outputs poisoned with NaN before each launch.
Also kernels.gemm.gemm end to end against torch._scaled_mm, scales read from device memory at run time (CUDA-graph
replays see new values), and the AllGather mainloop with all chunks arrived. Skipped without a Hopper GPU."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

SHAPES = [(1000, 1288, 528), (8192, 1280, 1024), (256, 4096, 2048), (2048, 3584, 4096)]
REL_TOL = 3e-2
E4M3_MAX = 448.0


def _rel(out, ref) -> float:
    import torch
    return (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()


def _quantize(x, rowwise: bool):
    """(e4m3 tensor, fp32 scale) with x ~= q * scale: one scale per row of x, or one for all of it."""
    import torch
    amax = x.abs().amax(dim=1, keepdim=True) if rowwise else x.abs().amax()
    scale = (amax.float() / E4M3_MAX).clamp(min=1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


def _operands(m, n, k, rows_a: bool, rows_b: bool, seed: int):
    """a [m, k], w [n, k] (B = w.t()), their scales in the shapes kernels.gemm takes, bias, and the reference
    out = (a8 * sa) @ (w8 * sw).t() + bias computed in fp32 from the quantized values."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=g) * 3
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    a8, sa = _quantize(a, rows_a)          # [m, 1] or []
    w8, sw = _quantize(w, rows_b)          # [n, 1] or []
    sb = sw.reshape(1, n) if rows_b else sw  # one per column of B = w.t()
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    ref = (a8.float() * sa) @ (w8.float() * sw).t() + bias.float()
    return a8, w8, sa, sb, bias, ref


@pytest.mark.parametrize("family", ["gemm_rs", "ag_gemm"])
@pytest.mark.parametrize("config", ["128x256_c2x1", "256x128_c1x2", "128x128_c2x1", "128x128_c2x1_pp"])
def test_fp8_config_outputs(family, config):
    import torch
    from flux_shmem.kernels import gemm as kg
    from flux_shmem.kernels import registry
    from flux_shmem.kernels.config import Choice
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = registry.get(config)
    g = kg.CutlassGemm.get(family, torch.float8_e4m3fn, "nk", config)
    seed = 0
    for m, n, k in SHAPES:
        for rows_a, rows_b in ((False, False), (True, True), (True, False), (False, True)):
            seed += 1
            a8, w8, sa, sb, bias, ref = _operands(m, n, k, rows_a, rows_b, seed)
            sa_v, sb_v, kind = kg.fp8_scales(a8, w8.t(), sa, sb, bias=bias)
            tiles_m = -(-m // cfg.tile_m)
            order = torch.randperm(tiles_m, device="cuda", dtype=torch.int32)
            for swizzle, split, use_order, sm, with_bias in ((8, 1, False, sms, True), (1, 1, True, sms, False),
                                                             (4, 3, True, sms, True), (2, 16, False, 17, True)):
                split = min(split, cfg.max_splits, -(-k // registry.tile_k("e4m3")))
                d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                args = kg.plain_args(family, a8.data_ptr(), w8.data_ptr(), d.data_ptr(),
                                     bias.data_ptr() if with_bias else 0, m, n, k, sm_count=sm, device_id=0,
                                     choice=Choice(config, swizzle, split, "forced", "test"),
                                     scale_a=sa_v.data_ptr(), scale_b=sb_v.data_ptr(), scale_kind=kind)
                if use_order:
                    args.m_tile_order = order.data_ptr()
                g.launch(args)
                torch.cuda.synchronize()
                want = ref if with_bias else ref - bias.float()
                err = _rel(d, want)
                assert err <= REL_TOL, (family, config, (m, n, k), rows_a, rows_b, swizzle, split, sm, err)


def test_fp8_gemm_entry_point_matches_scaled_mm():
    """kernels.gemm.gemm on fp8 operands: the dequantized reference and, where torch has it, torch._scaled_mm
    (its scale shapes: [] / [] per-tensor, [M, 1] / [1, N] rowwise)."""
    import torch
    from flux_shmem.kernels import plain
    for i, (m, n, k) in enumerate(((4096, 4096, 4096), (1000, 1288, 528))):
        for rowwise in (False, True):
            a8, w8, sa, sb, bias, ref = _operands(m, n, k, rowwise, rowwise, seed=100 + 2 * i + rowwise)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            plain.gemm(a8, w8.t(), bias, scale_a=sa, scale_b=sb, out=out)
            torch.cuda.synchronize()
            assert _rel(out, ref) <= REL_TOL, ((m, n, k), rowwise)
            try:
                theirs = torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=torch.bfloat16)
            except (RuntimeError, TypeError):  # an older torch without rowwise scales
                continue
            assert _rel(out, theirs.float()) <= REL_TOL, ((m, n, k), rowwise)


def test_fp8_scales_are_read_at_run_time():
    """Scales are device pointers: a captured graph replays with the values the scale tensors hold then."""
    import torch
    from flux_shmem.kernels import gemm as kg
    from flux_shmem.kernels.config import choose
    m, n, k = 2048, 2048, 2048
    a8, w8, sa, sb, bias, ref = _operands(m, n, k, True, True, seed=7)
    ref = ref - bias.float()  # launched without bias
    sa_v, sb_v, kind = kg.fp8_scales(a8, w8.t(), sa, sb)
    ch = choose(m, n, k, torch.float8_e4m3fn, "nk", 132, use_cache=False)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    g = kg.CutlassGemm.get("gemm_rs", torch.float8_e4m3fn, "nk", ch.config)
    run = g.prepare(kg.plain_args("gemm_rs", a8.data_ptr(), w8.data_ptr(), d.data_ptr(), 0, m, n, k, sm_count=132,
                                  device_id=0, choice=ch, scale_a=sa_v.data_ptr(), scale_b=sb_v.data_ptr(),
                                  scale_kind=kind))
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for factor in (1.0, 2.0, 0.5):
        sa_v.mul_(factor)  # in place: the captured pointer now holds scaled values
        ref = ref * factor
        d.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(d, ref) <= REL_TOL, factor


def test_fp8_ag_mainloop_with_all_chunks_arrived():
    import torch
    from flux_shmem.kernels import gemm as kg
    from flux_shmem.kernels.config import choose
    m, n, k = 4096, 3584, 2048
    a8, w8, sa, sb, bias, ref = _operands(m, n, k, True, True, seed=5)
    want = ref - bias.float()  # launched without bias
    sa_v, sb_v, kind = kg.fp8_scales(a8, w8.t(), sa, sb)
    flags = torch.ones(4, dtype=torch.int64, device="cuda")
    epoch = torch.ones(1, dtype=torch.int64, device="cuda")
    for config in ("128x256_c2x1", "128x128_c2x1_pp"):  # (configurations the chooser skips for e4m3, spilling)
        ch = choose(m, n, k, "bf16", "nk", 124, configs=[config], use_cache=False)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        args = kg.FsAgGemmArgs(m=m, n=n, k=k, a=a8.data_ptr(), b=w8.data_ptr(), d=d.data_ptr(), sm_count=124,
                               chunk_flags=flags.data_ptr(), epoch=epoch.data_ptr(), rows_per_shard=m,
                               chunk_rows=m // 4, chunks_per_shard=4, wait=1, swizzle=ch.swizzle, splits=ch.split,
                               scale_a=sa_v.data_ptr(), scale_b=sb_v.data_ptr(), scale_kind=kind)
        kg.CutlassGemm.get("ag_gemm", torch.float8_e4m3fn, "nk", config).launch(args)
        torch.cuda.synchronize()
        assert _rel(d, want) <= REL_TOL, config


def test_fp8_tuner_measures_against_scaled_mm(tmp_path):
    """flux_shmem.kernels.tune on e4m3: every candidate checked against torch._scaled_mm and timed; the entry is
    one of the configurations the fp8 builds run from registers and lands in the cache under e4m3."""
    import torch
    from flux_shmem.kernels import registry, tune, tune_cache
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = tmp_path / "tune.json"
    res = tune.tune_shape(2048, 1280, 4096, "e4m3", "nk", sms, cache_path=path, rounds=2, max_candidates=4)
    assert not res.rejected, res.rejected
    assert res.entry.config in registry.names_for("e4m3") and res.entry.ms > 0
    assert tune.label(res.heuristic) in res.times_ms
    keys = list(tune_cache.TuneCache(path).entries())
    assert len(keys) == 1 and f"|{registry.tuning_dtype('e4m3')}|nk|2048x1280x4096" in keys[0]
