"""GPU checks, groups runtime and collectives: the runtime, symmetric memory, signals, the standalone
AllGather / ReduceScatter against torch, their argument errors."""
from __future__ import annotations

import os

import torch

import flux_shmem
from common import Skip, capture, check, expect_errors, gathered_inputs, rel_err


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
    expect_errors(bad)

