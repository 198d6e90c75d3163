"""GPU checks, group nn: flux_shmem.nn layers and the Llama block (benchmarks/llama_block.py) against
unsharded fp64 references; tests/test_gpu_checks_cpu.py runs most of them on the CPU (DEVICE)."""
from __future__ import annotations


import torch

import flux_shmem
from common import check, poison, rel_err


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


