"""Every GEMM kernel configuration on the GPU (no NVSHMEM, one process): outputs against torch on ragged shapes,
both families and layouts, bias, swizzles, M-tile orders, split-K (whole waves plus a split tail, and everything
split), CUDA-graph replays (the split-K locks must be back at zero after every launch), the AllGather mainloop with
all chunks arrived, and the plain-GEMM entry point. Skipped without a Hopper GPU."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

SHAPES = [(1000, 1288, 520), (8192, 1280, 1024), (256, 4096, 2048), (2048, 3584, 4096)]


def _rel(out, ref) -> float:
    import torch
    return (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()


def _operands(m, n, k, layout, dtype, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    b = (torch.randn(k, n, device="cuda", dtype=dtype, generator=g) if layout == "kn" else
         torch.randn(n, k, device="cuda", dtype=dtype, generator=g).t())
    bias = torch.randn(n, device="cuda", dtype=dtype, generator=g)
    return a, b, bias


@pytest.mark.parametrize("family", ["gemm_rs", "ag_gemm"])
@pytest.mark.parametrize("config", ["128x256_c2x1", "256x128_c1x2", "128x128_c2x1", "128x128_c2x1_pp"])
def test_config_outputs(family, config):
    import torch
    from flux_shmem.kernels import registry
    from flux_shmem.kernels import gemm as kg
    from flux_shmem.kernels.config import Choice
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = registry.get(config)
    for layout in ("kn", "nk"):
        for dtype in (torch.bfloat16, torch.float16):
            g = kg.CutlassGemm.get(family, dtype, layout, config)
            for m, n, k in SHAPES:
                a, b, bias = _operands(m, n, k, layout, dtype)
                ref = a.float() @ b.float() + bias.float()
                tiles_m = -(-m // cfg.tile_m)
                order = torch.randperm(tiles_m, device="cuda", dtype=torch.int32)
                for swizzle, split, use_order, sm in ((8, 1, False, sms), (1, 1, True, sms), (4, 3, True, sms),
                                                      (8, 2, False, sms - 8), (2, 16, False, 17)):
                    split = min(split, cfg.max_splits, -(-k // 64))
                    d = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                    ch = Choice(config, swizzle, split, "forced", "test")
                    args = kg.plain_args(family, a.data_ptr(), b.data_ptr(), d.data_ptr(), bias.data_ptr(), m, n,
                                         k, sm_count=sm, device_id=0, choice=ch)
                    if use_order:
                        args.m_tile_order = order.data_ptr()
                    g.launch(args)
                    torch.cuda.synchronize()
                    err = _rel(d, ref)
                    assert err < 1e-2, (family, config, layout, dtype, (m, n, k), swizzle, split, sm, err)


@pytest.mark.parametrize("config", ["128x256_c2x1", "128x128_c2x1"])
def test_split_k_graph_replays(config):
    """The kernel resets its split-K locks: graph replays (no host work in between) stay correct."""
    import torch
    from flux_shmem.kernels import gemm as kg
    from flux_shmem.kernels.config import Choice
    m, n, k = 8192, 1280, 2048
    a, b, _ = _operands(m, n, k, "nk", torch.bfloat16, seed=3)
    ref = a.float() @ b.float()
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    g = kg.CutlassGemm.get("gemm_rs", torch.bfloat16, "nk", config)
    run = g.prepare(kg.plain_args("gemm_rs", a.data_ptr(), b.data_ptr(), d.data_ptr(), 0, m, n, k, sm_count=132,
                                  device_id=0, choice=Choice(config, 8, 3, "forced", "test")))
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
        run()
    for _ in range(3):
        d.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(d, ref) < 1e-2


@pytest.mark.parametrize("config", ["128x256_c2x1", "256x128_c1x2", "128x128_c2x1"])
def test_stream_k_tails(config):
    """Stream-K tails whose ranges straddle tiles (a cluster ends one tile and starts the next; pieces of unequal
    K), above and below one wave and on odd SM counts, unaligned and aligned to a few chunk boundaries per tile
    (tail_chunks): right outputs, and bitwise the same on a second launch (the pieces add up in a fixed order)."""
    import torch
    from flux_shmem.kernels import config as kconfig
    from flux_shmem.kernels import gemm as kg
    from flux_shmem.kernels import registry
    cfg = registry.get(config)
    g = kg.CutlassGemm.get("gemm_rs", torch.bfloat16, "nk", config)
    for (m, n, k), sm in (((8192, 1280, 1024), 132), ((1024, 768, 4096), 132), ((3000, 1000, 3000), 100),
                          ((2048, 3584, 1536), 17)):
        a, b, _ = _operands(m, n, k, "nk", torch.bfloat16, seed=m + n)
        ref = a.float() @ b.float()
        for split, chunks in ((2, 0), (3, 0), (16, 0), (2, 2), (2, 4), (16, 3)):
            split = min(split, -(-k // 64))
            cm, cn = kconfig.cluster_tiles(cfg, m, n)
            plan = kconfig.tail_plan(cm * cn, kconfig.persistent_clusters(cfg, sm), split, -(-k // 64), chunks)
            outs = []
            for _ in range(2):
                d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                g.launch(kg.plain_args("gemm_rs", a.data_ptr(), b.data_ptr(), d.data_ptr(), 0, m, n, k,
                                       sm_count=sm, device_id=0,
                                       choice=kconfig.Choice(config, 4, split, "forced", "test", chunks=chunks)))
                torch.cuda.synchronize()
                outs.append(d)
            assert _rel(outs[0], ref) < 1e-2, (config, (m, n, k), sm, split, chunks, plan)
            assert torch.equal(outs[0], outs[1]), (config, (m, n, k), sm, split, chunks, plan)


def test_split_k_workspace_shared_by_shapes():
    """One instance's workspace serves split launches of different shapes: a smaller split after a larger one
    finds its locks at zero (they once lay after the partials, where an earlier shape's fp32 partials were, and
    the splits waited forever)."""
    import torch
    from flux_shmem.kernels import gemm as kg
    from flux_shmem.kernels.config import Choice
    g = kg.CutlassGemm("gemm_rs", torch.bfloat16, "nk", "128x256_c2x1")  # its own workspace, fresh
    for m, split in ((8192, 2), (1024, 3), (8192, 2), (1024, 3)):  # 132 then 120 reduction slots on 132 SMs
        n, k = 1280, 8192
        a, b, _ = _operands(m, n, k, "nk", torch.bfloat16, seed=m + split)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        g.launch(kg.plain_args("gemm_rs", a.data_ptr(), b.data_ptr(), d.data_ptr(), 0, m, n, k, sm_count=132,
                               device_id=0, choice=Choice("128x256_c2x1", 8, split, "forced", "test")))
        torch.cuda.synchronize()
        assert _rel(d, a.float() @ b.float()) < 1e-2, (m, split)


def test_ag_mainloop_with_all_chunks_arrived():
    import torch
    from flux_shmem.kernels import abi
    from flux_shmem.kernels import gemm as kg
    from flux_shmem.kernels.config import choose
    m, n, k = 4096, 3584, 2048
    a, b, _ = _operands(m, n, k, "nk", torch.bfloat16, seed=5)
    ref = a.float() @ b.float()
    flags = torch.ones(4, dtype=torch.int64, device="cuda")
    epoch = torch.ones(1, dtype=torch.int64, device="cuda")
    for config in ("128x256_c2x1", "128x128_c2x1_pp"):
        ch = choose(m, n, k, "bf16", "nk", 124, configs=[config], use_cache=False)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        args = kg.FsAgGemmArgs(m=m, n=n, k=k, a=a.data_ptr(), b=b.data_ptr(), d=d.data_ptr(), sm_count=124,
                               chunk_flags=flags.data_ptr(), epoch=epoch.data_ptr(), rows_per_shard=m,
                               chunk_rows=m // 4, chunks_per_shard=4, wait=1, swizzle=ch.swizzle, splits=ch.split,
                               ctx=abi.Ctx(timeout_ns=int(10e9), n_pes=1, trap_on_timeout=1))
        kg.CutlassGemm.get("ag_gemm", torch.bfloat16, "nk", config).launch(args)
        torch.cuda.synchronize()
        assert _rel(d, ref) < 1e-2, config


def test_plain_gemm_entry_point():
    import torch
    from flux_shmem.kernels import plain
    a, b, bias = _operands(8192, 1280, 8192, "nk", torch.bfloat16, seed=7)
    out = plain.gemm(a, b, bias)
    assert _rel(out, a.float() @ b.float() + bias.float()) < 1e-2
    out2 = plain.gemm(a, b, family="ag_gemm", sm_count=66)
    assert _rel(out2, a.float() @ b.float()) < 1e-2
