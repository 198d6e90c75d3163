"""GPU checks run under mpirun (tests/test_gpu.py launches this; also usable by hand):

    flux-launch -n 2 tests/gpu/checks.py runtime collectives      # named groups, or "all"
    flux-launch -n 2 tests/gpu/checks.py nn                       # flux_shmem.nn layers and the Llama block
    flux-launch -n 2 tests/gpu/checks.py moe                      # the MoE ops (tests/gpu/moe_checks.py)
    torchrun --nproc-per-node 2 tests/gpu/checks.py nn            # the same, bootstrapped by torchrun
    FLUX_SHMEM_ON_TIMEOUT=raise flux-launch -n 1 tests/gpu/checks.py timeout_raise
    flux-launch -n 1 tests/gpu/checks.py timeout_trap                # expected to die with a report

Every check compares with a torch reference on fresh random inputs, outputs poisoned first. Prints
"CHECK <name> ok" per passed check on rank 0; any failure raises (non-zero exit).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import flux_shmem  # noqa: E402
import flux_shmem.runtime.pacing  # noqa: E402,F401

CHECKS: dict[str, list] = {}


class Skip(Exception):
    """A check that cannot run here (one PE, no MPS, ...): it prints `CHECK <name> skip: <reason>`, never ok."""


def check(group: str):
    def deco(fn):
        CHECKS.setdefault(group, []).append(fn)
        return fn
    return deco


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def capture(fn):
    """Run fn once on a side stream (loads kernels, fills host caches), then capture one call in a CUDA graph.
    Returns (graph, what the captured call returned)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)


def gathered_inputs(rt, shape, dtype, seed):
    """Every PE's input for this seed, built identically on all PEs (so each can compute the reference)."""
    xs = []
    for pe in range(rt.world_size):
        g = torch.Generator(device="cuda").manual_seed(seed * 1000 + pe)
        xs.append(torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype))
    return xs


# ------------------------------------------------------------------------------------------------------------
@check("runtime")
def runtime_layout(rt):
    assert rt.world_size == int(os.environ.get("OMPI_COMM_WORLD_SIZE", rt.world_size))
    assert 0 <= rt.local_rank < rt.local_size and 0 <= rt.node < rt.num_nodes
    assert rt.is_reachable(rt.rank)
    assert torch.cuda.current_device() == rt.device
    try:
        flux_shmem.init()
    except flux_shmem.FluxShmemError as e:
        assert "already" in str(e)
    else:
        raise AssertionError("second init() did not raise")


@check("runtime")
def symmetric_alloc_and_peer_views(rt):
    x = flux_shmem.zeros((64, 33), torch.float32)
    assert flux_shmem.is_symmetric(x) and flux_shmem.is_symmetric(x[3:])
    assert (x == 0).all()
    x.copy_(torch.arange(64 * 33, device="cuda", dtype=torch.float32).view(64, 33) + 1000 * rt.rank)
    torch.cuda.synchronize()
    flux_shmem.barrier()
    torch.cuda.synchronize()
    for pe in range(rt.world_size):
        if not rt.is_reachable(pe):
            continue
        v = flux_shmem.peer(x, pe)
        ref = torch.arange(64 * 33, device="cuda", dtype=torch.float32).view(64, 33) + 1000 * pe
        assert torch.equal(v, ref), f"peer view of PE {pe} wrong"
        sub = flux_shmem.peer(x[5:9, 2:7], pe)  # views keep their offset and strides
        assert torch.equal(sub, ref[5:9, 2:7])
    plain = torch.zeros(4, device="cuda")
    try:
        flux_shmem.peer(plain, 0)
    except flux_shmem.FluxShmemError as e:
        assert "not symmetric" in str(e)
    else:
        raise AssertionError("peer() of a private tensor did not raise")
    flux_shmem.barrier()
    torch.cuda.synchronize()
    flux_shmem.free(x)


@check("runtime")
def symmetric_mismatch_detected(rt):
    if rt.world_size == 1:
        raise Skip("needs 2 or more PEs")
    try:
        flux_shmem.empty((16 + rt.rank,), torch.float32)
    except flux_shmem.SymmetricMismatchError as e:
        assert "PE 0" in str(e) and "PE 1" in str(e)
    else:
        raise AssertionError("mismatched shapes were not detected")


@check("runtime")
def barrier_orders_writes(rt):
    # Each PE writes its peers' slots directly, barriers, then reads its own: every write must be visible.
    box = flux_shmem.zeros((rt.world_size,), torch.int64)
    for rep in range(1, 4):
        flux_shmem.barrier()
        for pe in range(rt.world_size):
            if rt.is_reachable(pe):
                flux_shmem.peer(box, pe)[rt.rank].fill_(rep * 100 + rt.rank)
        flux_shmem.barrier()
        torch.cuda.synchronize()
        expect = torch.tensor([rep * 100 + p if rt.is_reachable(p) else 0 for p in range(rt.world_size)],
                              device="cuda")
        assert torch.equal(box, expect), f"barrier round {rep}: {box.tolist()} != {expect.tolist()}"


@check("runtime")
def signal_pool(rt):
    pool = flux_shmem.SignalPool(4)
    assert pool.ptr(3) - pool.ptr(0) == 24
    pool.signals[2].fill_(5)
    pool.wait(2, 5)  # satisfied: returns
    torch.cuda.synchronize()
    pool.reset()
    torch.cuda.synchronize()
    assert (pool.signals == 0).all()


@check("runtime")
def graph_capture_barrier(rt):
    g, _ = capture(flux_shmem.barrier)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    flux_shmem.check_errors()


# ------------------------------------------------------------------------------------------------------------
@check("collectives")
def all_gather(rt):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, cols, chunk in ((256, 512, None), (100, 72, 7), (1, 8, None), (300, 1000, 64)):
            ag = flux_shmem.AllGather(rows, cols, dtype, chunk_rows=chunk)
            for seed, r in ((1, rows), (2, max(1, rows // 3))):  # a second call with fewer rows
                xs = gathered_inputs(rt, (r, cols), dtype, seed)
                ag.gather.fill_(float("nan"))
                out = ag(xs[rt.rank].clone())
                ref = torch.cat(xs)
                assert out.shape == ref.shape and torch.equal(out, ref), \
                    f"all-gather {dtype} {r}x{cols} chunk {chunk}: wrong"
            flux_shmem.barrier()
    # repeated calls without host syncs
    ag = flux_shmem.AllGather(128, 256, torch.bfloat16)
    outs, refs = [], []
    for seed in range(10, 16):
        xs = gathered_inputs(rt, (128, 256), torch.bfloat16, seed)
        outs.append(ag(xs[rt.rank]))
        refs.append(torch.cat(xs))
    torch.cuda.synchronize()
    assert all(torch.equal(o, r) for o, r in zip(outs, refs)), "back-to-back all-gathers wrong"


@check("collectives")
def all_gather_graph(rt):
    ag = flux_shmem.AllGather(64, 128, torch.bfloat16)
    x = torch.empty((64, 128), device="cuda", dtype=torch.bfloat16)
    g, out = capture(lambda: ag(x, copy=False))
    for seed in range(3):
        xs = gathered_inputs(rt, (64, 128), torch.bfloat16, 50 + seed)
        x.copy_(xs[rt.rank])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.cat(xs)), f"graph replay {seed} of all-gather wrong"


@check("collectives")
def reduce_scatter(rt):
    W = rt.world_size
    for dtype, bound in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-6)):
        for rows, cols, unit in ((256 * W, 512, None), (8 * W, 8, 1), (96 * W, 1000, 16), (W, 64, None)):
            rs = flux_shmem.ReduceScatter(rows, cols, dtype, unit_rows=unit)
            for seed, r in ((3, rows), (4, max(W, rows // 2 // W * W))):
                xs = gathered_inputs(rt, (r, cols), dtype, seed)
                bias = torch.randn(cols, device="cuda").to(dtype) if seed == 4 else None
                out = rs(xs[rt.rank].clone(), bias=bias)
                seg = r // W
                ref = torch.stack([x.double() for x in xs]).sum(0)[rt.rank * seg:(rt.rank + 1) * seg]
                if bias is not None:
                    ref = ref + bias.double()
                e = rel_err(out, ref)
                assert out.shape == (seg, cols) and e < bound, f"reduce-scatter {dtype} {r}x{cols}: rel err {e}"
            flux_shmem.barrier()
    rs = flux_shmem.ReduceScatter(64 * W, 256, torch.bfloat16)
    outs, refs = [], []
    for seed in range(20, 26):
        xs = gathered_inputs(rt, (64 * W, 256), torch.bfloat16, seed)
        outs.append(rs(xs[rt.rank]))
        refs.append(torch.stack([x.double() for x in xs]).sum(0)[rt.rank * 64:(rt.rank + 1) * 64])
    torch.cuda.synchronize()
    errs = [rel_err(o, r) for o, r in zip(outs, refs)]
    assert max(errs) < 1e-2, f"back-to-back reduce-scatters: {errs}"
    # deterministic: the same inputs give bitwise the same sum
    xs = gathered_inputs(rt, (64 * W, 256), torch.bfloat16, 99)
    a, b = rs(xs[rt.rank]), rs(xs[rt.rank])
    assert torch.equal(a, b), "reduce-scatter is not deterministic"


@check("collectives")
def op_argument_errors(rt):
    ag = flux_shmem.AllGather(16, 64, torch.bfloat16)
    bad = [
        (lambda: ag(torch.zeros(16, 64, device="cuda", dtype=torch.float16)), TypeError, "dtype"),
        (lambda: ag(torch.zeros(17, 64, device="cuda", dtype=torch.bfloat16)), ValueError, "rows"),
        (lambda: ag(torch.zeros(16, 63, device="cuda", dtype=torch.bfloat16)), ValueError, "columns"),
        (lambda: ag(torch.zeros(16, 64, dtype=torch.bfloat16)), ValueError, "cuda"),
        (lambda: ag(torch.zeros(64, 16, device="cuda", dtype=torch.bfloat16).t()), ValueError, "contiguous"),
        (lambda: flux_shmem.ReduceScatter(16, 63, torch.bfloat16), ValueError, "multiple"),
    ]
    for fn, exc, word in bad:
        try:
            fn()
        except exc as e:
            assert word in str(e), f"message {e!r} lacks {word!r}"
        else:
            raise AssertionError(f"no {exc.__name__} for a bad call ({word})")


# ------------------------------------------------------------------------------------------------------------
GEMM_SHAPES = [  # (m, n, k): tile-aligned, ragged in every dimension, M smaller than one tile per PE
    (1024, 512, 256), (1000, 264, 200), (256, 128, 64), (2 * 8, 72, 24), (4096, 1024, 512)]


def weight(k, n, layout, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "kn":
        return torch.randn((k, n), generator=g, device="cuda").to(dtype) / k ** 0.5
    return (torch.randn((n, k), generator=g, device="cuda").to(dtype) / k ** 0.5).t()  # a transposed weight


@check("gemm")
def gemm_only_matches_torch(rt):
    for dtype in (torch.bfloat16, torch.float16):
        for m, n, k in GEMM_SHAPES:
            for layout in ("kn", "nk"):
                op = flux_shmem.AllGatherGEMM(m * rt.world_size, n, k, dtype)
                a = torch.randn((m, k), device="cuda").to(dtype)
                b = weight(k, n, layout, dtype, m + n + k)
                bias = torch.randn(n, device="cuda").to(dtype)
                out = op.gemm_only(a, b, bias)
                ref = a.double() @ b.double() + bias.double()
                e = rel_err(out, ref)
                assert e < 1e-2, f"gemm_only {dtype} {layout} {m}x{n}x{k}: rel err {e}"
                rs = flux_shmem.GEMMReduceScatter(m * rt.world_size, n, k, dtype)
                e2 = rel_err(rs.gemm_only(a, b), a.double() @ b.double())
                assert e2 < 1e-2, f"gemm_rs gemm_only {dtype} {layout} {m}x{n}x{k}: rel err {e2}"


@check("gemm")
def ag_gemm_matches_torch(rt):
    W = rt.world_size
    for mode in ("fused", "decomposed"):
        for dtype in (torch.bfloat16, torch.float16):
            for ms, n, k in ((512, 512, 256), (100, 264, 200), (8, 72, 24), (1024, 1024, 512)):
                op = flux_shmem.AllGatherGEMM(ms * W, n, k, dtype, mode=mode)
                for seed, layout in ((1, "kn"), (2, "nk")):
                    a_all = gathered_inputs(rt, (ms, k), dtype, seed + 10 * ms)
                    b = weight(k, n, layout, dtype, seed)
                    bias = torch.randn(n, device="cuda").to(dtype) if seed == 2 else None
                    out, gathered = op(a_all[rt.rank], b, bias, return_gathered=True)
                    a_full = torch.cat(a_all)
                    ref = a_full.double() @ b.double() + (bias.double() if bias is not None else 0)
                    e = rel_err(out, ref)
                    assert e < 1e-2, f"AllGatherGEMM {mode} {dtype} {layout} ms={ms} n={n} k={k}: rel err {e}"
                    assert torch.equal(gathered, a_full), "gathered A differs"
                flux_shmem.barrier()
    # back to back, then the same op captured in a CUDA graph
    op = flux_shmem.AllGatherGEMM(256 * W, 256, 128, torch.bfloat16, mode="fused")
    b = weight(128, 256, "kn", torch.bfloat16, 7)
    res = []
    for seed in range(30, 34):
        a_all = gathered_inputs(rt, (256, 128), torch.bfloat16, seed)
        res.append((op(a_all[rt.rank], b), torch.cat(a_all).double() @ b.double()))
    assert max(rel_err(o, r) for o, r in res) < 1e-2, "back-to-back AllGatherGEMM calls wrong"
    ag_gemm_graph_replays(rt, op, b, range(40, 43), "AllGatherGEMM")


def ag_gemm_graph_replays(rt, op, b, seeds, what):
    """Capture op(a [256, 128], b) once, then replay it on fresh inputs copied into a."""
    a = torch.empty((256, 128), device="cuda", dtype=torch.bfloat16)
    g, out = capture(lambda: op(a, b))
    for seed in seeds:
        a_all = gathered_inputs(rt, (256, 128), torch.bfloat16, seed)
        a.copy_(a_all[rt.rank])
        g.replay()
        torch.cuda.synchronize()
        e = rel_err(out, torch.cat(a_all).double() @ b.double())
        assert e < 1e-2, f"graph replay of {what}: rel err {e}"


@check("gemm")
def ag_gemm_copy_engine(rt):
    """engine='ce': the all-gather by copy engines (one NVLink domain), fused with the GEMM on all SMs but one."""
    W = rt.world_size
    if rt.node_size != W:  # forced puts / several nodes: refused with the fix named
        try:
            flux_shmem.AllGatherGEMM(128 * W, 64, 64, engine="ce")
        except ValueError as e:
            assert "engine='sm'" in str(e), str(e)
            return
        raise AssertionError("engine='ce' accepted outside one NVLink domain")
    for ms, n, k, cr in ((512, 512, 256, None), (100, 264, 200, 40), (1024, 1024, 512, 128)):
        op = flux_shmem.AllGatherGEMM(ms * W, n, k, torch.bfloat16, mode="fused", engine="ce", chunk_rows=cr)
        plan = op.call_plan(ms * W)
        if W > 1:
            assert plan.engine == "ce" and plan.gemm_sms == (op.budget.sms - 1) // 2 * 2, repr(op)
        for seed, layout in ((5, "kn"), (6, "nk")):
            a_all = gathered_inputs(rt, (ms, k), torch.bfloat16, seed + ms)
            b = weight(k, n, layout, torch.bfloat16, seed)
            poison(op.ag.gather)
            out, gathered = op(a_all[rt.rank], b, return_gathered=True)
            a_full = torch.cat(a_all)
            e = rel_err(out, a_full.double() @ b.double())
            assert e < 1e-2, f"AllGatherGEMM ce {layout} ms={ms} n={n} k={k}: rel err {e}"
            assert torch.equal(gathered, a_full), "gathered A differs (copy engine)"
        flux_shmem.barrier()
    op = flux_shmem.AllGatherGEMM(256 * W, 256, 128, torch.bfloat16, mode="fused", engine="ce", chunk_rows=64)
    b = weight(128, 256, "kn", torch.bfloat16, 8)
    ag_gemm_graph_replays(rt, op, b, range(60, 64), "AllGatherGEMM(engine='ce')")


@check("gemm")
def gemm_rs_matches_torch(rt):
    W = rt.world_size
    for mode in ("fused", "decomposed"):
        for dtype in (torch.bfloat16, torch.float16):
            for m, n, k in ((512 * W, 512, 256), (100 * W, 264, 200), (8 * W, 72, 24), (1024 * W, 1024, 512)):
                op = flux_shmem.GEMMReduceScatter(m, n, k, dtype, mode=mode)
                for seed, layout in ((3, "kn"), (4, "nk")):
                    a_all = gathered_inputs(rt, (m, k), dtype, seed + m)
                    bs = [weight(k, n, layout, dtype, 100 * seed + pe) for pe in range(W)]
                    bias = torch.randn(n, device="cuda").to(dtype) if seed == 4 else None
                    out = op(a_all[rt.rank], bs[rt.rank], bias)
                    full = sum(a.double() @ b.double() for a, b in zip(a_all, bs))
                    seg = m // W
                    ref = full[rt.rank * seg:(rt.rank + 1) * seg] + (bias.double() if bias is not None else 0)
                    e = rel_err(out, ref)
                    assert out.shape == (seg, n) and e < 2e-2, \
                        f"GEMMReduceScatter {mode} {dtype} {layout} {m}x{n}x{k}: rel err {e}"
                flux_shmem.barrier()
    op = flux_shmem.GEMMReduceScatter(256 * W, 256, 128, torch.bfloat16, mode="fused")
    a = torch.empty((256 * W, 128), device="cuda", dtype=torch.bfloat16)
    b = weight(128, 256, "nk", torch.bfloat16, 5 + rt.rank)
    bs = [weight(128, 256, "nk", torch.bfloat16, 5 + pe) for pe in range(W)]
    g, out = capture(lambda: op(a, b))
    for seed in range(50, 53):
        a_all = gathered_inputs(rt, (256 * W, 128), torch.bfloat16, seed)
        a.copy_(a_all[rt.rank])
        g.replay()
        torch.cuda.synchronize()
        full = sum(x.double() @ y.double() for x, y in zip(a_all, bs))
        e = rel_err(out, full[rt.rank * 256:(rt.rank + 1) * 256])
        assert e < 2e-2, f"graph replay of GEMMReduceScatter: rel err {e}"


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


@check("gemm")
def gemm_rs_reduce_units(rt):
    """GEMMReduceScatter with reduce units narrower than a row (column groups of 1 and 3 N-tiles, the last one
    ragged: N = 1000 is no multiple of a tile width), GEMM swizzles 1, 2 and 4 and tail kernels, forced
    past the planner: every unit must wait for exactly the tiles under it. The op's buffers are poisoned with NaN
    before each call (a unit summed before its tiles were written shows), and M changes between calls on one op
    (tile marks are set to the epoch: no reset, nothing to extend for tiles a call does not cover)."""
    W = rt.world_size
    n, k = 1000, 256
    bf, fp = torch.bfloat16, torch.float16
    cases = [  # rows per PE, swizzle, group_tiles, tail pieces, dtype, bias
        (512, 4, 1, 0, bf, False), (200, 2, 3, 2, bf, True), (384, 1, 1, 5, fp, True), (512, 2, 3, 3, bf, False),
        (72, 4, 1, 0, bf, True), (512, 4, 1, 0, fp, False),
    ]
    ops = {dt: flux_shmem.GEMMReduceScatter(512 * W, n, k, dt, mode="fused") for dt in (bf, fp)}
    for i, (ms, sw, gt, tail, dtype, with_bias) in enumerate(cases):
        op = ops[dtype]
        layout = "nk" if i % 2 else "kn"
        op._plans.clear()  # plan again, then force this case's shape onto the plan (same on every PE)
        plan = op.call_plan(ms * W, layout)
        if W > 1:
            op._plans[(ms * W, layout)] = dataclasses.replace(plan, swizzle=sw, group_tiles=gt, tail=tail,
                                                             tail_blocks=8 if tail else 0)
        a_all = gathered_inputs(rt, (ms * W, k), dtype, 900 + i)
        bs = [weight(k, n, "nk" if i % 2 else "kn", dtype, 950 + 10 * i + pe) for pe in range(W)]
        bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
        torch.cuda.synchronize()
        flux_shmem.barrier()  # no peer still reads my buffers
        for t in (op.engine.partial, op.engine.stage, op.engine.recv):
            poison(t)
        torch.cuda.synchronize()
        flux_shmem.barrier()
        plan = op.call_plan(ms * W, layout)
        if W > 1:  # (one PE runs the plain GEMM: there is nothing to reduce, and no split to force)
            assert (plan.swizzle, plan.group_tiles, plan.tail) == (sw, gt, tail), plan.describe()
        out = op(a_all[rt.rank], bs[rt.rank], bias)
        full = sum(a.double() @ b.double() for a, b in zip(a_all, bs))
        ref = full[rt.rank * ms:(rt.rank + 1) * ms] + (bias.double() if bias is not None else 0)
        e = rel_err(out, ref)
        assert out.shape == (ms, n) and e < 2e-2, f"GEMMReduceScatter {ms * W}x{n}x{k} {plan.describe()}: rel err {e}"
    torch.cuda.synchronize()
    flux_shmem.barrier()


@check("gemm")
def gemm_argument_errors(rt):
    W = rt.world_size
    bad = [
        (lambda: flux_shmem.AllGatherGEMM(128 * W, 64, 60), ValueError, "multiple of 8"),
        (lambda: flux_shmem.GEMMReduceScatter(128 * W, 60, 64), ValueError, "multiple of 8"),
        (lambda: flux_shmem.AllGatherGEMM(128 * W + (1 if W > 1 else 0), 64, 64, mode="x"), ValueError, ""),
    ]
    op = flux_shmem.AllGatherGEMM(128 * W, 64, 64)
    a = torch.randn((128, 64), device="cuda").to(torch.bfloat16)
    b = torch.randn((64, 64), device="cuda").to(torch.bfloat16)
    bad += [
        (lambda: op(a, b.to(torch.float16)), TypeError, "float16"),
        (lambda: op(a[:, :32].contiguous(), b), ValueError, "columns"),
        (lambda: op(torch.cat([a, a]), b), ValueError, "up to"),
        (lambda: op(a, b[:, :32]), ValueError, "shape"),
    ]
    for fn, exc, word in bad:
        try:
            fn()
        except exc as e:
            assert word in str(e), f"message {e!r} lacks {word!r}"
        else:
            raise AssertionError(f"no {exc.__name__} for a bad call ({word})")


@check("gemm")
def ag_gemm_engines_agree(rt):
    """engine 'sm', 'ce' and 'auto' give the same product (and 'auto' says what it chose)."""
    W = rt.world_size
    engines = ["sm", "auto"] + (["ce"] if rt.node_size == W and flux_shmem.runtime.pacing.emulation() is None else [])
    a_all = gathered_inputs(rt, (384, 256), torch.bfloat16, 77)
    b = weight(256, 512, "nk", torch.bfloat16, 78)
    ref = torch.cat(a_all).double() @ b.double()
    for eng in engines:
        op = flux_shmem.AllGatherGEMM(384 * W, 512, 256, torch.bfloat16, mode="fused", engine=eng)
        e = rel_err(op(a_all[rt.rank], b), ref)
        assert e < 1e-2, f"AllGatherGEMM engine={eng}: rel err {e} ({op!r})"
        flux_shmem.barrier()


@check("gemm")
def capture_right_after_prepare(rt):
    """Issue 37: a CUDA graph captured right after prepare(), with no call of the op before it (prepare made the
    plans, the engines' tables, the workspaces, cuBLAS's handle), replays correctly on fresh inputs; both ops,
    fused and decomposed (with the plain-GEMM backend FLUX_SHMEM_PLAIN_GEMM picks, cuBLAS by default), and with
    one PE the plain path."""
    W = rt.world_size
    n, k = 768, 512
    for mode in ("fused", "decomposed"):
        m = 640 * W
        ag = flux_shmem.AllGatherGEMM(m, n, k, torch.bfloat16, mode=mode)
        rs = flux_shmem.GEMMReduceScatter(m, n, k, torch.bfloat16, mode=mode)
        b = weight(k, n, "nk", torch.bfloat16, 41)
        bs = [weight(k, n, "nk", torch.bfloat16, 50 + pe) for pe in range(W)]
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        ag.prepare([m])
        rs.prepare([m])
        a = torch.empty((m // W, k), device="cuda", dtype=torch.bfloat16)
        x = torch.empty((m, k), device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        flux_shmem.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # (no warm-up call: what prepare() made is all there is)
            out = ag(a, b, bias)
            out2 = rs(x, bs[rt.rank], bias)
        for seed in (1, 2):
            a_all = gathered_inputs(rt, (m // W, k), torch.bfloat16, 700 + seed)
            x_all = gathered_inputs(rt, (m, k), torch.bfloat16, 800 + seed)
            a.copy_(a_all[rt.rank])
            x.copy_(x_all[rt.rank])
            poison(out)
            poison(out2)
            g.replay()
            torch.cuda.synchronize()
            e = rel_err(out, torch.cat(a_all).double() @ b.double() + bias.double())
            assert e < 1e-2, f"AllGatherGEMM {mode} ({ag.path(m)}) captured after prepare: rel err {e}"
            full = sum(p.double() @ q.double() for p, q in zip(x_all, bs)) + bias.double()
            seg = m // W
            e = rel_err(out2, full[rt.rank * seg:(rt.rank + 1) * seg])
            assert e < 2e-2, f"GEMMReduceScatter {mode} ({rs.path(m)}) captured after prepare: rel err {e}"
        flux_shmem.barrier()
        if rt.rank == 0:
            print(f"CHECK info: captured after prepare: {ag.call_plan(m).describe()[:160]}", flush=True)


def soak(rt, op, make_inputs, reference, calls: int, every: int, what: str):
    """`calls` back-to-back calls over changing inputs (4 rotating sets), no host sync between them; every
    `every` calls one output is kept and compared with its reference afterwards (outputs are fresh tensors, so a
    call that wrote nothing would show as garbage)."""
    sets = [make_inputs(s) for s in range(4)]
    refs = [reference(*x) for x in sets]
    kept = []
    for i in range(calls):
        out = op(*sets[i % 4][0])
        if i % every == every - 1:
            kept.append((i, out))
    torch.cuda.synchronize()
    flux_shmem.check_errors()
    for i, out in kept:
        e = rel_err(out, refs[i % 4])
        assert e < 2e-2, f"soak {what}: call {i}: rel err {e}"


@check("soak")
def soak_fused_ops(rt):
    """2,000 back-to-back fused calls per op (and per all-gather engine), inputs changing every call, checked
    every 100 calls: with PEs running at once (MPS), races between a call and the next one's writes show here."""
    W = rt.world_size
    calls = int(os.environ.get("FLUX_SHMEM_SOAK_CALLS", "2000"))
    ms, n, k = 256, 512, 512

    def ag_inputs(seed):
        a_all = gathered_inputs(rt, (ms, k), torch.bfloat16, 300 + seed)
        return (a_all[rt.rank], weight(k, n, "nk", torch.bfloat16, 400 + seed)), torch.cat(a_all)

    engines = ["sm"] + (["ce"] if rt.node_size == W and flux_shmem.runtime.pacing.emulation() is None else [])
    only = os.environ.get("FLUX_SHMEM_SOAK_ENGINES")  # e.g. "ce": soak only these AllGatherGEMM engines
    if only:
        engines = [e for e in engines if e in only.split(",")]
    for eng in engines:
        if rt.rank == 0:
            print(f"CHECK note: soak of AllGatherGEMM engine={eng}", flush=True)
        op = flux_shmem.AllGatherGEMM(ms * W, n, k, torch.bfloat16, mode="fused", engine=eng)
        soak(rt, lambda a, b: op(a, b), ag_inputs, lambda x, a_full: a_full.double() @ x[1].double(), calls, 100,
             f"AllGatherGEMM engine={eng}")
        flux_shmem.barrier()

    def rs_inputs(seed):
        a_all = gathered_inputs(rt, (ms * W, k), torch.bfloat16, 500 + seed)
        bs = [weight(k, n, "kn", torch.bfloat16, 600 + 10 * seed + pe) for pe in range(W)]
        return (a_all[rt.rank], bs[rt.rank]), (a_all, bs)

    def rs_ref(x, full):
        a_all, bs = full
        tot = sum(a.double() @ b.double() for a, b in zip(a_all, bs))
        return tot[rt.rank * ms:(rt.rank + 1) * ms]

    op = flux_shmem.GEMMReduceScatter(ms * W, n, k, torch.bfloat16, mode="fused")
    soak(rt, lambda a, b: op(a, b), rs_inputs, rs_ref, calls, 100, "GEMMReduceScatter")
    flux_shmem.barrier()
    rs = flux_shmem.ReduceScatter(ms * W, n, torch.bfloat16)
    soak(rt, lambda x: rs(x), lambda s: ((gathered_inputs(rt, (ms * W, n), torch.bfloat16, 700 + s)[rt.rank],),
                                         gathered_inputs(rt, (ms * W, n), torch.bfloat16, 700 + s)),
         lambda x, xs: torch.stack([v.double() for v in xs]).sum(0)[rt.rank * ms:(rt.rank + 1) * ms], calls, 100,
         "ReduceScatter")


@check("hazards")
def input_buffer_waits_for_slow_peers(rt):
    """Hazard: overwriting the symmetric input while a peer still sums the previous call's. PE 1 reads slowly (its
    link paced to 2 GB/s); PE 0 writes its next input right after each call. Through input_buffer() (which waits
    for every node peer's 'done reading' signal) every result is right; writing the buffer directly, without that
    wait, PE 1's results go wrong (shown when the PEs really run at once)."""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    rows, cols = 64 * W, 2048
    slow = rt.rank == 1
    if slow:
        os.environ["FLUX_SHMEM_LINK_GBPS"] = "2"
    rs = flux_shmem.ReduceScatter(rows, cols, torch.bfloat16, unit_rows=8, comm_blocks=2)
    os.environ.pop("FLUX_SHMEM_LINK_GBPS", None)
    seeds = range(900, 906)
    inputs = {s: gathered_inputs(rt, (rows, cols), torch.bfloat16, s) for s in seeds}

    def run(safe: bool) -> list[float]:
        outs = []
        for s in seeds:
            buf = rs.input_buffer(rows) if safe else rs.engine.partial[:rows]
            buf.copy_(inputs[s][rt.rank])
            outs.append((s, rs(buf)))
        torch.cuda.synchronize()
        errs = [rel_err(o, torch.stack([v.double() for v in inputs[s]]).sum(0)[rt.rank * 64:(rt.rank + 1) * 64])
                for s, o in outs]
        flux_shmem.barrier()
        torch.cuda.synchronize()
        return errs
    unsafe = run(False)
    safe = run(True)
    assert max(safe) < 1e-2, f"PE {rt.rank}: input_buffer results wrong: {safe}"
    worst = rt.host.allgather(max(unsafe))
    if rt.rank == 0:
        print(f"CHECK note: without the wait, the worst result error over PEs was {max(worst):.3g} "
              f"({'the race showed' if max(worst) > 1e-2 else 'the race did not show this time'})", flush=True)


@check("hazards")
def large_node_reduce(rt):
    """Hazard: fixed-size source arrays (8 node peers, 64 nodes) in the reduce kernel. The kernel now keeps the
    node peers' pointers in shared memory sized at launch: a node of any size (run with 12 or 16 PEs)."""
    W = rt.world_size
    rows, cols = 16 * W, 256
    rs = flux_shmem.ReduceScatter(rows, cols, torch.bfloat16)
    xs = gathered_inputs(rt, (rows, cols), torch.bfloat16, 1234)
    out = rs(xs[rt.rank])
    ref = torch.stack([x.double() for x in xs]).sum(0)[rt.rank * 16:(rt.rank + 1) * 16]
    assert rel_err(out, ref) < 1e-2, f"reduce-scatter over a node of {rt.node_size}: rel err {rel_err(out, ref)}"
    op = flux_shmem.GEMMReduceScatter(128 * W, 256, 128, torch.bfloat16, mode="fused")
    a_all = gathered_inputs(rt, (128 * W, 128), torch.bfloat16, 55)
    bs = [weight(128, 256, "kn", torch.bfloat16, 56 + pe) for pe in range(W)]
    out = op(a_all[rt.rank], bs[rt.rank])
    full = sum(a.double() @ b.double() for a, b in zip(a_all, bs))
    e = rel_err(out, full[rt.rank * 128:(rt.rank + 1) * 128])
    assert e < 2e-2, f"GEMMReduceScatter over a node of {rt.node_size}: rel err {e}"


@check("hazards")
def sm_budget_and_occupancy(rt):
    """The persistent grids fit this context's SM budget (MPS share): say what the runtime and the driver see."""
    from flux_shmem.runtime.sm_budget import _affinity_sms
    op = flux_shmem.AllGatherGEMM(1024 * rt.world_size, 1024, 1024, torch.bfloat16, mode="fused")
    plan = op.call_plan(1024 * rt.world_size)
    g = op.kernel("kn", op.gemm_choice(1024 * rt.world_size, "kn", op.sms).config)
    a = torch.randn((1024 * rt.world_size, 1024), device="cuda").to(torch.bfloat16)
    op.gemm_only(a, weight(1024, 1024, "kn", torch.bfloat16, 1))
    torch.cuda.synchronize()
    cap = sorted(set(g._max_ctas.values()))  # per stream this process launched it on
    info = (f"PE {rt.rank}: budget {op.budget} affinity={_affinity_sms()} MPS%="
            f"{os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')} max resident GEMM CTAs={cap} "
            f"plan={plan.describe()}")
    print("CHECK info: " + info, flush=True)
    assert plan.gemm_sms + plan.comm_blocks <= op.budget.sms, info
    assert op.sms <= op.budget.sms


@check("hazards")
def start_event_releases_at_block_start(rt):
    """When does CUDA's launch-completion event (kernels.module.StartEvent, which the fused ops wait on before
    their second kernel) fire: once the kernel's blocks run, or only at its end? A one-thread kernel on stream A
    waits (2 s timeout, private error record) for a flag that stream B writes after waiting on the event of A's
    launch. Block start: A returns at once; end: A times out first. Informational: "at block start" cannot be told
    apart from an event that holds nothing back, which is why AllGatherGEMM gates its GEMM on the gather kernel's
    own start flag instead (AllGather.wait_started)."""
    import ctypes
    import time
    from flux_shmem.kernels import abi
    from flux_shmem.kernels.module import StartEvent, load, write_value_async
    if rt.world_size > 1 and rt.rank != 0:
        return
    words = ctypes.sizeof(abi.ErrorRecord) // 8
    record = torch.zeros(words, dtype=torch.int64, pin_memory=True)
    slot = torch.zeros(2, dtype=torch.int64, device="cuda")
    slot[1] = record.data_ptr()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    ctx = abi.Ctx(err=slot.data_ptr(), timeout_ns=int(2e9), my_pe=rt.rank, n_pes=rt.world_size, trap_on_timeout=0)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    ev = StartEvent()
    t0 = time.perf_counter()
    load("collectives").kernel("fs_wait_signal").launch(abi.WaitArgs(ctx=ctx, sig=flag.data_ptr(), expected=1, site=9), 1, 32,
                                                        stream=a, started=ev)
    ev.wait(b)
    write_value_async(flag.data_ptr(), 1, b)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    timed_out = abi.ErrorRecord.from_address(record.data_ptr()).flag == 1
    when = "only at the kernel's end (the waiting kernel timed out first)" if timed_out else "at block start"
    print(f"CHECK note: the launch-completion event fired {when}: {dt * 1e3:.1f} ms, MPS "
          f"{os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE') or 'off'}", flush=True)


@check("emulation")
def link_emulation_paces(rt):
    """FLUX_SHMEM_LINK_GBPS paces the all-gather: moving B bytes to my peers takes at least B / rate."""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    os.environ["FLUX_SHMEM_LINK_GBPS"] = "20"
    try:
        ag = flux_shmem.AllGather(2048, 4096, torch.bfloat16, comm_blocks=4)
    finally:
        os.environ.pop("FLUX_SHMEM_LINK_GBPS", None)
    xs = gathered_inputs(rt, (2048, 4096), torch.bfloat16, 31)
    ag(xs[rt.rank])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flux_shmem.barrier()
    start.record()
    out = ag(xs[rt.rank])
    end.record()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat(xs)), "paced all-gather wrong"
    sent = (W - 1) * 2048 * 4096 * 2
    ms = start.elapsed_time(end)
    floor = sent / 20e9 * 1e3
    if rt.rank == 0:
        print(f"CHECK info: paced all-gather of {sent / 1e6:.0f} MB to peers in {ms:.2f} ms (floor {floor:.2f} ms "
              "at 20 GB/s)", flush=True)
    assert ms >= 0.95 * floor, f"pacing too fast: {ms:.3f} ms < {floor:.3f} ms"


# ------------------------------------------------------------------------------------------------------------
# flux_shmem.nn: layers and the Llama block (benchmarks/llama_block.py) against unsharded fp64 references.
NN_TOL = 1e-2
DEVICE = "cuda"  # tests/test_gpu_checks_cpu.py runs these checks on the CPU with stand-ins for the fused ops
NN_DTYPES = (torch.bfloat16, torch.float16)
# (sequence per PE, batch, in_features, hidden features per PE): tile-sized, and ragged (12 rows per PE, 264, 200)
NN_LAYER_SHAPES = [(128, 2, 512, 512), (12, 1, 264, 200)]


def full_randn(shape, seed, scale=1.0, dtype=torch.bfloat16):
    """The same tensor on every PE (a full, unsharded tensor), rounded to `dtype`."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEVICE) * scale).to(dtype)


def seq_part(t, rt):
    rows = t.shape[0] // rt.world_size
    return t[rt.rank * rows:(rt.rank + 1) * rows]


def poison_pool(backend):
    """NaN into the fused ops' gather and partial-sum buffers. After a barrier: peers may still read this PE's
    buffers until they reach it."""
    torch.cuda.synchronize()
    flux_shmem.barrier()
    for op in backend.ops().values():
        if op is None:
            continue
        if hasattr(op, "ag") and hasattr(op.ag, "gather"):
            poison(op.ag.gather)
        if hasattr(op, "engine") and hasattr(op.engine, "partial"):
            poison(op.engine.partial)


def layer_pair_step(rt, backend, dtype, s, b, d_in, d_hid, bias, seed):
    """Column -> gelu -> row, forward and backward on this PE's shard; rel. errors against fp64 unsharded."""
    import torch.nn.functional as F
    import flux_shmem.nn as fnn
    w1 = full_randn((d_hid, d_in), seed, d_in ** -0.5, dtype)
    w2 = full_randn((d_in, d_hid), seed + 1, d_hid ** -0.5, dtype)
    b1, b2 = full_randn((d_hid,), seed + 2, 0.1, dtype), full_randn((d_in,), seed + 3, 0.1, dtype)
    x, gy = full_randn((s, b, d_in), seed + 4, 1.0, dtype), full_randn((s, b, d_in), seed + 5, 1.0, dtype)
    ref = [t.double().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    y = F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2] if bias else None)), ref[3], ref[4] if bias else None)
    y.backward(gy.double())
    col = fnn.ColumnParallelLinear(d_in, d_hid, bias=bias, backend=backend, dtype=dtype).load_full(w1, b1)
    row = fnn.RowParallelLinear(d_hid, d_in, bias=bias, backend=backend, dtype=dtype).load_full(w2, b2)
    if DEVICE == "cuda":  # the layers' default device: this PE's GPU
        assert col.weight.device == torch.device("cuda", rt.device), col.weight.device
    poison_pool(backend)
    xs = seq_part(x, rt).clone().requires_grad_(True)
    ys = row(F.gelu(col(xs)))
    ys.backward(seq_part(gy, rt))
    lo, hi = rt.rank * (d_hid // rt.world_size), (rt.rank + 1) * (d_hid // rt.world_size)
    errs = {"out": rel_err(ys, seq_part(y, rt)), "grad x": rel_err(xs.grad, seq_part(ref[0].grad, rt)),
            "grad col.w": rel_err(col.weight.grad, ref[1].grad[lo:hi]),
            "grad row.w": rel_err(row.weight.grad, ref[3].grad[:, lo:hi])}
    if bias:
        errs["grad col.b"] = rel_err(col.bias.grad, ref[2].grad[lo:hi])
        errs["grad row.b"] = rel_err(row.bias.grad, ref[4].grad)
    return errs


def assert_errs(errs, what, tol=NN_TOL):
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{what}: rel err above {tol}: {bad} (all: {errs})"


@check("nn")
def nn_layers(rt):
    """Both layers, forward and every gradient, fused and decomposed, bf16 and fp16, with and without bias."""
    import flux_shmem.nn as fnn
    W = rt.world_size
    for mode in ("fused", "decomposed", "auto"):
        be = fnn.FusedBackend(mode=mode)
        for dtype in NN_DTYPES:
            for bias in (False, True):
                for s_pe, b, d_in, d_hid_pe in NN_LAYER_SHAPES:
                    s, d_hid = s_pe * W, d_hid_pe * W
                    errs = layer_pair_step(rt, be, dtype, s, b, d_in, d_hid, bias, seed=s + d_in + bias)
                    assert_errs(errs, f"layers {mode} {dtype} bias={bias} s={s} b={b} {d_in}->{d_hid}")
        kinds = sorted({k[0] for k in be.ops()})
        assert kinds == ["ag_gemm", "gemm_rs"], kinds
        flux_shmem.barrier()


@check("nn")
def nn_ops_grow_with_m(rt):
    """The shared ops are built for the first M and rebuilt (collectively) when a larger batch arrives; a smaller
    batch after that reuses the large ones."""
    import flux_shmem.nn as fnn
    W = rt.world_size
    be = fnn.FusedBackend(mode="fused")
    sizes = {}
    for s in (16 * W, 200 * W, 16 * W):
        assert_errs(layer_pair_step(rt, be, torch.bfloat16, s, 1, 256, 512, True, seed=s), f"s={s}")
        sizes.setdefault(s, []).append(dict(be.ops()))
    small, big, again = sizes[16 * W][0], sizes[200 * W][0], sizes[16 * W][1]
    # two ops: the column forward and the row backward share AG(n=512/W, k=256), the row forward and the column
    # backward RS(n=256, k=512/W)
    assert set(small) == set(big) and len(small) == 2, list(big)
    for key in small:
        assert small[key].max_m < 200 * W <= big[key].max_m and big[key] is not small[key], key
        assert again[key] is big[key], f"{key}: rebuilt for a smaller M"


@check("nn")
def nn_fallback(rt):
    """A shape the fused ops cannot run (K = 260, not a multiple of 8): plain torch with one PE (reported once);
    with several PEs and no usable torch.distributed, an error on every PE that names the fix."""
    import warnings
    import flux_shmem.nn as fnn
    W = rt.world_size
    be = fnn.FusedBackend(mode="fused")
    if W == 1:
        said = []
        for seed in (3, 4):  # the second step, same shapes: nothing new to report
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert_errs(layer_pair_step(rt, be, torch.bfloat16, 64, 1, 260, 512, True, seed=seed), "fallback")
            said.append([str(w.message) for w in caught if "instead of the fused ops" in str(w.message)])
        assert said[1] == [] and len(said[0]) == 2, said  # K = 260 (column forward), N = 260 (row forward)
        assert all("= 260" in m for m in said[0]), said
        return
    import torch.distributed as dist
    if dist.is_initialized() and not rt.shares_gpu:
        assert_errs(layer_pair_step(rt, be, torch.bfloat16, 64 * W, 1, 260, 512, True, seed=3), "fallback (NCCL)")
        return
    try:
        layer_pair_step(rt, be, torch.bfloat16, 64 * W, 1, 260, 512, True, seed=3)
    except RuntimeError as e:
        assert "fused ops take" in str(e) or "init_process_group" in str(e), str(e)
    else:
        raise AssertionError("an unsupported shape ran without a torch.distributed fallback")


def small_block(rt, bias=True):
    from benchmarks.llama_block import BlockConfig
    return BlockConfig(hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=512, bias=bias)


def block_case(rt, cfg, seed, s_per_pe=64, batch=2, dtype=torch.bfloat16):
    """Full input and output gradient (the same on every PE), and the fp64 reference step."""
    from benchmarks.llama_block import reference_step
    s = s_per_pe * rt.world_size
    x = full_randn((s, batch, cfg.hidden), seed, 1.0, dtype)
    gy = full_randn((s, batch, cfg.hidden), seed + 1, 1.0, dtype)
    ref = reference_step(cfg, x, gy, seed + 2, device=DEVICE, dtype=torch.float64, round_to=dtype)
    return x, gy, ref


def tp_block(rt, cfg, backend, ref, dtype=torch.bfloat16):
    from benchmarks.llama_block import TPBlock, shard_full
    blk = TPBlock(cfg, backend=backend, dtype=dtype)
    blk.load_state_dict({k: v.to(dtype) for k, v in shard_full(cfg, ref[3], rt.rank, rt.world_size).items()})
    return blk


@check("nn")
def nn_block(rt):
    """The Llama block (QKV, o_proj, gate/up, down; stand-in and causal attention): output, input gradient and
    every weight and bias gradient against the unsharded fp64 block."""
    import dataclasses
    import flux_shmem.nn as fnn
    from benchmarks.llama_block import compare_step, seq_shard
    for mode in ("fused", "auto"):
        be = fnn.FusedBackend(mode=mode)
        for attention, bias, seed in (("elementwise", True, 10), ("sdpa", False, 20)):
            cfg = dataclasses.replace(small_block(rt, bias), attention=attention)
            x, gy, ref = block_case(rt, cfg, seed)
            blk = tp_block(rt, cfg, be, ref)
            poison_pool(be)
            errs = compare_step(blk, seq_shard(x, rt.rank, rt.world_size), seq_shard(gy, rt.rank, rt.world_size),
                                ref)
            assert len(errs) == 2 + (8 if bias else 4), errs
            assert_errs(errs, f"block {mode} {attention} bias={bias}")
        flux_shmem.barrier()


@check("nn")
def nn_block_compiled(rt):
    """torch.compile(block, fullgraph=True) (inductor): no graph break, and forward and backward match eager and
    the fp64 reference."""
    import flux_shmem.nn as fnn
    from benchmarks.llama_block import compare_step, seq_shard
    be = fnn.FusedBackend(mode="fused")
    cfg = small_block(rt)
    x, gy, ref = block_case(rt, cfg, 30)
    blk = tp_block(rt, cfg, be, ref)
    xs, gys = seq_shard(x, rt.rank, rt.world_size), seq_shard(gy, rt.rank, rt.world_size)
    eager = compare_step(blk, xs, gys, ref)
    eager_grads = {n: p.grad.clone() for n, p in blk.named_parameters()}
    compiled = torch.compile(blk, fullgraph=True)
    for rep in range(2):  # the second call runs the compiled graphs without tracing
        # The first call compiles on each PE before its first fused op waits on the device for its peers: PEs
        # that finish compiling far apart must not time out (kernels read rt.timeout_s at each launch).
        saved, rt.timeout_s = rt.timeout_s, max(rt.timeout_s, 600.0) if rep == 0 else rt.timeout_s
        try:
            errs = compare_step(blk, xs, gys, ref, forward=compiled)
            torch.cuda.synchronize()
        finally:
            rt.timeout_s = saved
        assert_errs(errs, f"compiled block (call {rep})")
        for n, p in blk.named_parameters():  # inductor rounds fused elementwise ops once: not bitwise equal
            e = rel_err(p.grad, eager_grads[n])
            assert e <= NN_TOL, f"compiled grad {n} differs from eager: rel err {e}"
    assert max(errs.values()) <= 2 * max(eager.values()) + 1e-3, (errs, eager)


@check("nn")
def nn_graph_train_step(rt):
    """A training step (forward, backward, SGD update) captured in a CUDA graph and replayed on fresh inputs
    matches the same step run eagerly on a copy of the block."""
    import flux_shmem.nn as fnn
    from benchmarks.llama_block import seq_shard
    be = fnn.FusedBackend(mode="fused")
    cfg = small_block(rt)
    x, gy, ref = block_case(rt, cfg, 40)
    graphed, eager = tp_block(rt, cfg, be, ref), tp_block(rt, cfg, be, ref)
    start = {k: v.clone() for k, v in graphed.state_dict().items()}
    static_x = seq_shard(x, rt.rank, rt.world_size).clone().requires_grad_(True)
    static_gy = seq_shard(gy, rt.rank, rt.world_size).clone()
    lr = 0.5

    def step(blk, xin, gin):
        y = blk(xin)
        y.backward(gin)
        with torch.no_grad():
            for p in blk.parameters():
                p.add_(p.grad, alpha=-lr)
        return y

    side = torch.cuda.Stream()  # warm-up (builds the ops, loads kernels) on a side stream, as torch documents
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(graphed, static_x, static_gy)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphed.load_state_dict(start)  # in place: the graph will read and update these very tensors
    for p in list(graphed.parameters()) + [static_x]:
        p.grad = None  # allocated inside the graph: static gradient tensors
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = step(graphed, static_x, static_gy)
    for seed in (41, 42, 43):
        xn = full_randn(x.shape, seed)
        gn = full_randn(gy.shape, seed + 100)
        with torch.no_grad():
            static_x.copy_(seq_shard(xn, rt.rank, rt.world_size))
            static_gy.copy_(seq_shard(gn, rt.rank, rt.world_size))
        g.replay()
        for p in eager.parameters():
            p.grad = None
        xe = seq_shard(xn, rt.rank, rt.world_size).clone().requires_grad_(True)
        ye = step(eager, xe, seq_shard(gn, rt.rank, rt.world_size))
        torch.cuda.synchronize()
        errs = {"out": rel_err(static_y, ye), "grad x": rel_err(static_x.grad, xe.grad)}
        for (n, p), q in zip(graphed.named_parameters(), eager.parameters()):
            errs[f"grad {n}"] = rel_err(p.grad, q.grad)
            errs[f"updated {n}"] = rel_err(p, q)
        assert_errs(errs, f"graph replay of the training step (seed {seed})", tol=1e-3)
    flux_shmem.check_errors()


@check("emulation")
def comm_block_rates(rt):
    """How fast one comm thread block moves data here (no pacing): the simulator's block rate comes from this.
    Prints GB/s per block for the all-gather (stores into the peer's buffer) and the reduce-scatter (loads of every
    node PE's addend, one store) with 1, 2 and 4 blocks, and checks both results. (A bulk-copy ring through shared
    memory, cp.async.bulk, measured the same rates, 2026-12-04: the per-SM copy rate is the limit, not bytes in
    flight.)"""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    rows, cols = 4096, 8192
    xs = gathered_inputs(rt, (rows, cols), torch.bfloat16, 41)
    for blocks in (1, 2, 4):
        ag = flux_shmem.AllGather(rows, cols, torch.bfloat16, comm_blocks=blocks, chunk_rows=64)
        rs = flux_shmem.ReduceScatter(rows * W, cols, torch.bfloat16, comm_blocks=blocks)
        buf = rs.input_buffer(rows * W)
        buf.copy_(torch.cat(xs))
        res = []
        for name, fn, nbytes in (("all-gather", lambda: ag(xs[rt.rank], copy=False), (W - 1) * rows * cols * 2),
                                 ("reduce-scatter", lambda: rs(buf), (W + 1) * rows * cols * 2)):
            out = fn().clone()
            torch.cuda.synchronize()
            flux_shmem.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 5
            res.append(f"{name} {nbytes / ms / 1e6 / blocks:.0f} GB/s per block ({ms:.3f} ms)")
            # every PE's input is cat(xs): the gather is cat(xs), PE r's reduced rows are W * xs[r]
            if name == "all-gather":
                assert torch.equal(out, torch.cat(xs)), f"all-gather, {blocks} block(s)"
            else:
                err = rel_err(out, W * xs[rt.rank].float())
                assert err < 1e-2, f"reduce-scatter, {blocks} block(s): rel. error {err}"
        if rt.rank == 0:
            print(f"CHECK info: {blocks} block(s): " + "; ".join(res), flush=True)
        flux_shmem.barrier()
    beside_gemm_rates(rt, rows, cols, xs)


def beside_gemm_rates(rt, rows, cols, xs):
    """The all-gather's GB/s per block while a GEMM runs on the other SMs of the budget, as in a fused call (a
    gather block moved ~25 GB/s there against ~35 alone, 2026-12-04, read off the fused calls' stage times)."""
    W = rt.world_size
    m, n, k = 16384, 3584, 8192  # a GEMM longer than the gather (inputs ready: the side stream waits for nothing)
    g = torch.Generator(device="cuda").manual_seed(5 + rt.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g).t()
    op = flux_shmem.AllGatherGEMM(m * W, n, k, torch.bfloat16, mode="decomposed")
    from flux_shmem.plan import search
    from flux_shmem.runtime import partition
    side = partition.side_stream(rt.device)  # in this PE's green context, like a fused call's comm stream
    res = []
    for blocks in (2, 4):
        ag = flux_shmem.AllGather(rows, cols, torch.bfloat16, comm_blocks=blocks, chunk_rows=64)
        gemm_sms = search.gemm_sms_for(op.sms, op.cluster_m, blocks)  # as a fused call splits its budget
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            flux_shmem.barrier()
            op.gemm_only(a, b, sm_count=gemm_sms)  # first, so that the gather's blocks take the SMs left over
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start.record()
                ag(xs[rt.rank], copy=False)
                end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
        res.append(f"{blocks} blocks {(W - 1) * rows * cols * 2 / ms / 1e6 / blocks:.0f} GB/s per block ({ms:.3f} ms)")
    if rt.rank == 0:
        print("CHECK info: all-gather beside a GEMM on the other SMs: " + "; ".join(res), flush=True)
    flux_shmem.barrier()


@check("emulation")
def fused_gemm_costs(rt):
    """Informational: what slows the GEMM inside a fused GEMM+RS call. The TP8 down-projection shard
    8192 x 8192 x 3584 on the fused call's GEMM SMs, interleaved in rounds (clock and power drift hit all alike):
    our gemm_only (its own configuration and swizzle); the fused call's configuration plain, with the M-tile
    counters its epilogue raises, with the fused M-tile order, with both (and swizzle 4); and the GEMM stage of the
    real fused call (the reduce kernel beside it). The GEMM-only variants run on a second, throwaway op (they
    leave its counters off the epoch). 2026-12-04: the counters cost 5% with two system fences per tile, nothing
    with one."""
    from benchmarks import metrics
    from flux_shmem.runtime import stall
    if rt.world_size == 1:
        raise Skip("needs 2 or more PEs")
    m, n, k = 8192, 8192, 3584
    g = torch.Generator(device="cuda").manual_seed(77 + rt.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g).t()
    op = flux_shmem.GEMMReduceScatter(m, n, k, torch.bfloat16, mode="fused")
    scratch = flux_shmem.GEMMReduceScatter(m, n, k, torch.bfloat16, mode="fused")
    plan = op.call_plan(m, "nk")

    def fused_stage(calls: int) -> list:
        marks = []
        for _ in range(calls):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            with stall.timed_stages() as traced:
                op(a, b)
            marks.append((start, traced[0]))
        torch.cuda.synchronize()
        return [metrics.fused_gemm_ms(stall.stage_offsets_ms(tr, start)) for start, tr in marks]

    def raw(counters, order, swizzle=plan.swizzle):
        return lambda: scratch._gemm("nk", a, b, scratch.engine.partial.data_ptr(), None, m, counters=counters,
                                     sm_count=plan.gemm_sms, order=plan.order if order else None,
                                     swizzle=swizzle, choice=plan.gemm)
    variants = {"gemm_only": lambda: op.gemm_only(a, b, sm_count=plan.gemm_sms), "plain": raw(False, False),
                "counters": raw(True, False), "order": raw(False, True), "counters+order": raw(True, True),
                "counters+order swizzle 4": raw(True, True, 4), "fused call's GEMM stage": None}
    samples = {name: [] for name in variants}
    for rnd in range(6):
        for name in (list(variants) if rnd % 2 == 0 else list(variants)[::-1]):
            flux_shmem.barrier()
            if variants[name] is None:
                fused_stage(1)  # warm-up after the switch
                samples[name] += fused_stage(4)
            else:
                variants[name]()
                samples[name] += per_call_ms(variants[name], lambda: None, 4)
    out = {name: sorted(ts)[len(ts) // 2] for name, ts in samples.items()}
    if rt.rank == 0:
        base = out["gemm_only"]
        print(f"CHECK info: GEMM+RS {m}x{n}x{k} on {plan.gemm_sms} CTAs ({plan.gemm.config}, swizzle {plan.swizzle}; "
              f"gemm_only: {op.gemm_choice(m, 'nk', plan.gemm_sms).describe()}): "
              + "; ".join(f"{k_} {v:.3f} ms ({v / base:.3f}x)" for k_, v in out.items()), flush=True)
    flux_shmem.barrier()


def shard_gemms(rt, seed: int):
    """The TP8 Llama-3-70B up-projection shard GEMM (8192 x 3584 x 8192 bf16, B an [N, K] weight) on fresh random
    inputs, as cuBLAS and as our gemm_only on the whole SM budget: ((m, n, k), op, {label: fn})."""
    m, n, k = 8192, 3584, 8192
    g = torch.Generator(device="cuda").manual_seed(seed + rt.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    op = flux_shmem.AllGatherGEMM(m * rt.world_size, n, k, torch.bfloat16, mode="decomposed")
    return (m, n, k), op, {"cuBLAS": lambda: a @ w.t(), f"ours ({op.sms} CTAs)": lambda: op.gemm_only(a, w.t())}


def per_call_ms(fn, before, calls: int) -> list:
    """Device ms of `calls` calls of fn, sorted, each bracketed by CUDA events after `before()` (outside them)."""
    ts = []
    for _ in range(calls):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        ts.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in ts)


@check("gemm")
def per_call_timing(rt):
    """Informational: one GEMM timed per call after a device sync (the GPU idle before each call), as the
    benchmarks do on a shared GPU, with the host time of the launch itself; cuBLAS beside ours. Under MPS our
    GEMM's median was twice its minimum this way (cuBLAS's was not): a host launch path slower than the kernel
    would show here as launch ms ~ the gap."""
    import time
    (m, n, k), _, fns = shard_gemms(rt, 11)
    for name, fn in fns.items():
        fn()
        dev, host = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end))
        dev.sort()
        host.sort()
        print(f"CHECK note: PE {rt.rank} {name} {m}x{n}x{k} per call after a sync: device median {dev[10]:.3f} ms, "
              f"min {dev[0]:.3f} ms; host launch median {host[10]:.3f} ms, max {host[-1]:.3f} ms "
              f"(MPS {os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE') or 'off'})", flush=True)


@check("gemm")
def host_path_profile(rt):
    """Informational: where a call's host time goes (cProfile over 30 calls, top functions by own time), for our
    gemm_only and, with several PEs, one fused call of each op. A host path slower than the GPU shows in every
    per-call measurement (per_call_timing) and in eager use whenever the GPU waits for the host."""
    import cProfile
    import pstats
    import io
    (m, n, k), op, fns = shard_gemms(rt, 13)
    W = rt.world_size
    calls = {"gemm_only": fns[f"ours ({op.sms} CTAs)"]}
    if W > 1:
        g = torch.Generator(device="cuda").manual_seed(5 + rt.rank)
        ag = flux_shmem.AllGatherGEMM(2048 * W, 1024, 1024, torch.bfloat16, mode="fused", engine="sm")
        xa = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        wa = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        rs = flux_shmem.GEMMReduceScatter(2048 * W, 1024, 1024, torch.bfloat16, mode="fused")
        calls["AllGatherGEMM fused"] = lambda: ag(xa, wa.t())
        xr = xa.repeat(W, 1)
        calls["GEMMReduceScatter fused"] = lambda: rs(xr, wa.t())
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        rt.host.barrier()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(30):
            fn()
        prof.disable()
        host_ms = (time.perf_counter() - t0) * 1e3 / 30
        torch.cuda.synchronize()
        rt.host.barrier()
        if rt.rank == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(8)
            rows = [ln for ln in text.getvalue().splitlines() if ln.strip()[:1].isdigit()][:8]
            print(f"CHECK note: host path of {name}: {host_ms * 1e3:.0f} us per call (profiled); top by own "
                  "time (ncalls tottime percall cumtime percall where):", flush=True)
            for ln in rows:
                print(f"CHECK note:   {ln.strip()}", flush=True)


@check("emulation")
def persistent_grid_slack(rt):
    """Informational: our persistent GEMM per call after a host sync + barrier (the benchmark's protocol on a
    shared GPU), against cuBLAS. Under MPS its median was about twice its minimum while cuBLAS's was not, and 2 or
    4 SMs of slack in the grid did not change that reliably, nor did other configurations, an unclustered
    128x256 build included (2026-12-03, benchmarks/RESULTS.md fourth session): one PE's grid runs as a grid of half
    its size would. The variants stay as the measurement of that."""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    (m, n, k), op, fns = shard_gemms(rt, 17)
    from benchmarks import timing as flux_timing
    g = torch.Generator(device="cuda").manual_seed(23 + rt.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    from flux_shmem.kernels import config as kconfig, plain

    def forced(cfg: str, sms: int):
        c = kconfig.choose(m, n, k, torch.bfloat16, "nk", sms)
        c = kconfig.Choice(cfg, c.swizzle if cfg == c.config else 1, 1, "forced", "persistent_grid_slack")
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        return lambda: plain.gemm(a, w.t(), out=out, choice=c, sm_count=sms)

    S = op.sms
    # (name, fn, extra GPU lead of PE r in us: r * stagger)
    variants = [("cuBLAS", lambda: a @ w.t(), 0), (f"ours {S} CTAs", lambda: op.gemm_only(a, w.t()), 0),
                (f"ours {S} CTAs, PEs staggered 400 us", lambda: op.gemm_only(a, w.t()), 400),
                (f"ours {S - 4} CTAs", lambda: op.gemm_only(a, w.t(), sm_count=S - 4), 0),
                (f"ours {S // 2} CTAs", lambda: op.gemm_only(a, w.t(), sm_count=S // 2), 0),
                (f"ours 128x128_c2x1_pp {S} CTAs", forced("128x128_c2x1_pp", S), 0),
                (f"ours 256x128_c1x2 {S} CTAs", forced("256x128_c1x2", S), 0)]
    for name, fn, stagger in variants:
        fn()

        def before(stagger=stagger):
            torch.cuda.synchronize()
            rt.host.barrier()
            # ~1 ms of GPU lead: the host enqueues the call before the GPU reaches it
            flux_timing.gpu_sleep(1000 + stagger * rt.rank)
        ms = per_call_ms(fn, before, 16)
        meds, mins = rt.host.allgather(ms[len(ms) // 2]), rt.host.allgather(ms[0])
        if rt.rank == 0:
            print(f"CHECK note: {name} {m}x{n}x{k} per call after host sync + barrier + GPU lead: median "
                  f"{' / '.join(f'{x:.3f}' for x in meds)} ms (per PE), min {min(mins):.3f} ms (budget "
                  f"{op.budget.sms} SMs, {op.budget.source})", flush=True)


_SM_IDS_SRC = r"""
extern "C" __global__ void fs_sm_ids(unsigned int* out, long long spin) {
  unsigned int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  if (threadIdx.x == 0) out[blockIdx.x] = id;
}
"""


@check("emulation")
def sm_partition(rt):
    """How many SMs each PE's kernels run on while all PEs run at once: a kernel of many short blocks records
    %smid per block; in a green context (FLUX_SHMEM_SM_PARTITION=green) no more than the context's count. Under
    MPS %smid is virtual (2026-12-03: two clients at 50% both saw SMs 0..65, and both green contexts 0..63), so
    this cannot show whether the PEs' SMs are disjoint; persistent_grid_slack and mps_concurrency show it by time
    (with green contexts neither PE's persistent grid lost half its speed, and the PEs ran at once at x0.92-1.11
    of alone)."""
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, Stream, launch
    from flux_shmem.runtime import partition
    part = partition.active(rt.device)
    dev = Device(rt.device)
    arch = "sm_" + "".join(str(x) for x in dev.compute_capability)
    kern = Program(_SM_IDS_SRC, code_type="c++", options=ProgramOptions(arch=arch)).compile("cubin") \
        .get_kernel("fs_sm_ids")
    blocks = 4096
    out = torch.full((blocks,), -1, dtype=torch.int32, device="cuda")
    stream = Stream.from_handle(torch.cuda.current_stream().cuda_stream)
    clock_hz = 1.98e9
    import numpy as np
    torch.cuda.synchronize()
    rt.host.barrier()
    launch(stream, LaunchConfig(grid=blocks, block=128), kern, out.data_ptr(), np.int64(int(20e-6 * clock_hz)))
    torch.cuda.synchronize()
    ids = out.cpu().tolist()
    assert all(0 <= i < 1024 for i in ids), f"PE {rt.rank}: a block recorded no SM id"
    mine = sorted(set(ids))
    sets = rt.host.allgather(mine)
    if rt.rank == 0:
        desc = "; ".join(f"PE {pe}: {len(s)} SMs [{s[0]}..{s[-1]}]" for pe, s in enumerate(sets))
        print(f"CHECK note: sm_partition ({part.describe() if part else 'no partition'}): {desc} (SM ids as the "
              "context sees them: virtual under MPS)", flush=True)
    if part is not None:
        assert len(mine) <= part.sms, f"PE {rt.rank}: ran on {len(mine)} SMs, its green context has {part.sms}"


@check("emulation")
def mps_concurrency(rt):
    """Whether PEs sharing this GPU really run at once on separate SMs: the same GEMM (cuBLAS, and our persistent
    gemm_only on the whole SM budget), timed on each PE alone and on all PEs at once. Disjoint SMs give "at once"
    about the "alone" time (compute-bound, a shared power limit aside); PEs that share SMs or take turns give W
    times it, and then an emulated-link overlap figure means little."""
    W = rt.world_size
    if W == 1:
        raise Skip("needs 2 or more PEs")
    (m, n, k), op, fns = shard_gemms(rt, 7)

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def sync_all():
        torch.cuda.synchronize()
        flux_shmem.barrier()
        torch.cuda.synchronize()

    for name, fn in fns.items():
        alone = None
        for pe in range(W):
            sync_all()
            if rt.rank == pe:
                alone = timed(fn)
        sync_all()
        together = timed(fn)
        alones = rt.host.allgather(alone)
        togethers = rt.host.allgather(together)
        if rt.rank == 0:
            ratio = max(togethers) / max(alones)
            print(f"CHECK note: {name} {m}x{n}x{k}: alone {max(alones):.3f} ms, all {W} PEs at once "
                  f"{max(togethers):.3f} ms (x{ratio:.2f}; {W}x would mean turns or shared SMs), SM budget "
                  f"{op.budget.sms} ({op.budget.source})", flush=True)
        sync_all()
        # The benchmark's protocol on a shared GPU (benchmarks/baselines.py HostCollectives.sync: device sync and
        # an MPI barrier before every timed call) against a device barrier before every call (no host sync).
        def host_sync_barrier():
            torch.cuda.synchronize()
            rt.host.barrier()
        for proto, before in (("host sync + barrier", host_sync_barrier), ("device barrier", flux_shmem.barrier)):
            ms = per_call_ms(fn, before, 20)
            meds = rt.host.allgather(ms[len(ms) // 2])
            mins = rt.host.allgather(ms[0])
            if rt.rank == 0:
                print(f"CHECK note: {name}, per call after a {proto}: median {max(meds):.3f} ms, min {min(mins):.3f} "
                      "ms (max / min over PEs)", flush=True)
            sync_all()


# ------------------------------------------------------------------------------------------------------------
def expect_timeout(rt, call, what: str, *needles: str) -> None:
    """call() must return after about the runtime timeout, and check_errors then raise a report that names this PE
    and contains every needle."""
    t0 = time.time()
    call()
    torch.cuda.synchronize()
    waited = time.time() - t0
    assert rt.timeout_s * 0.9 <= waited < rt.timeout_s + 20, f"{what} returned after {waited:.1f} s"
    try:
        flux_shmem.check_errors()
    except flux_shmem.SignalTimeoutError as e:
        msg = str(e)
        assert f"PE {rt.rank}" in msg and all(n in msg for n in needles), msg
    else:
        raise AssertionError(f"{what}: timeout not reported")


@check("timeout_split_k")
def timeout_split_k(rt):
    """A split-K lock that never reaches its count (the lock region of the GEMM's workspace poisoned) makes the
    kernel time out and report the lock instead of hanging (run alone: the process's error record is claimed)."""
    assert not rt.trap_on_timeout, "run with FLUX_SHMEM_ON_TIMEOUT=raise"
    os.environ["FLUX_SHMEM_GEMM_CONFIG"] = "config=128x256_c2x1,split=2"
    m, n, k = 8192, 1280, 8192  # a last wave of tiles the split applies to, on any SM count
    op = flux_shmem.AllGatherGEMM(m * rt.world_size, n, k, torch.bfloat16, mode="decomposed")
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    choice = op.gemm_choice(m, "nk", op.sms)
    assert choice.split == 2, choice
    out = op.gemm_only(a, b)
    torch.cuda.synchronize()
    assert rel_err(out, a.float() @ b.float()) < 1e-2
    ws = op.kernel("nk", choice.config)._workspace
    ws[: 64 * 1024].view(torch.int32).fill_(-1000)  # the locks: split s waits for lock >= s, forever now
    expect_timeout(rt, lambda: op.gemm_only(a, b), "the GEMM", "GEMM split-K lock", "needed >= 1")


@check("timeout_raise")
def timeout_raise(rt):
    assert not rt.trap_on_timeout, "run with FLUX_SHMEM_ON_TIMEOUT=raise"
    pool = flux_shmem.SignalPool(2)
    expect_timeout(rt, lambda: pool.wait(1, 42), "wait", "needed >= 42", "saw 0")  # nobody ever sets it


@check("timeout_trap")
def timeout_trap(rt):
    pool = flux_shmem.SignalPool(1)
    pool.wait(0, 7)
    torch.cuda.synchronize()  # the context dies here; the watchdog has printed the report
    raise AssertionError("unreachable: the wait should have trapped")


# ------------------------------------------------------------------------------------------------------------
# Issue 25: every M without a stall
AUTO_SLACK = 1.05  # mode 'auto' may be this much slower than the best path measured beside it (issue 36)
def sweep_ms(world: int, count: int, top: int) -> list[int]:
    """`count` distinct multiples of `world` up to `top`: small ones, tile- and shard-misaligned ones, then
    geometric steps; shuffled the same way on every PE (the calls are collective)."""
    import random
    out = [world * i for i in (1, 2, 3, 5, 8, 13, 21, 33, 64, 65, 100, 127, 128, 129)]
    while len(out) < count:
        out.append(max(out[-1] + world, int(out[-1] * (top / out[-1]) ** (1 / (count - len(out) + 1)))
                       // world * world))
    out = sorted(set(min(m, top // world * world) for m in out))[:count]
    random.Random(25).shuffle(out)
    return out


@check("sweep")
def fused_ops_over_50_m(rt):
    """50 distinct M per op (mode 'auto': the fast planner's buckets), every output against fp64 torch on fresh
    inputs into a poisoned output; the host time of each first call's planning; then three M planned by
    prepare() and captured in CUDA graphs, replayed on fresh inputs."""
    W = rt.world_size
    n, k, top = 1024, 768, 6144 * W
    ms = sweep_ms(W, 50, top)
    ag = flux_shmem.AllGatherGEMM(top, n, k, torch.bfloat16, mode="auto")
    rs = flux_shmem.GEMMReduceScatter(top, n, k, torch.bfloat16, mode="auto")
    b_ag = weight(k, n, "nk", torch.bfloat16, 71)
    bs = [weight(k, n, "nk", torch.bfloat16, 80 + pe) for pe in range(W)]
    plan_ms, paths, worst, bad = [], {}, 0.0, []
    for i, m in enumerate(ms):
        a_all = gathered_inputs(rt, (m // W, k), torch.bfloat16, 300 + i)
        t0 = time.perf_counter()
        ag.call_plan(m, "nk")
        plan_ms.append((time.perf_counter() - t0) * 1e3)
        out = ag(a_all[rt.rank], b_ag)
        e = rel_err(out, torch.cat(a_all).double() @ b_ag.double())
        if not e < 1e-2:  # (every M runs: one failure must not hide the others)
            bad.append(f"AllGatherGEMM M={m} ({ag.path(m)}): rel err {e}")
        worst = max(worst, e)
        paths.setdefault(f"ag {ag.path(m)}", []).append(m)
        a_all = gathered_inputs(rt, (m, k), torch.bfloat16, 600 + i)
        t0 = time.perf_counter()
        rs.call_plan(m, "nk")
        plan_ms.append((time.perf_counter() - t0) * 1e3)
        out = rs(a_all[rt.rank], bs[rt.rank])
        full = sum(a.double() @ b.double() for a, b in zip(a_all, bs))
        seg = m // W
        e = rel_err(out, full[rt.rank * seg:(rt.rank + 1) * seg])
        if not (out.shape == (seg, n) and e < 2e-2):
            bad.append(f"GEMMReduceScatter M={m} ({rs.path(m)}): rel err {e}, shape {tuple(out.shape)}")
        worst = max(worst, e)
        paths.setdefault(f"rs {rs.path(m)}", []).append(m)
    flux_shmem.barrier()
    plan_ms.sort()
    if rt.rank == 0:
        print(f"CHECK info: 50 M per op ({min(ms)}..{max(ms)}, n {n}, k {k}, world {W}): worst rel err {worst:.2e}; "
              f"paths " + ", ".join(f"{p} x{len(v)}" for p, v in sorted(paths.items())) +
              f"; first-call planning median {plan_ms[len(plan_ms) // 2]:.2f} ms, max {plan_ms[-1]:.2f} ms",
              flush=True)
    assert not bad, f"{len(bad)} of {2 * len(ms)} calls wrong: " + "; ".join(bad)
    # a CUDA graph captured after prepare(): the capture finds its plans made
    fresh = [m for m in (448 * W, 2000 * W, 5000 * W) if m not in ms]
    ag.prepare(fresh)
    rs.prepare(fresh)
    for m in fresh:
        a = torch.empty((m // W, k), device="cuda", dtype=torch.bfloat16)
        g, out = capture(lambda: ag(a, b_ag))
        x = torch.empty((m, k), device="cuda", dtype=torch.bfloat16)
        g2, out2 = capture(lambda: rs(x, bs[rt.rank]))
        for seed in (1, 2):
            a_all = gathered_inputs(rt, (m // W, k), torch.bfloat16, 900 + seed + m)
            x_all = gathered_inputs(rt, (m, k), torch.bfloat16, 950 + seed + m)
            a.copy_(a_all[rt.rank])
            x.copy_(x_all[rt.rank])
            poison(out)
            poison(out2)
            g.replay()
            g2.replay()
            torch.cuda.synchronize()
            e = rel_err(out, torch.cat(a_all).double() @ b_ag.double())
            assert e < 1e-2, f"graph replay after prepare: AllGatherGEMM M={m}: rel err {e}"
            full = sum(p.double() @ q.double() for p, q in zip(x_all, bs))
            e = rel_err(out2, full[rt.rank * (m // W):(rt.rank + 1) * (m // W)])
            assert e < 2e-2, f"graph replay after prepare: GEMMReduceScatter M={m}: rel err {e}"
        flux_shmem.barrier()
    if rt.rank == 0:
        print(f"CHECK info: graphs captured after prepare({fresh}) replay correctly (both ops)", flush=True)


def loop_ms(rt, fn, calls: int = 30, reps: int = 5) -> float:
    """Device ms per call of `calls` back-to-back calls (all PEs at once, after a barrier), median of `reps`."""
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        rt.host.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / calls)
    return sorted(out)[reps // 2]


@check("sweep")
def small_m_auto_and_host_overhead(rt):
    """At M <= 512, mode 'auto' against the best of fused, decomposed and cuBLAS + our collective, per call back to
    back (fails where auto is more than AUTO_SLACK over the best, issue 36); and the host time of a call whose plan
    is cached (launch path only)."""
    W = rt.world_size
    res, slow = [], []
    for name, n, k in (("AllGatherGEMM", 3584, 8192), ("GEMMReduceScatter", 8192, 3584)):
        top = 512 * W
        g = torch.Generator(device="cuda").manual_seed(17 + rt.rank)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
        cls = getattr(flux_shmem, name)
        ops = {mode: cls(top, n, k, torch.bfloat16, mode=mode) for mode in ("fused", "decomposed", "auto")}
        coll = flux_shmem.AllGather(top // W, k) if name == "AllGatherGEMM" else flux_shmem.ReduceScatter(top, n)
        for m in (64, 128, 256, 512):
            m = max(W, m // W * W)
            rows = m // W if name == "AllGatherGEMM" else m
            a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
            if name == "AllGatherGEMM":
                def cublas():
                    return coll(a) @ w.t()
            else:
                def cublas():
                    buf = coll.input_buffer(m)
                    torch.matmul(a, w.t(), out=buf)
                    return coll(buf)
            t = {mode: loop_ms(rt, lambda op=op: op(a, w.t())) for mode, op in ops.items()}
            t["cuBLAS+ours"] = loop_ms(rt, cublas)
            best = min(v for p, v in t.items() if p != "auto")
            res.append(f"{name} M={m}: auto ({ops['auto'].path(m)}) {t['auto'] * 1e3:.0f} us = "
                       f"{t['auto'] / best:.3f}x best; " + ", ".join(f"{p} {v * 1e3:.0f}" for p, v in t.items()
                                                                    if p != "auto"))
            if t["auto"] > AUTO_SLACK * best:
                slow.append(res[-1])
        # host time of one call with its plan cached (the launch path): median of 50, no sync between
        op = ops["fused"]
        m = 512 * W // W * W
        a = torch.randn(m // W if name == "AllGatherGEMM" else m, k, device="cuda", dtype=torch.bfloat16,
                        generator=g)
        op(a, w.t())
        torch.cuda.synchronize()
        rt.host.barrier()
        host = []
        for _ in range(50):
            t0 = time.perf_counter()
            op(a, w.t())
            host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        host.sort()
        res.append(f"{name} fused M={m}: host {host[25]:.0f} us per call (median of 50, plan cached), "
                   f"max {host[-1]:.0f} us")
        rt.host.barrier()
    if rt.rank == 0:
        for r in res:
            print(f"CHECK info: {r}", flush=True)
    assert not slow, f"auto more than {AUTO_SLACK}x the best path measured: " + " | ".join(slow)


# Issue 36: mode 'auto' never slower than cuBLAS + our collective. Per-PE shard shapes (n, k) of three popular
# models at TP8 (AG: column-parallel, RS: row-parallel), M over the whole range a user calls with.
AUTO_SWEEP_SHAPES = {"AllGatherGEMM": ((3584, 8192), (1280, 8192), (1792, 4096)),
                     "GEMMReduceScatter": ((8192, 3584), (8192, 1024), (4096, 1792))}
AUTO_SWEEP_MS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def interleaved_ms(rt, fns: dict, calls: int, reps: int) -> dict:
    """Device ms per call of `calls` back-to-back calls of each fn (all PEs at once, after a barrier), median of
    `reps` rounds that alternate the fns' order (drift hits all alike); the largest over PEs."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict = {name: [] for name in names}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(reps):
        for name in (names if r % 2 == 0 else names[::-1]):
            torch.cuda.synchronize()
            rt.host.barrier()
            start.record()
            for _ in range(calls):
                fns[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    every = rt.host.allgather(med)
    return {name: max(pe[name] for pe in every) for name in names}


@check("autosweep")
def auto_vs_cublas_sweep(rt):
    """Mode 'auto' against fused, decomposed and cuBLAS + our collective, every op on three shard shapes, M from 64
    to 16384 (AUTO_SWEEP_MS), outputs checked first; fails where auto runs more than AUTO_SLACK over the best path
    measured beside it. Prints one line per case and `auto vs cuBLAS+collective: min R over S cases` (R: cuBLAS +
    collective time / auto time)."""
    W = rt.world_size
    assert W > 1, "autosweep compares communication paths: run it with 2 or more PEs"
    ms_all = [int(x) for x in os.environ.get("FLUX_SHMEM_SWEEP_MS", "").split(",") if x] or list(AUTO_SWEEP_MS)
    rows, slow = [], []
    for name, shapes in AUTO_SWEEP_SHAPES.items():
        cls = getattr(flux_shmem, name)
        for n, k in shapes:
            top = max(ms_all) // W * W
            g = torch.Generator(device="cuda").manual_seed(36 + rt.rank + n + k)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
            ops = {mode: cls(top, n, k, torch.bfloat16, mode=mode) for mode in ("auto", "fused", "decomposed")}
            coll = flux_shmem.AllGather(top // W, k) if name == "AllGatherGEMM" else flux_shmem.ReduceScatter(top, n)
            for m in ms_all:
                m = max(W, m // W * W)
                rows_in = m // W if name == "AllGatherGEMM" else m
                a_all = gathered_inputs(rt, (rows_in, k), torch.bfloat16, m + n)
                a = a_all[rt.rank]
                if name == "AllGatherGEMM":
                    def cublas(a=a):
                        return coll(a) @ w.t()
                    ref = (torch.cat(a_all).double() @ w.double().t()).float()
                else:
                    def cublas(a=a, m=m):
                        buf = coll.input_buffer(m)
                        torch.matmul(a, w.t(), out=buf)
                        return coll(buf)
                    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16,
                                      generator=torch.Generator(device="cuda").manual_seed(36 + pe + n + k)) / k ** 0.5
                          for pe in range(W)]
                    seg = m // W
                    ref = sum(x.double() @ v.double().t() for x, v in zip(a_all, ws))[rt.rank * seg:(rt.rank + 1) *
                                                                                       seg].float()
                fns = {mode: (lambda op=op, a=a: op(a, w.t())) for mode, op in ops.items()}
                fns["cublas+coll"] = cublas
                for mode, fn in fns.items():  # correct first (fresh inputs, fresh outputs)
                    e = rel_err(fn(), ref)
                    assert e < 2e-2, f"{name} {mode} M={m} n={n} k={k}: rel err {e}"
                calls = max(3, min(30, int(3e11 / (2 * m * n * k))))  # a few ms of work per round at least
                t = interleaved_ms(rt, fns, calls, 5)
                best = min(v for p, v in t.items() if p != "auto")
                r = t["cublas+coll"] / t["auto"]
                path = ops["auto"].path(m)
                rows.append((r, f"{name} {n}x{k} M={m}"))
                line = (f"autosweep {name} {n}x{k} M={m}: auto ({path}) {t['auto'] * 1e3:.1f} us, fused "
                        f"{t['fused'] * 1e3:.1f}, decomposed {t['decomposed'] * 1e3:.1f}, cuBLAS+collective "
                        f"{t['cublas+coll'] * 1e3:.1f}; cuBLAS+collective / auto {r:.3f}, auto / best "
                        f"{t['auto'] / best:.3f}")
                if t["auto"] > AUTO_SLACK * best:
                    slow.append(line)
                if rt.rank == 0:
                    print(f"CHECK info: {line}", flush=True)
            torch.cuda.synchronize()
            flux_shmem.barrier()
    worst = min(rows)
    if rt.rank == 0:
        print(f"CHECK info: auto vs cuBLAS+collective: min {worst[0]:.3f} over {len(rows)} cases (at {worst[1]}), "
              f"world {W}", flush=True)
    assert not slow, f"{len(slow)} of {len(rows)} cases: auto more than {AUTO_SLACK}x the best path: " + \
        " | ".join(slow)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_checks  # noqa: E402 (group moe: the MoE ops, issue 38)

CHECKS["moe"] = list(moe_checks.CHECKS)


def plan_for(groups: list[str]) -> list:
    """(group, check) pairs for group names or check names ("all": every group but the timeouts)."""
    if groups == ["all"]:
        groups = ["runtime", "collectives", "gemm", "hazards", "nn"]
    by_name = {fn.__name__: (g, fn) for g, fns in CHECKS.items() for fn in fns}
    return [(g, fn) for name in groups for g, fn in ([(name, f) for f in CHECKS[name]] if name in CHECKS
                                                     else [by_name[name]])]


def run_checks(rt, plan) -> int:
    """Run the checks; prints "CHECK <name> ok" (rank 0) or the failure (every failing PE). Returns failures."""
    failures = 0
    for g, fn in plan:
        t0 = time.time()
        try:
            fn(rt)
            torch.cuda.synchronize()
            if "timeout" not in g:
                flux_shmem.check_errors()
            if rt.rank == 0:
                print(f"CHECK {fn.__name__} ok ({time.time() - t0:.1f} s, world {rt.world_size}, "
                      f"node_size {rt.node_size}, launcher {rt.launcher})", flush=True)
        except Skip as e:
            if rt.rank == 0:
                print(f"CHECK {fn.__name__} skip: {e} (world {rt.world_size})", flush=True)
        except Exception:
            failures += 1
            print(f"CHECK {fn.__name__} FAILED on PE {rt.rank}:\n{traceback.format_exc()}", flush=True)
            if "timeout" in g:
                raise
    return failures


def main(argv: list[str]) -> int:
    plan = plan_for(argv or ["all"])
    rt = flux_shmem.init()  # mpirun / flux-launch or torchrun, detected
    failures = run_checks(rt, plan)
    flux_shmem.finalize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
