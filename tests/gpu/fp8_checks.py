"""GPU checks, group fp8: both fused ops with e4m3 operands against a dequantized fp64 reference."""
from __future__ import annotations


import torch

import flux_shmem
from common import capture, check, poison, rel_err, weight


def fp8_operands(rt, m, n, k, seed, rowwise):
    """Every PE's e4m3 a [m, k], weight w [n, k] and fp32 scales (per-tensor or one per row of a / column of b),
    quantized from fresh random values, identical on every PE (each computes the reference)."""
    fmax = torch.finfo(torch.float8_e4m3fn).max
    out = []
    for pe in range(rt.world_size):
        g = torch.Generator(device="cuda").manual_seed(seed * 1000 + pe)
        a = torch.randn((m, k), generator=g, device="cuda") * (1 + torch.rand((m, 1), generator=g, device="cuda"))
        w = torch.randn((n, k), generator=g, device="cuda") / k ** 0.5
        sa = (a.abs().amax(1) if rowwise else a.abs().amax()) / fmax
        sb = (w.abs().amax(1) if rowwise else w.abs().amax()) / fmax
        a8 = (a / (sa[:, None] if rowwise else sa)).to(torch.float8_e4m3fn)
        w8 = (w / (sb[:, None] if rowwise else sb)).to(torch.float8_e4m3fn)
        out.append((a8, w8, sa.float().contiguous(), sb.float().contiguous()))
    return out


def fp8_dequantized(a8, w8, sa, sb, dtype=torch.float64):
    """(a, w) as the fp8 kernels multiply them: the e4m3 values times their scales, in `dtype`."""
    a = a8.to(dtype) * (sa.to(dtype)[:, None] if sa.dim() else sa.to(dtype))
    w = w8.to(dtype) * (sb.to(dtype)[:, None] if sb.dim() else sb.to(dtype))
    return a, w


@check("fp8")
def gemm_rs_fp8_matches_torch(rt):
    """Issue 26: GEMMReduceScatter with e4m3 operands and both scale kinds, fused and decomposed, against the
    dequantize-then-fp64 (fp32 for the TP8 shard shape) reference, partials poisoned (NaN) before each call; with
    one PE the op's gemm_only; and a captured CUDA graph replayed on fresh inputs."""
    W = rt.world_size
    shapes = ((512 * W, 512, 256), (128 * W, 264, 208), (1024 * W, 1024, 512), (8192, 8192, 3584 * 2 // W))
    for mode in ("fused", "decomposed"):
        for m, n, k in shapes:
            m = m // W * W
            op = flux_shmem.GEMMReduceScatter(m, n, k, torch.float8_e4m3fn, mode=mode)
            for seed, rowwise in ((7, False), (8, True)):
                ins = fp8_operands(rt, m, n, k, seed + m, rowwise)
                bias = torch.randn(n, device="cuda").bfloat16() if rowwise else None
                torch.cuda.synchronize()
                flux_shmem.barrier()  # nobody still reads my partial: poison it
                poison(op.engine.partial)
                a8, w8, sa, sb = ins[rt.rank]
                out = op(a8, w8.t(), bias, scale_a=sa, scale_b=sb)
                rdt = torch.float32 if m * n * k > 1 << 32 else torch.float64
                seg = m // W
                full = sum(x[rt.rank * seg:(rt.rank + 1) * seg] @ y.t()
                           for x, y in (fp8_dequantized(*t, dtype=rdt) for t in ins))
                ref = full + (bias.to(rdt) if bias is not None else 0)
                e = rel_err(out, ref)
                assert out.dtype == torch.bfloat16 and out.shape == (seg, n) and e < 2e-2, \
                    f"GEMMReduceScatter fp8 {mode} {'rowwise' if rowwise else 'per-tensor'} {m}x{n}x{k}: rel err {e}"
                if rt.rank == 0 and (m, n) == (8192, 8192):
                    print(f"CHECK info: GEMMReduceScatter fp8 {mode} {m}x{n}x{k} "
                          f"{'rowwise' if rowwise else 'per-tensor'}: rel err {e:.2e} "
                          f"({op.call_plan(m).describe()[:160]})", flush=True)
            flux_shmem.barrier()
    m, n, k = 256 * W, 256, 128
    op = flux_shmem.GEMMReduceScatter(m, n, k, torch.float8_e4m3fn, mode="fused")
    captured = fp8_operands(rt, m, n, k, 60, True)
    a8, w8, sa, sb = captured[rt.rank]
    a8, sa = a8.clone(), sa.clone()
    g, out = capture(lambda: op(a8, w8.t(), scale_a=sa, scale_b=sb))
    for seed in range(61, 63):
        # fresh a and scale_a on every PE, the captured weights and scale_b
        ins = [(x, w_, s_, t_) for (x, _, s_, _), (_, w_, _, t_) in
               zip(fp8_operands(rt, m, n, k, seed, True), captured)]
        a8.copy_(ins[rt.rank][0])
        sa.copy_(ins[rt.rank][2])
        poison(out)
        g.replay()
        torch.cuda.synchronize()
        full = sum(x[rt.rank * (m // W):(rt.rank + 1) * (m // W)] @ y.t()
                   for x, y in (fp8_dequantized(*t) for t in ins))
        e = rel_err(out, full)
        assert e < 2e-2, f"graph replay of fp8 GEMMReduceScatter: rel err {e}"
    flux_shmem.barrier()


@check("fp8")
def ag_gemm_fp8_matches_torch(rt):
    """Issue 26: AllGatherGEMM with e4m3 shards and both scale kinds (each PE its own scales, gathered with the
    rows), fused and decomposed, every engine the op may take, against the dequantize-then-fp64 reference."""
    W = rt.world_size
    for mode in ("fused", "decomposed"):
        for m, n, k in ((512 * W, 512, 256), (96 * W, 264, 208), (1024 * W, 1024, 512), (8192, 3584, 8192)):
            op = flux_shmem.AllGatherGEMM(m, n, k, torch.float8_e4m3fn, mode=mode)
            for seed, rowwise in ((9, False), (10, True)):
                ins = fp8_operands(rt, m // W, n, k, seed + m, rowwise)  # every PE's shard, weight and scales
                a8, _, sa, _ = ins[rt.rank]
                _, w8, _, sb = ins[0]  # one weight for this PE (the reference uses the same)
                bias = torch.randn(n, device="cuda").bfloat16() if rowwise else None
                out = op(a8, w8.t(), bias, scale_a=sa, scale_b=sb)
                rdt = torch.float32 if m * n * k > 1 << 32 else torch.float64
                a_full = torch.cat([fp8_dequantized(x, w8, s_, sb, dtype=rdt)[0] for x, _, s_, _ in ins])
                w_deq = fp8_dequantized(a8, w8, sa, sb, dtype=rdt)[1]
                ref = a_full @ w_deq.t() + (bias.to(rdt) if bias is not None else 0)
                e = rel_err(out, ref)
                assert out.dtype == torch.bfloat16 and out.shape == (m, n) and e < 2e-2, \
                    f"AllGatherGEMM fp8 {mode} {'rowwise' if rowwise else 'per-tensor'} {m}x{n}x{k}: rel err {e}"
                if rt.rank == 0 and (m, n) == (8192, 3584):
                    print(f"CHECK info: AllGatherGEMM fp8 {mode} {m}x{n}x{k} {'rowwise' if rowwise else 'per-tensor'}"
                          f": rel err {e:.2e} ({op.call_plan(m).describe()[:160]})", flush=True)
            flux_shmem.barrier()


@check("fp8")
def gemm_rs_fp8_argument_errors(rt):
    """fp8 GEMMReduceScatter: missing or misshapen scales, kn weights and scales on a 16-bit op raise, naming the
    fix, on every PE (no collective is entered)."""
    W = rt.world_size
    op = flux_shmem.GEMMReduceScatter(128 * W, 256, 128, torch.float8_e4m3fn)
    a8, w8, sa, sb = fp8_operands(rt, 128 * W, 256, 128, 70, True)[rt.rank]
    for kwargs, pattern in ((dict(scale_a=None, scale_b=sb), "need scale_a and scale_b"),
                            (dict(scale_a=sa[:-1].contiguous(), scale_b=sb), "scale_a has shape"),
                            (dict(scale_a=sa.double(), scale_b=sb), "float32")):
        try:
            op(a8, w8.t(), **kwargs)
        except ValueError as e:
            assert pattern in str(e), (pattern, str(e))
        else:
            raise AssertionError(f"no error for {pattern}")
    try:
        op(a8, w8.t().contiguous(), scale_a=sa, scale_b=sb)
    except ValueError as e:
        assert "'nk'" in str(e), str(e)
    else:
        raise AssertionError("a kn fp8 weight was accepted")
    op16 = flux_shmem.GEMMReduceScatter(128 * W, 256, 128, torch.bfloat16)
    a = torch.randn(128 * W, 128, device="cuda").bfloat16()
    try:
        op16(a, weight(128, 256, "nk", torch.bfloat16, 1), scale_a=sa, scale_b=sb)
    except ValueError as e:
        assert "float8_e4m3fn" in str(e), str(e)
    else:
        raise AssertionError("scales were accepted by a 16-bit op")
    flux_shmem.barrier()

