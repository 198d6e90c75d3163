"""GPU checks, group gemm: both fused ops and gemm_only against fp64 torch (every mode and engine, ragged
shapes, graph replays, reduce units, argument errors, captures right after prepare), and the per-call timing
and host-path notes."""
from __future__ import annotations

import dataclasses
import os
import time

import torch

import flux_shmem
from common import GEMM_SHAPES, capture, check, expect_errors, gathered_inputs, poison, rel_err, weight


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
    expect_errors(bad)


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


